"""`make serve`: run the SpecDecode service (gRPC, and the OpenAI-compatible HTTP API) on an
embedded single-node Ray.

    python -m deployments.serve [--config deployments/serve_config.yaml] [--port 9000]
        [--model DIR] [--drafter DIR] [--method draft|ngram|eagle|eagle3|medusa|mtp] [-k K] [--device D]
        [--no-speculation]

Reads the Serve config file (the one `serve run` and the Kubernetes manifests use), applies the
flags to its first application, validates it, starts Ray and Serve with its gRPC/HTTP options,
deploys the app, prints the gRPC and HTTP addresses with a client and a curl command, and on
Ctrl-C or SIGTERM shuts Serve and Ray down and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import signal
import sys
import threading
import time
from typing import Any

from deployments.config import (
    APP_IMPORT_PATH,
    DEFAULT_CONFIG_PATH,
    DEFAULT_DRAFTER_MODELS,
    DEPLOYMENT_NAME,
    DRAFTER_DEPLOYMENT_NAME,
    INGRESS_DEPLOYMENT_NAME,
    PREFILL_DEPLOYMENT_NAME,
    ConfigError,
    load_serve_config,
    missing_models,
    validate_serve_config,
)

TRAIN_HINT = {
    "models/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": "python -m models fetch smollm2",
    "models/target": "python -m training corpus && python -m training tokenizer && python -m training target",
    "models/drafter": "python -m training drafter",
    "models/eagle3-head": "python -m training eagle3",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Serve speculative decoding over gRPC with Ray Serve.")
    p.add_argument("--config", default=str(DEFAULT_CONFIG_PATH), help="Serve config file (default: %(default)s)")
    p.add_argument("--port", type=int, default=None, help="gRPC port (default: the config's, 9000)")
    p.add_argument("--http-port", type=int, default=None, help="HTTP proxy port (default: the config's)")
    p.add_argument("--model", default=None, help="target model directory")
    p.add_argument("--drafter", default=None, help="drafter checkpoint directory")
    p.add_argument("--method", default=None, help="drafter kind: draft, ngram, eagle, eagle3, medusa or mtp (the target's own MTP layers)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=None, help="tokens drafted per step")
    p.add_argument("--device", default=None, help="auto, cpu or cuda")
    p.add_argument("--no-speculation", action="store_true", help="serve the target model alone")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs for the embedded Ray (default: all)")
    return p.parse_args(argv)


def apply_flags(config: dict, args: argparse.Namespace) -> dict:
    """The config with the command-line flags applied to its first application's args."""
    config = copy.deepcopy(config)
    if args.port is not None:
        config.setdefault("grpc_options", {})["port"] = args.port
    if args.http_port is not None:
        config.setdefault("http_options", {})["port"] = args.http_port
    apps = config.get("applications") or []
    if not apps:
        raise ConfigError("applications: the config has no application to serve")
    app_args: dict[str, Any] = apps[0].setdefault("args", {}) or {}
    apps[0]["args"] = app_args
    if args.model is not None:
        app_args["model"] = args.model
    if args.device is not None:
        app_args["device"] = args.device
    if args.no_speculation:
        app_args["speculative"] = None
    elif any(v is not None for v in (args.drafter, args.method, args.k)):
        spec = dict(app_args.get("speculative") or {})
        if args.method is not None:
            spec["method"] = args.method
            spec["model"] = DEFAULT_DRAFTER_MODELS.get(args.method)
        if args.drafter is not None:
            spec["model"] = args.drafter
        if args.k is not None:
            spec["num_speculative_tokens"] = args.k
        app_args["speculative"] = spec
    return config


QUESTION = "What is the capital of France?"


def client_command(port: int, has_text: bool, chat: bool = False) -> str:
    if chat:
        prompt = f"{shlex.quote(QUESTION)} --chat"
    else:
        prompt = shlex.quote("def fib(n):") if has_text else "--token-ids 1,2,3"
    return f"python -m deployments.client {prompt} --max-tokens 64 --temperature 0 --target localhost:{port}"


