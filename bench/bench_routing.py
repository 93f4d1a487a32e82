"""Prefix-aware routing against load-only routing, side by side in one run: a multi-turn chat
workload and a uniform one on two engine replicas.

    python -m bench.bench_routing [--conversations 32 --turns 4 --concurrency 8 --rounds 3]
        [--max-tokens 64] [--uniform 48] [--out PATH]

One embedded Ray Serve (2 CPUs) runs two applications of `make serve`'s model (SmolLM2-135M-
Instruct from its GGUF, n-gram speculation), each with 2 engine replicas of one thread behind
its ingress, both routed by deployments.router.EngineLoadRouter:
- prefix: its defaults (load plus the prompt tokens each replica holds in its prefix cache);
- load: prefix_weight 0 (load only, the router before prefix-aware routing).
Only one application has load at a time; each round runs both, alternating which goes first.
Workloads (closed loop, --concurrency clients at once, greedy, --max-tokens):
- chat: --conversations conversations of --turns turns, all with the same system prompt. A
  first turn is a held-out chat prompt (models/chat_heldout_prompts.json) after a line unique to
  the round, application and conversation (no conversation is cached from an earlier one); a
  later turn asks a follow-up, and the conversation carries the model's own answers. A client
  sends a turn a think time (uniform in [0, 2 x --think-s]) after the previous answer is
  complete; other conversations' turns arrive meanwhile, as with people typing.
- uniform: --uniform single-turn requests, each its own prompt (only the system prompt shared):
  what prefix-aware routing costs where there is nothing to gain.
Per request: TTFT (sent -> first token), prompt tokens and those served from the prefix cache
(usage.cached_prompt_tokens). Reported per application and workload, pooled over the rounds:
TTFT p50/p95, prefix hit rate (cached / prompt tokens), history hit rate (turns >= 2: cached
tokens beyond the system prompt's / prompt tokens beyond it), requests/s, errors; and the
attainable hit rate: its ceiling, what one replica with room for everything could serve from its
prefix cache (per request: the leading full blocks of its prompt that any earlier request of the
application computed, prompt or answer).
Writes bench/results/<host>/routing.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
APPS = ("prefix", "load")
BLOCK_SIZE = 16  # the engine's default KV block
SYSTEM = ("You are a patient assistant for people who are learning to program in Python. Answer in "
          "plain words, in a few sentences, and give a short example when it helps. If a question is "
          "unclear, say what you assumed. Never invent functions that the standard library does not have.")
FOLLOW_UPS = ("Can you give a short example?", "What is a common mistake with that?",
              "Summarize your answer in one sentence.", "How would you test it?",
              "What should I read next about it?")


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    attainable_tokens: int = 0  # cached with ideal routing and no eviction
    error: str | None = None


def start(port: int) -> None:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from bench.bench_serve import free_port
    from deployments.app import bind_app
    from deployments.config import AppConfig
    from models.fetch import fetch

    config = AppConfig.from_dict({
        "model": str(fetch("smollm2")), "speculative": {"method": "ngram"}, "max_num_seqs": 16,
        "max_queued_requests": 256, "num_cpus": 1, "torch_threads": 1, "replica_wait_timeout_s": 600,
        "kv_cache_memory_bytes": 512 * 2**20,
    })
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": free_port()},
                grpc_options={"port": port, "grpc_servicer_functions": [
                    "deployments.servicer.add_SpecDecodeServicer_to_server"]})
    targets = []
    for app in APPS:
        kwargs = {} if app == "prefix" else {"prefix_weight": 0.0}
        router = RequestRouterConfig(request_router_class="deployments.router:EngineLoadRouter",
                                     request_router_kwargs=kwargs, request_routing_stats_period_s=1.0,
                                     request_routing_stats_timeout_s=5.0)
        engine = {"ray_actor_options": {"num_cpus": 0.5}, "num_replicas": 2, "request_router_config": router}
        targets.append(serve.RunTarget(bind_app(config, engine), name=app, route_prefix=f"/{app}"))
    serve.run_many(targets)


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def ask(port: int, app: str, messages: list[dict], max_tokens: int, record: Turn,
        answer_ids: list[int] | None = None) -> str:
    """One turn: the answer's text (its token ids appended to `answer_ids`); TTFT and usage into
    `record`."""
    from deployments.client import SpecDecodeClient

    text = []
    sent = time.perf_counter()
    try:
        with SpecDecodeClient(f"127.0.0.1:{port}", application=app, timeout=600) as client:
            for m in client.chat(messages, max_tokens=max_tokens, temperature=0.0):
                if record.ttft_s is None and m.token_ids:
                    record.ttft_s = time.perf_counter() - sent
                text.append(m.text)
                if answer_ids is not None:
                    answer_ids.extend(m.token_ids)
                if m.finish_reason:
                    record.prompt_tokens = m.usage.prompt_tokens
                    record.cached_tokens = m.usage.cached_prompt_tokens
    except Exception as e:  # noqa: BLE001 - recorded
        record.error = f"{type(e).__name__}: {e}"
    return "".join(text)


def attainable(prompt: list[int], seen: set[int]) -> int:
    """Prompt tokens a prefix cache holding every block hashed in `seen` would serve."""
    from engine.block_manager import prefix_block_hashes

    n = 0
    for h in prefix_block_hashes(prompt, BLOCK_SIZE):
        if h not in seen:
            break
        n += 1
    return n * BLOCK_SIZE


def run_chat(port: int, app: str, first_turns: list[str], turns: int, concurrency: int, max_tokens: int,
             tag: str, think_s: float = 0.0, seed: int = 0, tokenizer=None,
             seen: set[int] | None = None) -> tuple[list[Turn], float]:
    """Every conversation of `first_turns`, --concurrency at a time; (turns, wall seconds). With
    `tokenizer` and `seen` (block hashes of what the application computed before), each turn's
    attainable cached tokens too, its prompt rendered as the ingress renders it."""
    from deployments.tools import render_chat
    from engine.block_manager import prefix_block_hashes

    def render(messages: list[dict]) -> list[int]:
        with lock:  # one tokenizer shared by the client threads
            return render_chat(tokenizer, messages, [])

    def computed(tokens: list[int]) -> None:
        with lock:
            seen.update(prefix_block_hashes(tokens, BLOCK_SIZE))

    measure = tokenizer is not None and seen is not None
    rng = random.Random(seed)
    thinks = [rng.uniform(0, 2 * think_s) for _ in range(len(first_turns) * turns)]
    records: list[Turn] = []
    lock = threading.Lock()
    queue = list(enumerate(first_turns))

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i, first = queue.pop(0)
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"(conversation {tag}-{i})\n{first}"}]
            for k in range(turns):
                record = Turn(i, k)
                prompt = render(messages) if measure else []
                if measure:
                    with lock:
                        record.attainable_tokens = attainable(prompt, seen)
                    computed(prompt)
                answer_ids: list[int] = []
                answer = ask(port, app, messages, max_tokens, record, answer_ids)
                if measure:
                    computed(prompt + answer_ids)
                with lock:
                    records.append(record)
                if record.error:
                    return
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": FOLLOW_UPS[(i + k) % len(FOLLOW_UPS)]}]
                if k + 1 < turns:
                    time.sleep(thinks[i * turns + k])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def system_tokens(tokenizer) -> int:
    """The system prompt's share of every prompt: the tokens two conversations with different
    first questions have in common, as the chat template renders them."""
    from deployments.tools import render_chat

    a, b = (render_chat(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], [])
            for q in ("Why?", "How?"))
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(records: list[Turn], wall_s: float, system: int) -> dict:
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    later = [r for r in ok if r.turn >= 1]
    prompt = sum(r.prompt_tokens for r in ok)
    history = sum(max(0, r.prompt_tokens - system) for r in later)
    out = {
        "requests": len(records), "errors": len(records) - len(ok),
        "ttft_p50_ms": (pct([r.ttft_s for r in ok], 0.5) or 0) * 1e3,
        "ttft_p95_ms": (pct([r.ttft_s for r in ok], 0.95) or 0) * 1e3,
        "ttft_later_turns_p95_ms": (pct([r.ttft_s for r in later], 0.95) or 0) * 1e3 if later else None,
        "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in ok),
        "prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        "history_hit_rate": (sum(max(0, r.cached_tokens - system) for r in later) / history) if history else None,
        "attainable_hit_rate": sum(r.attainable_tokens for r in ok) / prompt if prompt else None,
        "requests_per_s": len(ok) / wall_s if wall_s else None, "wall_s": wall_s,
    }
    errors = [r.error for r in records if r.error]
    if errors:
        out["first_error"] = errors[0][:300]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--uniform", type=int, default=48, help="single-turn requests of the uniform workload per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--think-s", type=float, default=1.5, help="mean pause between a conversation's turns")
    p.add_argument("--out", default=None, help="result JSON (default: bench/results/<host>/routing.json)")
    args = p.parse_args(argv)
    from bench.bench_serve import free_port
    from bench.common import table, write_results

    prompts = json.loads((REPO_ROOT / "models" / "chat_heldout_prompts.json").read_text())["prompts"]
    from engine.llm import load_tokenizer
    from models.fetch import fetch

    tokenizer = load_tokenizer(str(fetch("smollm2")))
    system = system_tokens(tokenizer)
    port = free_port()
    start(port)
    pooled: dict[tuple[str, str], tuple[list[Turn], float]] = {}
    per_round: list[dict] = []
    try:
        seen: dict[str, set[int]] = {app: set() for app in APPS}  # block hashes each application computed
        for app in APPS:  # warm both (each replica loads its tokenizer cache, the system prompt cached)
            run_chat(port, app, ["Say hello."] * 4, 1, 4, 8, f"warm-{app}", tokenizer=tokenizer, seen=seen[app])
        for rnd in range(args.rounds):
            order = APPS if rnd % 2 == 0 else APPS[::-1]
            for app in order:
                first = [prompts[(rnd * args.conversations + i) % len(prompts)] for i in range(args.conversations)]
                chat, chat_s = run_chat(port, app, first, args.turns, args.concurrency, args.max_tokens, f"{rnd}-{app}",
                                          args.think_s, seed=rnd, tokenizer=tokenizer, seen=seen[app])
                singles = [prompts[(7 * rnd + i) % len(prompts)] for i in range(args.uniform)]
                uniform, uniform_s = run_chat(port, app, singles, 1, args.concurrency, args.max_tokens, f"u{rnd}-{app}",
                                              tokenizer=tokenizer, seen=seen[app])
                for workload, records, wall in (("chat", chat, chat_s), ("uniform", uniform, uniform_s)):
                    got = pooled.setdefault((app, workload), ([], 0.0))
                    pooled[(app, workload)] = (got[0] + records, got[1] + wall)
                    summary = summarize(records, wall, system)
                    per_round.append({"round": rnd, "app": app, "workload": workload, **summary})
                    print(f"round {rnd} {app} {workload}: {json.dumps(summary)}", flush=True)
    finally:
        stop()
    results = {f"{app}@{w}": summarize(records, wall, system) for (app, w), (records, wall) in pooled.items()}
    ratios = {}
    for w in ("chat", "uniform"):
        a, b = results[f"prefix@{w}"], results[f"load@{w}"]
        ratios[w] = {
            "ttft_p95_load_over_prefix": b["ttft_p95_ms"] / a["ttft_p95_ms"] if a["ttft_p95_ms"] else None,
            "ttft_p50_load_over_prefix": b["ttft_p50_ms"] / a["ttft_p50_ms"] if a["ttft_p50_ms"] else None,
            "hit_rate_prefix_over_load": (a["prefix_hit_rate"] / b["prefix_hit_rate"]
                                          if a["prefix_hit_rate"] and b["prefix_hit_rate"] else None),
            "history_hit_rate_prefix_over_load": (a["history_hit_rate"] / b["history_hit_rate"]
                                                  if a["history_hit_rate"] and b["history_hit_rate"] else None),
            "requests_per_s_prefix_over_load": (a["requests_per_s"] / b["requests_per_s"]
                                                if b["requests_per_s"] else None),
        }
    report = {"benchmark": "prefix_aware_routing", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "cpus": os.cpu_count(), "args": vars(args), "system_prompt_tokens": system,
              "results": results, "ratios": ratios, "per_round": per_round}
    out = write_results("routing", report, args.out)
    rows = [{"routing": app, "workload": w, **{k: results[f"{app}@{w}"][k] for k in (
        "ttft_p50_ms", "ttft_p95_ms", "prefix_hit_rate", "attainable_hit_rate", "history_hit_rate", "requests_per_s",
        "errors")}}
            for w in ("chat", "uniform") for app in APPS]
    print(table(rows, ["routing", "workload", "ttft_p50_ms", "ttft_p95_ms", "prefix_hit_rate", "attainable_hit_rate",
                       "history_hit_rate",
                       "requests_per_s", "errors"]))
    print(json.dumps(ratios, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
