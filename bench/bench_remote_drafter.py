"""Co-located vs remote drafting, side by side in one run, on the shipped target and draft model.

The target engine runs in this process on one torch thread (one core). The draft model drafts
  - co-located: in the same engine, on the same core (the default placement and the baseline);
  - remote: in a drafter-pool replica on the other core (`engine.spec_decode.remote.DraftService`, one
    thread), reached by a Ray actor call (`ray actor`) or, as deployed, by a Ray Serve handle to
    a `SpecDrafter` replica (`serve handle`, deployments/drafter.py), with drafting ahead off
    (the default) or on.
Also: no speculation, and a co-located engine given both cores (2 torch threads), the fair
"same two cores" reference for a remote drafter that uses the second one. Loads: batch 1 (the
prompts one at a time) and 4 concurrent; workloads: held-out code, greedy, and the same prompts
sampled at temperature 1 (unpredictable). Every configuration is loaded first; repetitions
interleave them (order reversed every other one); rows report medians and the median
per-repetition ratio to the co-located adaptive engine. Per row: tokens/s, mean accepted length,
per speculating step the target's verify time and the drafting time (remote: the round trip),
and for remote rows the share of drafts that were made ahead and the steps whose call failed.

    python -m bench.bench_remote_drafter [--repeats 3] [--prompts 4] [--new-tokens 96]

`--batching 1,2,4,8,16` measures instead what one pool replica gains from merging the calls of
several engine replicas into one round (the `SpecDrafter` deployment's `@serve.batch`): in one
process on one thread, a `DraftService` with N sessions (one per caller, each a held-out code
prompt), step after step either one round of N calls (merged) or N rounds of one call
(separate), the same tokens either way: each call brings 3 committed tokens (an accepted length
near the shipped pair's) and asks for k = 4 drafts. Steps interleave the two modes; medians of
the per-step times. No Ray: the round trip is not in it.

    python -m bench.bench_remote_drafter --batching 1,2,4,8,16 [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.bench_tree import run
from bench.common import MODELS, code_prompts, machine_info, table, write_results
from engine import LLM, SamplingParams, SpeculativeConfig

LOADS = {"batch 1": 1, "4 concurrent": 4}


class ActorClient:
    """A drafter-pool replica as a plain Ray actor (no Serve): the round trip's floor."""

    def __init__(self, actor, timeout_s: float) -> None:
        self.actor, self.timeout_s = actor, timeout_s

    def draft(self, batch):
        import ray

        return ray.get(self.actor.draft.remote(batch), timeout=self.timeout_s)


def pool_actor(draft_ahead: bool):
    import ray

    @ray.remote(num_cpus=0.01)  # each configuration's pool idles while the others run (one torch thread each)
    class Pool:
        def __init__(self, model_dir: str, draft_ahead: bool) -> None:
            from engine.spec_decode.remote import DraftService, LocalDrafterClient

            self.client = LocalDrafterClient(DraftService(model_dir, dtype="bfloat16", device="cpu",
                                                          draft_ahead=draft_ahead, num_threads=1))

        def draft(self, batch):
            return self.client.draft(batch)

        def stats(self) -> dict:
            return self.client.service.stats()

    return Pool.remote(str(MODELS / "drafter"), draft_ahead)


def serve_pool(name: str, draft_ahead: bool):
    from ray import serve

    from deployments.config import AppConfig
    from deployments.drafter import SpecDrafterServer, drafter_options

    config = AppConfig.from_dict({
        "model": str(MODELS / "target"), "device": "cpu", "dtype": "bfloat16",
        "speculative": {"method": "draft", "model": str(MODELS / "drafter"), "placement": "remote"},
        "drafter_pool": {"num_cpus": 1, "torch_threads": 1, "draft_ahead": draft_ahead, "timeout_s": 1.0},
    })
    options = drafter_options(config, {"ray_actor_options": {"num_cpus": 0.01}})  # as the actor pools
    app = serve.deployment(SpecDrafterServer, name="SpecDrafter").options(**options).bind(config)
    return serve.run(app, name=name, route_prefix=None)


