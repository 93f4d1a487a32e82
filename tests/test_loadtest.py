"""The load test: workloads, shapes and SLO gates on their own, then a short headless smoke run
(`python -m loadtest.run`, locust in a subprocess) against a Serve started here on loopback with a
tiny random model, which must finish without a single failed request and write its CSVs and plot;
then the chat workload, against a tiny model with a chat template and against one without.

Nothing here imports locust: it monkey-patches the standard library with gevent at import, which
would change the threads and sockets of every test that runs after it in this process.
"""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import run as loadtest_run
from loadtest.shapes import spike_users, step_users
from loadtest.slo import E2E, TPOT, TTFT, EntrySummary, slo_problems
from loadtest.workloads import (
    BUILTIN_CHAT,
    BUILTIN_CODE,
    SAMPLING,
    adapt,
    build_prompts,
    bytes_to_ids,
    chat_messages,
    load_prompts,
    pick_kind,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
APP = "loadtest-smoke"
CHAT_APP = "loadtest-chat"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


# --- pieces -----------------------------------------------------------------------------------

def app_args(model: str, max_prompt_tokens: int) -> dict:
    """A small engine replica on one CPU, no speculation: the app the load tests run against."""
    return {"model": model, "speculative": None, "device": "cpu", "dtype": "float32", "max_num_seqs": 8,
            "max_queued_requests": 32, "max_prompt_tokens": max_prompt_tokens, "max_tokens": 64,
            "default_max_tokens": 16, "num_cpus": 1}


def test_shapes_follow_their_schedules() -> None:
    assert [step_users(t, 8, 60) for t in (0, 14.9, 15, 30, 45, 59.9, 60)] == [2, 2, 4, 6, 8, 8, 8]
    assert step_users(0, 1, 60) == 1
    assert [spike_users(t, 8, 100) for t in (0, 39, 40, 59, 60, 99)] == [2, 2, 8, 8, 2, 2]
    assert spike_users(50, 2, 100) == 2 and spike_users(0, 2, 100) == 1


def test_prompts_fit_the_served_model() -> None:
    assert adapt({"text": "def f():"}, has_tokenizer=True, vocab_size=97, max_prompt_tokens=64) == "def f():"
    ids = adapt({"text": "def f():"}, has_tokenizer=False, vocab_size=97, max_prompt_tokens=64)
    assert ids == bytes_to_ids("def f():", 97) and all(3 <= t < 97 for t in ids)
    assert bytes_to_ids("ab", 97) == [6, 7]
    # Held-out windows from a bigger vocabulary fold into a small one; long prompts keep their end.
    assert adapt({"token_ids": [5, 96, 200, 7000]}, has_tokenizer=True, vocab_size=97, max_prompt_tokens=3) == [
        3 + 96 % 94, 3 + 200 % 94, 3 + 7000 % 94,
    ]
    assert adapt({"token_ids": [5, 6, 7]}, has_tokenizer=False, vocab_size=97, max_prompt_tokens=2) == [6, 7]
    # A held-out window goes as ids to the model that cut it, as text to another model.
    window = {"token_ids": [5, 6, 7], "text": "x = 1", "ids_for": "models/target"}
    assert adapt(window, model="models/target", has_tokenizer=True, vocab_size=97, max_prompt_tokens=64) == [5, 6, 7]
    assert adapt(window, model="SmolLM2-135M-Instruct", has_tokenizer=True, vocab_size=49152,
                 max_prompt_tokens=64) == "x = 1"


def test_workloads_pick_kinds_and_sampling() -> None:
    rng = random.Random(0)
    assert {pick_kind("code", rng) for _ in range(20)} == {"code"}
    assert {pick_kind("mix", rng) for _ in range(50)} == {"code", "text"}  # chat only when asked for
    assert {pick_kind("chat", rng) for _ in range(20)} == {"chat"}
    with pytest.raises(ValueError, match="workload: must be one of code, text, chat, mix, got 'poetry'"):
        pick_kind("poetry", rng)
    assert SAMPLING["text"]["temperature"] == 1.0 and SAMPLING["code"]["temperature"] == 0.0
    assert SAMPLING["chat"] == {"temperature": 0.7, "top_p": 0.9}
    builtin = load_prompts("")
    assert [p["text"] for p in builtin["code"]] == BUILTIN_CODE and builtin["text"]
    assert [p["text"] for p in builtin["chat"]] == BUILTIN_CHAT
    assert chat_messages({"text": "Why?"}) == [{"role": "user", "content": "Why?"}]


def test_chat_prompts_come_from_the_heldout_file_else_built_in(tmp_path: Path) -> None:
    # tmp_path has no models/target: code falls back to its snippets before importing transformers
    prompts = build_prompts(num=2, models_dir=tmp_path)
    assert [p["text"] for p in prompts["chat"]] == BUILTIN_CHAT
    assert prompts["sources"]["chat"].startswith("built-in questions (no held-out chat prompts:")
    chat_file = tmp_path / "chat_heldout_prompts.json"
    chat_file.write_text(json.dumps({"about": "test", "prompts": ["What is a monad?", "Name a prime.", "Why?"]}))
    prompts = build_prompts(num=2, models_dir=tmp_path)
    assert prompts["chat"] == [{"text": "What is a monad?"}, {"text": "Name a prime."}]
    assert prompts["sources"]["chat"] == f"2 held-out chat prompts ({chat_file})"
    assert [p["text"] for p in build_prompts(models_dir=tmp_path, heldout=False)["chat"]] == BUILTIN_CHAT
    for bad in ({"prompts": []}, {"prompts": ["ok", 3]}, ["a list"]):
        chat_file.write_text(json.dumps(bad))
        prompts = build_prompts(num=2, models_dir=tmp_path)
        assert prompts["chat"] == [{"text": t} for t in BUILTIN_CHAT]
        assert "want {\"prompts\": [non-empty strings]}" in prompts["sources"]["chat"], prompts["sources"]


def test_prompt_files_without_chat_still_serve_code_and_text(tmp_path: Path) -> None:
    """A prompts file written before the chat workload has code and text only: code, text and mix
    load it; chat refuses it by name instead of failing on its first request."""
    old = {key: value for key, value in build_prompts(heldout=False).items() if key != "chat"}
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(old))
    for workload in ("code", "text", "mix"):
        assert load_prompts(str(path), workload)["code"] == old["code"]
    with pytest.raises(ValueError, match="no 'chat' prompts for the 'chat' workload"):
        load_prompts(str(path), "chat")
    path.write_text(json.dumps({**old, "text": []}))
    with pytest.raises(ValueError, match="no 'text' prompts for the 'mix' workload"):
        load_prompts(str(path), "mix")
    assert load_prompts(str(path), "code")["code"] == old["code"]


