"""The load test: workloads, shapes and SLO gates on their own, then a short headless smoke run
(`python -m loadtest.run`, locust in a subprocess) against a Serve started here on loopback with a
tiny random model, which must finish without a single failed request and write its CSVs and plot.

Nothing here imports locust: it monkey-patches the standard library with gevent at import, which
would change the threads and sockets of every test that runs after it in this process.
"""

from __future__ import annotations

import csv
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
    BUILTIN_CODE,
    SAMPLING,
    adapt,
    build_prompts,
    bytes_to_ids,
    load_prompts,
    pick_kind,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
APP = "loadtest-smoke"


# --- pieces -----------------------------------------------------------------------------------
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
    assert {pick_kind("mix", rng) for _ in range(50)} == {"code", "text"}
    with pytest.raises(ValueError, match="workload"):
        pick_kind("chat", rng)
    assert SAMPLING["text"]["temperature"] == 1.0 and SAMPLING["code"]["temperature"] == 0.0
    builtin = load_prompts("")
    assert [p["text"] for p in builtin["code"]] == BUILTIN_CODE and builtin["text"]


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
    args = {"model": tiny_llama, "speculative": None, "device": "cpu", "dtype": "float32", "max_num_seqs": 8,
            "max_queued_requests": 32, "max_prompt_tokens": 64, "max_tokens": 64, "default_max_tokens": 16,
            "num_cpus": 1}
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