def make(kind: str, k: int | None, ahead: bool, threads: int, max_num_seqs: int) -> tuple[LLM, object]:
    """(the engine, its pool's stats source or None)."""
    spec = None
    if kind != "none":
        kw = dict(num_speculative_tokens=k, adaptive=False) if k else dict(num_speculative_tokens=6, adaptive=True)
        spec = SpeculativeConfig(method="draft", model=str(MODELS / "drafter"), **kw)
    remote, stats = {}, None
    if kind == "actor":
        import ray

        actor = pool_actor(ahead)
        ray.get(actor.stats.remote())  # loaded
        remote["remote_drafter"] = ActorClient(actor, timeout_s=1.0)
        stats = actor
    elif kind == "serve":
        from ray import serve

        from deployments.drafter import ServeDrafterClient

        handle = serve_pool(f"pool{len(serve.status().applications)}", ahead)
        remote["remote_drafter"] = ServeDrafterClient(handle, "bench", timeout_s=1.0)
        stats = handle
    torch.set_num_threads(threads)
    llm = LLM(str(MODELS / "target"), dtype="bfloat16", device="cpu", speculative=spec, max_num_seqs=max_num_seqs,
              enable_prefix_caching=False, kv_cache_memory_bytes=96 << 20, **remote)
    torch.set_num_threads(1)
    return llm, stats


def configs() -> dict[str, tuple]:
    """name -> (kind, k (None: adaptive), draft ahead, torch threads)."""
    return {
        "no speculation": ("none", None, False, 1),
        "co-located, adaptive": ("local", None, False, 1),
        "co-located, k=4": ("local", 4, False, 1),
        "co-located, adaptive, 2 threads": ("local", None, False, 2),
        "remote (ray actor), adaptive": ("actor", None, False, 1),
        "remote (ray actor), k=4": ("actor", 4, False, 1),
        "remote (ray actor), k=4, drafting ahead": ("actor", 4, True, 1),
        "remote (serve handle), adaptive": ("serve", None, False, 1),
        "remote (serve handle), k=4": ("serve", 4, False, 1),
    }