def test_slo_gates() -> None:
    ok = {TTFT: EntrySummary(40, 0, 300.0), TPOT: EntrySummary(40, 0, 40.0), E2E: EntrySummary(40, 0, 2000.0)}
    limits = {TTFT: 500.0, TPOT: 50.0, E2E: 0.0}
    assert slo_problems(ok, limits) == []
    slow = {**ok, TPOT: EntrySummary(40, 0, 61.0)}
    assert slo_problems(slow, limits) == ["TPOT: p95 61 ms > SLO 50 ms"]
    failed = {**ok, E2E: EntrySummary(41, 1, 2000.0)}
    (problem,) = slo_problems(failed, limits, errors=["1 x UNAVAILABLE: no replica"])
    assert problem.startswith("1 of 41 requests failed") and "UNAVAILABLE" in problem
    assert slo_problems(failed, limits, max_fail_ratio=0.05) == []
    assert slo_problems({}, limits) == ["no request completed"]
    assert slo_problems({E2E: EntrySummary(3, 0, 10.0)}, limits)[0].startswith("TTFT: no measurements")


def test_served_slo_defaults_come_from_the_serve_config() -> None:
    slo = loadtest_run.served_slo()
    assert slo["ttft_p95_ms"] > 0 and slo["tpot_p95_ms"] > 0
    args = loadtest_run.parse_args([])
    assert (args.slo_ttft_ms, args.slo_tpot_ms, args.target) == (slo["ttft_p95_ms"], slo["tpot_p95_ms"], "localhost:9000")
    command = loadtest_run.locust_command(loadtest_run.parse_args(["--shape", "spike"]), Path("out/x"), Path("p.json"))
    assert command[command.index("-f") + 1].endswith("loadtest/locustfile.py," + str(loadtest_run.SHAPES["spike"]))
    assert command[command.index("--workload") + 1] == "mix"
    command = loadtest_run.locust_command(loadtest_run.parse_args(["--workload", "chat"]), Path("x"), Path("p.json"))
    assert command[command.index("--workload") + 1] == "chat"


