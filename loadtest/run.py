"""`make loadtest`: a headless locust run against the SpecDecode service, then a plot.

    python -m loadtest.run [--protocol grpc|http] [--target localhost:9000] [--users 8] [--spawn-rate 2] [--run-time 60s]
        [--shape constant|step|spike] [--workload code|text|chat|mix] [--max-tokens 64]
        [--slo-ttft-ms MS] [--slo-tpot-ms MS] [--slo-e2e-ms MS] [--out-dir loadtest/results]

Builds the prompts (held-out code windows when models/target is trained, held-out chat prompts
when models/chat_heldout_prompts.json exists; see loadtest.workloads), runs
loadtest/locustfile.py (plus loadtest/shapes/<shape>.py) with --csv/--csv-full-history, and
writes <out-dir>/<name>_{stats,stats_history,failures,exceptions}.csv and <name>_latency.png
(p50/p95/p99 of TTFT, TPOT and end-to-end latency, and the user count, over time). The SLO gates
default to the targets of the SLO autoscaling policy in deployments/serve_config.yaml. Exits with
locust's code: 0 when every gate passed, 1 when one failed (or a request failed); 2 when the
target does not answer at all, or cannot serve the workload (chat on a model without a chat
template, which the locustfile checks before any user starts). `--protocol http` drives the
OpenAI-compatible HTTP API instead (`--target` defaults to http://localhost:8000/specdecode,
`make serve`'s HTTP address), with the same prompts, sampling, timing and gates.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import yaml

from loadtest.workloads import WORKLOADS, build_prompts

REPO_ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = REPO_ROOT / "loadtest" / "locustfile.py"
SHAPES = {"step": REPO_ROOT / "loadtest" / "shapes" / "step.py", "spike": REPO_ROOT / "loadtest" / "shapes" / "spike.py"}
DEFAULT_OUT_DIR = REPO_ROOT / "loadtest" / "results"
SERVE_CONFIG = REPO_ROOT / "deployments" / "serve_config.yaml"
SLO_POLICY = "deployments.autoscaling:SLOAutoscalingPolicy"
ENTRIES = ("TTFT", "TPOT", "E2E")  # the locustfile's entry names
DEFAULT_TARGETS = {"grpc": "localhost:9000", "http": "http://localhost:8000/specdecode"}
PERCENTILES = ("50%", "95%", "99%")


def served_slo(path: Path = SERVE_CONFIG) -> dict[str, float]:
    """{"ttft_p95_ms", "tpot_p95_ms"} of the SLO policy in the Serve config (empty if none)."""
    with open(path) as f:
        config = yaml.safe_load(f) or {}
    for app in config.get("applications") or []:
        for deployment in app.get("deployments") or []:
            policy = (deployment.get("autoscaling_config") or {}).get("policy") or {}
            if policy.get("policy_function") == SLO_POLICY:
                kwargs = policy.get("policy_kwargs") or {}
                return {k: float(kwargs[k]) for k in ("ttft_p95_ms", "tpot_p95_ms") if k in kwargs}
    return {}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    slo = served_slo()
    p = argparse.ArgumentParser(description="Headless locust load test of the SpecDecode service (gRPC or HTTP).")
    p.add_argument("--protocol", choices=tuple(DEFAULT_TARGETS), default="grpc",
                   help="gRPC or the OpenAI-compatible HTTP API (default: %(default)s)")
    p.add_argument("--target", default=None, help="gRPC host:port, or the HTTP API's base URL "
                   f"(default: {DEFAULT_TARGETS['grpc']} / {DEFAULT_TARGETS['http']})")
    p.add_argument("--application", default="", help="Serve application name (only when several apps run)")
    p.add_argument("--users", type=int, default=8, help="concurrent users; the peak for a shape (default: %(default)s)")
    p.add_argument("--spawn-rate", type=float, default=2.0, help="users started per second (default: %(default)s)")
    p.add_argument("--run-time", default="60s", help="duration, locust syntax: 30s, 2m, 1h30m (default: %(default)s)")
    p.add_argument("--shape", choices=("constant", *SHAPES), default="constant", help="load shape (default: %(default)s)")
    p.add_argument("--workload", choices=WORKLOADS, default="mix",
                   help="chat needs a model with a chat template (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per held-out code prompt (default: %(default)s)")
    p.add_argument("--no-heldout", action="store_true",
                   help="built-in code and chat prompts even if held-out ones exist")
    p.add_argument("--slo-ttft-ms", type=float, default=slo.get("ttft_p95_ms", 0.0),
                   help="p95 TTFT gate, 0 for none (default: the Serve config's SLO, %(default)g)")
    p.add_argument("--slo-tpot-ms", type=float, default=slo.get("tpot_p95_ms", 0.0),
                   help="p95 TPOT gate, 0 for none (default: the Serve config's SLO, %(default)g)")
    p.add_argument("--slo-e2e-ms", type=float, default=0.0, help="p95 end-to-end gate, 0 for none (default)")
    p.add_argument("--max-fail-ratio", type=float, default=0.0, help="allowed share of failed requests (default: 0)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where results go (default: %(default)s)")
    p.add_argument("--name", default="", help="file name prefix (default: <workload>-<shape>-<time>)")
    args = p.parse_args(argv)
    if args.target is None:
        args.target = DEFAULT_TARGETS[args.protocol]
    if args.users < 1 or args.spawn_rate <= 0 or args.max_tokens < 1:
        p.error(f"--users and --max-tokens must be >= 1 and --spawn-rate > 0, got {args.users}, "
                f"{args.max_tokens}, {args.spawn_rate}")
    return args


def locust_command(args: argparse.Namespace, csv_prefix: Path, prompts_file: Path) -> list[str]:
    files = [str(LOCUSTFILE)] + ([str(SHAPES[args.shape])] if args.shape in SHAPES else [])
    return [
        sys.executable, "-m", "locust", "-f", ",".join(files), "--headless", "--only-summary",
        "--host", args.target, "-u", str(args.users), "-r", str(args.spawn_rate), "-t", args.run_time,
        "--stop-timeout", "30", "--csv", str(csv_prefix), "--csv-full-history",
        "--protocol", args.protocol, "--workload", args.workload, "--max-tokens", str(args.max_tokens), "--prompts-file", str(prompts_file),
        "--application", args.application, "--slo-ttft-ms", str(args.slo_ttft_ms),
        "--slo-tpot-ms", str(args.slo_tpot_ms), "--slo-e2e-ms", str(args.slo_e2e_ms),
        "--max-fail-ratio", str(args.max_fail_ratio),
    ]


def read_history(path: Path) -> dict[str, dict[str, list[float]]]:
    """{entry name: {"t": seconds since start, "users": ..., "50%": ms, ...}} from locust's
    --csv-full-history stats history (rows before an entry's first request hold "N/A")."""
    series: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    start = None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            name = row["Name"]
            if name not in ENTRIES:
                continue
            t = float(row["Timestamp"])
            start = t if start is None else min(start, t)
            values = [row.get(p, "N/A") for p in PERCENTILES]
            if "N/A" in values or "" in values or row.get("Total Request Count") in ("0", None):
                continue
            out = series[name]
            out["t"].append(t)
            out["users"].append(float(row["User Count"]))
            for p, v in zip(PERCENTILES, values, strict=True):
                out[p].append(float(v))
    for out in series.values():
        out["t"] = [t - (start or 0.0) for t in out["t"]]
    return {name: dict(out) for name, out in series.items()}


def plot_history(history_csv: Path, png: Path, title: str, slo: dict[str, float]) -> Path:
    """Latency percentiles over time, one panel per entry, users on a second axis; SLOs dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = read_history(history_csv)
    fig, axes = plt.subplots(len(ENTRIES), 1, figsize=(10, 9), sharex=True)
    for ax, name in zip(axes, ENTRIES, strict=True):
        data = history.get(name)
        ax.set_ylabel(f"{name} (ms)")
        if not data:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center")
            continue
        for p in PERCENTILES:
            ax.plot(data["t"], data[p], label=f"p{p.rstrip('%')}")
        top = max(max(data[p]) for p in PERCENTILES)
        if slo.get(name) and slo[name] <= 2 * top:
            ax.axhline(slo[name], color="red", linestyle="--", linewidth=1, label=f"SLO p95 {slo[name]:g} ms")
        elif slo.get(name):
            ax.plot([], [], color="red", linestyle="--", label=f"SLO p95 {slo[name]:g} ms (off the scale)")
        ax.set_ylim(bottom=0)
        users = ax.twinx()
        users.plot(data["t"], data["users"], color="grey", alpha=0.4, linewidth=1)
        users.set_ylabel("users", color="grey")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since start")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def check_target(target: str, application: str, timeout_s: float = 15.0, protocol: str = "grpc") -> str | None:
    """None if the service answers GetModelInfo (HTTP: GET /v1/models) within `timeout_s`, else why not."""
    if protocol == "http":
        return check_http_target(target, timeout_s)
    import grpc

    from deployments.client import SpecDecodeClient

    try:
        with SpecDecodeClient(target, application=application or None) as client:
            info = client.wait_ready(timeout=timeout_s)
    except grpc.RpcError as e:
        return f"{target} does not answer ({e.code().name}: {e.details()}); start it with `make serve`"
    print(f"target {target}: model {info.model}, drafter {info.drafter_method or 'none'}, device {info.device}", flush=True)
    return None


def check_http_target(base_url: str, timeout_s: float) -> str | None:
    import requests

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = requests.get(f"{base_url.rstrip('/')}/v1/models", timeout=5)
            if response.status_code == 200:
                (model,) = response.json()["data"]
                print(f"target {base_url}: model {model['id']}, drafter "
                      f"{model['specdecode']['drafter_method'] or 'none'}", flush=True)
                return None
            problem = f"HTTP {response.status_code}: {response.text[:200]}"
        except requests.RequestException as e:
            problem = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            return f"{base_url} does not answer GET /v1/models ({problem}); start it with `make serve`"
        time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_target(args.target, args.application, protocol=args.protocol)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or f"{args.workload}-{args.shape}-{time.strftime('%Y%m%d-%H%M%S')}"
    csv_prefix = args.out_dir / name
    prompts = build_prompts(num=max(32, args.users), prompt_len=args.prompt_len, heldout=not args.no_heldout)
    for kind, source in prompts["sources"].items():
        print(f"{kind} prompts: {source}", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="prompts-", delete=False) as f:
        json.dump(prompts, f)
        prompts_file = Path(f.name)
    command = locust_command(args, csv_prefix, prompts_file)
    print(f"running: {' '.join(command)}", flush=True)
    try:
        code = subprocess.run(command, cwd=REPO_ROOT, check=False).returncode
    finally:
        prompts_file.unlink(missing_ok=True)
    history = Path(f"{csv_prefix}_stats_history.csv")
    if history.is_file() and read_history(history):  # locust writes the file's header before it checks the target
        slo = {"TTFT": args.slo_ttft_ms, "TPOT": args.slo_tpot_ms, "E2E": args.slo_e2e_ms}
        title = f"{args.target} ({args.protocol}): {args.workload}, {args.shape}, {args.users} users, {args.run_time}"
        png = plot_history(history, Path(f"{csv_prefix}_latency.png"), title, slo)
        print(f"wrote {csv_prefix}_stats.csv, {history.name} and {png}", flush=True)
    else:
        print(f"no latency in {history}: locust did not get far enough to measure a request", file=sys.stderr)
    print(f"locust exit code {code} ({'SLO gates passed' if code == 0 else 'a gate failed or locust errored'})")
    return code


if __name__ == "__main__":
    sys.exit(main())