def batching(callers: list[int], steps: int, prompt_len: int, name: str) -> dict:
    """The `--batching` measurement (module docstring)."""
    import time

    from transformers import AutoTokenizer

    from engine.spec_decode.remote import DraftBatch, DraftCall, DraftService

    torch.set_num_threads(1)
    service = DraftService(str(MODELS / "drafter"), dtype="bfloat16", device="cpu", num_threads=1,
                           kv_cache_memory_bytes=256 << 20)
    tokenizer = AutoTokenizer.from_pretrained(str(MODELS / "target"))
    docs = code_prompts(tokenizer, max(callers), prompt_len + 3 * (steps + 1), seed=3)
    rows = []
    for n in callers:
        sent = {mode: [0] * n for mode in ("merged", "separate")}
        times: dict[str, list[float]] = {"merged": [], "separate": []}

        for step in range(steps + 1):
            upto = prompt_len + 3 * step
            for mode in (("merged", "separate") if step % 2 == 0 else ("separate", "merged")):
                calls = []
                for i in range(n):  # caller i's session: the tokens committed since its last call
                    calls.append(DraftCall(f"{mode}-{n}-{i}", sent[mode][i], tuple(docs[i][sent[mode][i]:upto]), 4))
                    sent[mode][i] = upto
                batches = [DraftBatch(tuple(calls))] if mode == "merged" else [DraftBatch((c,)) for c in calls]
                t0 = time.perf_counter()
                for batch in batches:
                    assert not any(r.unknown for r in service.draft(batch).replies)
                if step:  # step 0 is each session's prompt
                    times[mode].append((time.perf_counter() - t0) * 1e3)
        service.close([f"{mode}-{n}-{i}" for mode in sent for i in range(n)])
        merged, separate = statistics.median(times["merged"]), statistics.median(times["separate"])
        rows.append({"callers": n, "merged_ms": merged, "separate_ms": separate, "merged_ms_per_call": merged / n,
                     "speedup": separate / merged})
        print(f"{n} callers: one round {merged:.2f} ms, {n} rounds {separate:.2f} ms", flush=True)
    print(table(rows, ["callers", "merged_ms", "separate_ms", "merged_ms_per_call", "speedup"]))
    out = {"machine": machine_info(), "args": {"callers": callers, "steps": steps, "prompt_len": prompt_len},
           "rows": rows}
    print(f"wrote {write_results(name, out)}")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--only", default="", help="comma-separated substrings of the configurations to run (no "
                    "speculation and the co-located adaptive engine always run)")
    ap.add_argument("--name", default=None, help="results file name (default: remote_drafter, or "
                    "remote_drafter_batching with --batching)")
    ap.add_argument("--batching", default="", help="comma-separated caller counts: measure merged rounds instead")
    ap.add_argument("--steps", type=int, default=40, help="--batching: steps per caller count")
    args = ap.parse_args(argv)
    if args.batching:
        return batching([int(n) for n in args.batching.split(",")], args.steps, args.prompt_len,
                        args.name or "remote_drafter_batching")
    args.name = args.name or "remote_drafter"
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start()
    torch.set_num_threads(1)
    loads = [load for load in args.loads.split(",") if load]
    tokenizer = AutoTokenizer.from_pretrained(str(MODELS / "target"))
    prompts = {load: code_prompts(tokenizer, args.prompts if LOADS[load] == 1 else LOADS[load], args.prompt_len,
                                  seed=1 if LOADS[load] == 1 else 2) for load in loads}
    cfgs = configs()
    if args.only:
        keep = [s for s in args.only.split(",") if s]
        cfgs = {n: c for n, c in cfgs.items() if n in ("no speculation", "co-located, adaptive")
                or any(s in n for s in keep)}
    engines = {}
    for name, (kind, k, ahead, threads) in cfgs.items():
        engines[name] = make(kind, k, ahead, threads, max(LOADS[load] for load in loads))
        engines[name][0].generate([prompts[loads[0]][0]], SamplingParams(max_tokens=8, temperature=0.0))
        print(f"loaded {name}", flush=True)
    runs: dict = {}
    order = list(cfgs)
    for rep in range(args.repeats):
        for name in (order if rep % 2 == 0 else order[::-1]):
            llm, _ = engines[name]
            torch.set_num_threads(cfgs[name][3])
            for workload in ("code", "unpredictable"):
                for load in loads:
                    proposer = llm.engine.speculator.proposer if llm.engine.speculator else None
                    before = dict(getattr(proposer, "counts", {}))
                    r = run(llm, prompts[load], workload, args.new_tokens, concurrent=LOADS[load] > 1)
                    after = dict(getattr(proposer, "counts", {}))
                    if after:
                        d = {key: after[key] - before.get(key, 0) for key in after}
                        r["ahead_share"] = d["ahead"] / d["drafts"] if d["drafts"] else 0.0
                        r["failed_rounds"] = d["failures"]
                    else:
                        r["ahead_share"] = r["failed_rounds"] = None
                    runs.setdefault((name, workload, load), []).append(r)
            torch.set_num_threads(1)
        print(f"repetition {rep + 1}/{args.repeats} done", flush=True)
    rows = []
    for (name, workload, load), results in runs.items():
        ref = runs[("co-located, adaptive", workload, load)]
        base = runs[("no speculation", workload, load)]
        row = {"system": name, "workload": workload, "load": load, "repeats": len(results),
               "ratio_vs_colocated": statistics.median(r["tokens_per_s"] / b["tokens_per_s"]
                                                       for r, b in zip(results, ref, strict=True)),
               "ratio_vs_no_spec": statistics.median(r["tokens_per_s"] / b["tokens_per_s"]
                                                     for r, b in zip(results, base, strict=True))}
        for key in results[0]:
            vals = [r[key] for r in results if r.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        rows.append(row)
    cols = ["system", "workload", "load", "tokens_per_s", "ratio_vs_no_spec", "ratio_vs_colocated",
            "mean_accepted_length", "verify_ms_per_step", "draft_ms_per_step", "ahead_share", "failed_rounds"]
    print(table(rows, cols))
    pools = {}
    for name, (_, stats) in engines.items():
        if stats is not None:
            pools[name] = (ray.get(stats.stats.remote()) if cfgs[name][0] == "actor"
                           else stats.stats.remote().result(timeout_s=30))
    print(pools)
    out = {"machine": machine_info(), "args": vars(args), "rows": rows, "pools": pools}
    print(f"wrote {write_results(args.name, out)}")
    serve.shutdown()
    ray.shutdown()
    return out


if __name__ == "__main__":
    main()