def test_plot_reads_locusts_full_history(tmp_path: Path) -> None:
    header = ["Timestamp", "User Count", "Type", "Name", "Requests/s", "Failures/s", "50%", "66%", "75%", "80%",
              "90%", "95%", "98%", "99%", "99.9%", "99.99%", "100%", "Total Request Count", "Total Failure Count"]
    rows = [
        [999, 1, "grpc", "TTFT", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1000, 1, "grpc", "TTFT", 0, 0, "N/A", "N/A", "N/A", "N/A", "N/A", "N/A", "N/A", "N/A", "N/A", "N/A", "N/A", 0, 0],
        [1001, 2, "grpc", "TTFT", 1, 0, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 3, 0],
        [1002, 4, "grpc", "TPOT", 1, 0, 5, 5, 5, 5, 6, 7, 8, 9, 9, 9, 9, 3, 0],
        [1002, 4, "", "Aggregated", 1, 0, 5, 5, 5, 5, 6, 7, 8, 9, 9, 9, 9, 3, 0],
    ]
    history = tmp_path / "x_stats_history.csv"
    with open(history, "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    series = loadtest_run.read_history(history)
    assert set(series) == {"TTFT", "TPOT"}
    assert series["TTFT"]["t"] == [2.0] and series["TTFT"]["95%"] == [35.0] and series["TPOT"]["users"] == [4.0]
    png = loadtest_run.plot_history(history, tmp_path / "x.png", "test", {"TPOT": 8.0})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_heldout_code_prompts_when_the_target_is_trained() -> None:
    if not (REPO_ROOT / "models" / "target" / "tokenizer.json").is_file():
        pytest.skip("models/target has no tokenizer yet: the code workload uses built-in snippets")
    prompts = build_prompts(num=4, prompt_len=32)
    assert "held-out" in prompts["sources"]["code"]
    assert [len(p["token_ids"]) for p in prompts["code"]] == [32] * 4
    assert all(p["text"] and p["ids_for"] == "models/target" for p in prompts["code"])


# --- the smoke run ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served_ports(tiny_llama: str, serve_instance) -> Iterator[tuple[int, int]]:
    """(gRPC port, HTTP port) of one Serve app."""
    from ray import serve

    from deployments.app import build_app
    from deployments.client import SpecDecodeClient

    port, http_port = serve_instance.grpc_port, serve_instance.http_port
    args = app_args(tiny_llama, max_prompt_tokens=64)
    with serve_instance.apps(APP):
        serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
        with SpecDecodeClient(f"127.0.0.1:{port}", application=APP) as client:
            client.wait_ready(60)
        yield port, http_port


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_headless_smoke_run_has_no_failures(served_ports: tuple[int, int], tmp_path: Path) -> None:
    """12 s of a step shape up to 4 users, mixed workload, through `python -m loadtest.run`.
    Latency gates are generous (the machine is shared); any failed request fails the run."""
    command = [
        sys.executable, "-m", "loadtest.run", "--target", f"127.0.0.1:{served_ports[0]}", "--application", APP,
        "--users", "4", "--spawn-rate", "4", "--run-time", "12s", "--shape", "step", "--workload", "mix",
        "--max-tokens", "16", "--no-heldout", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "10000",
        "--out-dir", str(tmp_path), "--name", "smoke",
    ]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    with open(tmp_path / "smoke_stats.csv", newline="") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    for name in ("TTFT", "TPOT", "E2E"):
        assert int(stats[name]["Request Count"]) > 0, (name, stats[name])
        assert int(stats[name]["Failure Count"]) == 0, (name, stats[name])
    assert (tmp_path / "smoke_stats_history.csv").is_file() and (tmp_path / "smoke_failures.csv").is_file()
    assert (tmp_path / "smoke_latency.png").read_bytes()[:4] == b"\x89PNG"
    assert "SLO gates passed" in output


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_a_missed_slo_fails_the_run(served_ports: tuple[int, int], tmp_path: Path) -> None:
    """No server makes 0.01 ms per output token: the TPOT gate sets locust's exit code to 1."""
    command = [
        sys.executable, "-m", "loadtest.run", "--target", f"127.0.0.1:{served_ports[0]}", "--application", APP,
        "--users", "2", "--spawn-rate", "2", "--run-time", "4s", "--workload", "code", "--max-tokens", "8",
        "--no-heldout", "--slo-ttft-ms", "0", "--slo-tpot-ms", "0.01", "--out-dir", str(tmp_path), "--name", "gate",
    ]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-4000:]
    assert "SLO gate failed: TPOT: p95" in output and "> SLO 0.01 ms" in output


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_http_user_streams_the_openai_api_under_the_same_gates(served_ports: tuple[int, int], tmp_path: Path) -> None:
    """`--protocol http`: 6 s of 3 users streaming /v1/completions, every entry measured, no
    failure; then a TPOT gate no server can meet fails the run, as over gRPC."""
    base = f"http://127.0.0.1:{served_ports[1]}/{APP}"
    common = [sys.executable, "-m", "loadtest.run", "--protocol", "http", "--target", base, "--users", "3",
              "--spawn-rate", "3", "--workload", "mix", "--max-tokens", "12", "--no-heldout", "--out-dir", str(tmp_path)]
    proc = subprocess.run([*common, "--run-time", "6s", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "10000",
                           "--name", "http"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    with open(tmp_path / "http_stats.csv", newline="") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f) if row["Type"] == "http"}
    for name in ("TTFT", "TPOT", "E2E"):
        assert int(stats[name]["Request Count"]) > 0 and int(stats[name]["Failure Count"]) == 0, stats[name]
    assert "SLO gates passed" in output
    proc = subprocess.run([*common, "--run-time", "3s", "--slo-ttft-ms", "0", "--slo-tpot-ms", "0.01",
                           "--name", "http-gate"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "SLO gate failed: TPOT: p95" in output, output[-4000:]


# --- the chat workload ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_ports(tmp_path_factory, serve_instance) -> Iterator[tuple[int, int]]:
    """(gRPC port, HTTP port) of an app whose tiny model has a character tokenizer with a chat
    template (one token per character: a built-in question and the template fit 256 tokens)."""
    from helpers import save_tiny_model
    from ray import serve
    from test_serve_grpc import save_char_tokenizer
    from transformers import AutoTokenizer

    from deployments.app import build_app
    from deployments.client import SpecDecodeClient

    model = save_tiny_model(str(tmp_path_factory.mktemp("chat_model")), "llama")
    save_char_tokenizer(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model)
    port, http_port = serve_instance.grpc_port, serve_instance.http_port
    args = app_args(model, max_prompt_tokens=256)
    with serve_instance.apps(CHAT_APP):
        serve.run(build_app(args), name=CHAT_APP, route_prefix=f"/{CHAT_APP}")
        with SpecDecodeClient(f"127.0.0.1:{port}", application=CHAT_APP) as client:
            assert client.wait_ready(60).has_chat_template
        yield port, http_port


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_chat_workload_streams_chat_turns_over_both_protocols(chat_ports: tuple[int, int], tmp_path: Path) -> None:
    """5 s of 2 users sending one-turn chats over gRPC, then over HTTP (/v1/chat/completions):
    every entry measured (tokens counted from the streamed ids), no failed request."""
    targets = {"grpc": ["--target", f"127.0.0.1:{chat_ports[0]}", "--application", CHAT_APP],
               "http": ["--target", f"http://127.0.0.1:{chat_ports[1]}/{CHAT_APP}"]}
    for protocol, target in targets.items():
        command = [
            sys.executable, "-m", "loadtest.run", "--protocol", protocol, *target, "--users", "2",
            "--spawn-rate", "2", "--run-time", "5s", "--workload", "chat", "--max-tokens", "12", "--no-heldout",
            "--slo-ttft-ms", "60000", "--slo-tpot-ms", "10000", "--out-dir", str(tmp_path), "--name", protocol,
        ]
        proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-4000:]
        assert "chat prompts: built-in questions" in output
        with open(tmp_path / f"{protocol}_stats.csv", newline="") as f:
            stats = {row["Name"]: row for row in csv.DictReader(f) if row["Type"] == protocol}
        for name in ("TTFT", "TPOT", "E2E"):
            assert int(stats[name]["Request Count"]) > 0 and int(stats[name]["Failure Count"]) == 0, stats[name]
        assert "SLO gates passed" in output


@pytest.mark.slow
@pytest.mark.timeout(100)
def test_chat_workload_stops_before_any_request_without_a_chat_template(
    served_ports: tuple[int, int], tmp_path: Path
) -> None:
    """The smoke app's model has no tokenizer, so no chat template: the chat workload ends at
    start with the reason and exit code 2 over either protocol, and no request is recorded."""
    targets = {"grpc": ["--target", f"127.0.0.1:{served_ports[0]}", "--application", APP],
               "http": ["--target", f"http://127.0.0.1:{served_ports[1]}/{APP}"]}
    for protocol, target in targets.items():
        command = [sys.executable, "-m", "loadtest.run", "--protocol", protocol, *target, "--users", "3",
                   "--spawn-rate", "3", "--run-time", "10s", "--workload", "chat", "--no-heldout",
                   "--out-dir", str(tmp_path), "--name", protocol]
        proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 2, output[-4000:]
        assert "the chat workload cannot run against" in output and "has no chat template" in output, output[-4000:]
        assert "locust did not get far enough to measure a request" in output, output[-4000:]
        with open(tmp_path / f"{protocol}_stats.csv", newline="") as f:
            assert all(int(row["Request Count"]) == 0 for row in csv.DictReader(f))
        assert not (tmp_path / f"{protocol}_latency.png").exists()