def curl_command(http_port: int, route_prefix: str, model: str, chat: bool = False) -> str:
    base = f"http://localhost:{http_port}{route_prefix.rstrip('/')}"
    if chat:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 64})
        return f"curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}"
    body = json.dumps({"model": model, "prompt": "def fib(n):", "max_tokens": 64, "temperature": 0})
    return f"curl {base}/v1/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = apply_flags(load_serve_config(args.config), args)
        app_configs = validate_serve_config(config)
    except (ConfigError, OSError) as e:
        print(f"error: {args.config}:\n{e}", file=sys.stderr)
        return 2
    app = config["applications"][0]
    if app.get("import_path") != APP_IMPORT_PATH:
        print(f"error: applications[0].import_path must be {APP_IMPORT_PATH}", file=sys.stderr)
        return 2
    app_name = app.get("name", "default")
    app_config = app_configs[app_name]
    missing = missing_models(app_config)
    if missing:
        print(f"error: model not found: {', '.join(missing)}", file=sys.stderr)
        for path in missing:
            if path in TRAIN_HINT:
                print(f"  get it with: {TRAIN_HINT[path]}", file=sys.stderr)
        print("  or pass --model DIR (and --drafter DIR, --method ngram or --no-speculation)", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from deployments.app import bind_app

    stop = threading.Event()
    ready = False

    def on_signal(signum: int, frame: Any) -> None:
        if not ready:
            raise KeyboardInterrupt  # still starting: unwind through the clean-up below
        stop.set()

    grpc_options = config.get("grpc_options", {})
    port = grpc_options.get("port", 9000)
    http_port = (config.get("http_options") or {}).get("port", 8000)
    route_prefix = app.get("route_prefix") or "/"
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False)
    exit_code = 0
    try:
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        serve.start(
            proxy_location=config.get("proxy_location"),
            http_options=config.get("http_options"),
            grpc_options=grpc_options,
        )
        entries = {d.get("name"): d for d in app.get("deployments") or []}
        print(f"deploying {app_name!r}: {app_config}", flush=True)
        start = time.monotonic()
        bound = bind_app(app_config, entries.get(DEPLOYMENT_NAME), entries.get(INGRESS_DEPLOYMENT_NAME),
                         prefill_overrides=entries.get(PREFILL_DEPLOYMENT_NAME),
                         drafter_overrides=entries.get(DRAFTER_DEPLOYMENT_NAME))
        serve.run(bound, name=app_name, route_prefix=app.get("route_prefix"))
        from deployments.client import SpecDecodeClient

        with SpecDecodeClient(f"localhost:{port}") as client:
            info = client.wait_ready(timeout=60)
        ready = True
        print(
            f"\nSpecDecode gRPC service ready on 0.0.0.0:{port} in {time.monotonic() - start:.1f} s "
            f"(model {info.model}, drafter {info.drafter_method or 'none'}"
            f"{f' k={info.num_speculative_tokens}' if info.drafter_method else ''}, device {info.device})\n"
            f"  try:  {client_command(port, info.has_tokenizer, info.has_chat_template)}\n"
            f"  health (grpc.health.v1): grpcurl -plaintext localhost:{port} grpc.health.v1.Health/Check\n"
            f"OpenAI-compatible HTTP API on 0.0.0.0:{http_port}{route_prefix.rstrip('/')}/v1 "
            f"(completions, chat/completions, models; /health)\n"
            f"  try:  {curl_command(http_port, route_prefix, info.model, info.has_chat_template)}\n"
            f"  stop: Ctrl-C",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
        print("shutting down...", flush=True)
    except KeyboardInterrupt:
        print("interrupted while starting; shutting down...", flush=True)
        exit_code = 130
    except RuntimeError as e:  # the deployment failed (serve.run says why)
        print(f"error: the deployment failed: {e}", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print("stopped", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
