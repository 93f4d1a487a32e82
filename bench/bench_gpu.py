"""The shipped models on a GPU: packing them for a machine they must be copied to, and the
engine's exactness there.

A borrowed GPU machine takes at most 64 MiB of files, and the shipped target alone is 86 MB
(bf16). `pack` writes a folder that fits: the target's and the drafter's matrices as int8 with a
scale per row (the EAGLE-3 head as it ships), every config and tokenizer file, and the prompt sets
of `bench_spec`/`bench_tree` as token ids (the GPU machine's Python has other standard-library
files). `unpack` turns it back into model folders in bf16 there. The unpacked target is therefore
the shipped one with its weights rounded to int8 (a relative error of about 0.4% per weight):
speculation stays lossless with respect to the target actually loaded, and the acceptance
measured with it is close to, not the same as, the shipped target's.

`exact` checks on the device that every drafter's greedy text equals the target alone, token for
token, one request at a time and 16 at once (chains at fixed k, the adaptive policy, a tree), and
records the exact mode the engine chose there and the start-up profile of its steps.

    python -m bench.bench_gpu pack --out gpupack                  # here
    python -m bench.bench_gpu unpack --pack gpupack --out /tmp/m  # there
    SPECDECODE_MODELS=/tmp/m python -m bench.bench_gpu exact --prompts gpupack/prompts.json

`graphs` measures the engine with and without CUDA graphs of its steps (engine/step_graph.py).
Both write bench/results/<host>/gpu_{exact,graphs}.json unless `--out`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

QUANTIZED = ("target", "drafter")
MIN_QUANTIZED_NUMEL = 1 << 16


def quantize(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every 2-D tensor of at least MIN_QUANTIZED_NUMEL elements as int8 rows + a float32 scale
    per row (symmetric, absmax / 127); the rest unchanged."""
    out = {}
    for name, w in weights.items():
        if w.dim() == 2 and w.numel() >= MIN_QUANTIZED_NUMEL and w.is_floating_point():
            scale = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            out[name + ".q8"] = torch.round(w.float() / scale).to(torch.int8)
            out[name + ".scale"] = scale.squeeze(1)
        else:
            out[name] = w
    return out


def dequantize(packed: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in packed.items():
        if name.endswith(".q8"):
            base = name[: -len(".q8")]
            out[base] = (t.float() * packed[base + ".scale"][:, None]).to(dtype)
        elif not name.endswith(".scale"):
            out[name] = t
    return out


def pack(models: Path, out: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from bench.bench_spec import bench_prompts

    out.mkdir(parents=True, exist_ok=True)
    for name in ("target", "drafter", "eagle3-head"):
        src, dst = models / name, out / name
        dst.mkdir(exist_ok=True)
        for f in src.iterdir():
            if f.name == "model.safetensors" and name in QUANTIZED:
                save_file(quantize(load_file(str(f))), str(dst / "model.q8.safetensors"))
            elif f.name != "README.md":
                shutil.copy(f, dst / f.name)
    tokenizer = AutoTokenizer.from_pretrained(str(models / "target"))
    sets = dict(zip(("prompts", "batch", "sustained", "warm"), bench_prompts(tokenizer, 4, 16, 64, 4, 128), strict=True))
    (out / "prompts.json").write_text(json.dumps(sets))
    print(f"{out}: {sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 1e6:.1f} MB")


def unpack(pack_dir: Path, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    for src in (p for p in pack_dir.iterdir() if p.is_dir()):
        dst = out / src.name
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name == "model.q8.safetensors":
                save_file(dequantize(load_file(str(f)), torch.bfloat16), str(dst / "model.safetensors"))
            else:
                shutil.copy(f, dst / f.name)


def exact(prompts_file: Path, out_file: Path | None, device: str, new_tokens: int) -> dict:
    from bench.bench_spec import METHODS
    from bench.common import MODELS, machine_info, write_results
    from engine import LLM, SamplingParams, SpeculativeConfig

    sets = json.loads(prompts_file.read_text())
    one, many = sets["prompts"], sets["batch"]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    configs = {
        "eagle3, chain k=5": ("eagle3", dict(num_speculative_tokens=5, adaptive=False)),
        "eagle3, adaptive chain": ("eagle3", dict(num_speculative_tokens=6, adaptive=True)),
        "eagle3, tree 16/4/6": ("eagle3", dict(num_speculative_tokens=6, adaptive=False, tree_nodes=16,
                                               tree_width=4, tree_depth=6)),
        "mtp, chain k=3": ("mtp", dict(num_speculative_tokens=3, adaptive=False)),
        "draft, chain k=5": ("draft", dict(num_speculative_tokens=5, adaptive=False)),
        "ngram, chain k=5": ("ngram", dict(num_speculative_tokens=5, adaptive=False)),
    }

    def make(method, kw):
        spec = None
        if method == "mtp":
            spec = SpeculativeConfig(method="mtp", **kw)
        elif method:
            spec = SpeculativeConfig(method=method, model=METHODS[method], **kw)
        return LLM(str(MODELS / "target"), dtype="bfloat16", device=device, speculative=spec, max_num_seqs=16,
                   enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20)

    def outputs(llm):
        alone = [llm.generate([p], params)[0].token_ids for p in one]
        together = [o.token_ids for o in llm.generate(many, [params] * len(many))]
        return alone, together

    def compare(got, ref):
        firsts = [next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), None)
                  for g, r in zip(got, ref, strict=True)]
        return {"equal": sum(f is None for f in firsts), "of": len(firsts),
                "first_mismatch": [f for f in firsts if f is not None]}

    base = make(None, {})
    ref_alone, ref_together = outputs(base)
    result = {"machine": machine_info(), "new_tokens": new_tokens, "exact_mode": base.engine.runner.exact,
              "attention_backend": base.engine.runner.backend.name,
              "no_spec_alone_vs_together": compare(ref_together[: len(ref_alone)], ref_alone)
              if one == many[: len(one)] else None, "rows": {}}
    for name, (method, kw) in configs.items():
        llm = make(method, kw)
        alone, together = outputs(llm)
        row = {"alone": compare(alone, ref_alone), "together": compare(together, ref_together),
               "mean_accepted_length": llm.engine.spec_stats.as_dict().get("mean_accepted_length")}
        sp = llm.engine.speculator
        if sp is not None and sp.cost is not None:
            # the start-up profile's (or the calibrated) target step, batch 1, n tokens verified
            row["step_ms_by_tokens"] = {n: round(1e3 * sp.cost(1, n), 3) for n in (1, 2, 4, 6, 8, 12, 16)}
        result["rows"][name] = row
        print(name, row, flush=True)
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {write_results('gpu_exact', result, out_file)}")
    return result


def graphs(prompts_file: Path, out_file: Path | None, device: str, new_tokens: int, repeats: int) -> dict:
    """The engine with and without CUDA graphs (engine/step_graph.py), interleaved: no speculation,
    EAGLE-3's adaptive chain (k <= 6) and a fixed 8/2/5 EAGLE-3 tree, MTP's and the draft model's
    adaptive chains, batch 1 (greedy held-out code,
    one request at a time) and 16 at once; tokens/s, and the median decode step's time (verify,
    sampling, drafting) from the step records. Greedy text with graphs must equal without (checked)."""
    import statistics
    import time

    from bench.bench_spec import METHODS
    from bench.common import MODELS, machine_info, write_results
    from engine import LLM, SamplingParams, SpeculativeConfig

    sets = json.loads(prompts_file.read_text())
    one, many, warm = sets["prompts"], sets["batch"], sets["warm"]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    adaptive = dict(num_speculative_tokens=6, adaptive=True)
    specs = {"no speculation": (None, None),
             "eagle3 adaptive chain": ("eagle3", adaptive),
             "eagle3 tree 8/2/5": ("eagle3", dict(num_speculative_tokens=5, adaptive=False, tree_nodes=8, tree_width=2,
                                                  tree_depth=5)),
             "mtp adaptive chain": ("mtp", adaptive),
             "draft adaptive chain": ("draft", adaptive)}
    llms = {}
    for name, (method, kw) in specs.items():
        for graph in (True, False):
            spec, target = None, str(MODELS / "target")
            if method == "mtp":  # (the MTP layer is in the target's checkpoint)
                spec, target = SpeculativeConfig(method="mtp", **kw), METHODS["mtp"]
            elif method is not None:
                spec = SpeculativeConfig(method=method, model=METHODS[method], **kw)
            t0 = time.perf_counter()
            llm = LLM(target, dtype="bfloat16", device=device, speculative=spec, max_num_seqs=16,
                      enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20, cuda_graphs=graph)
            start = time.perf_counter() - t0
            for p in warm:
                llm.generate([p], params)
            proposer = llm.engine.speculator.proposer if llm.engine.speculator else None
            on = {"target": llm.engine.runner.step_graph is not None,  # (False where capture fell back)
                  "drafter": bool(getattr(proposer, "step_graph", None) or any(getattr(proposer, "step_graphs", [])))}
            llms[name, graph] = (llm, start, on)
    runs: dict = {}
    texts: dict = {}
    for rep in range(repeats):
        order = list(llms) if rep % 2 == 0 else list(llms)[::-1]
        for key in order:
            llm = llms[key][0]
            recs: list = []
            llm.engine.step_listeners.append(recs.append)
            before = llm.engine.spec_stats.as_dict()
            t0 = time.perf_counter()
            outs = [llm.generate([p], params)[0] for p in one]
            b1 = time.perf_counter() - t0
            t0 = time.perf_counter()
            together = llm.generate(many, [params] * len(many))
            b16 = time.perf_counter() - t0
            llm.engine.step_listeners.remove(recs.append)
            after = llm.engine.spec_stats.as_dict()
            steps = after["num_verify_steps"] - before["num_verify_steps"]
            dec = [r for r in recs if not r.prefill_request_ids and r.num_requests == 1]
            med = (lambda f, dec=dec: 1e3 * statistics.median(f(r) for r in dec)) if dec else (lambda f: None)
            runs.setdefault(key, []).append({
                "batch1_tokens_per_s": len(one) * new_tokens / b1, "16_at_once_tokens_per_s": len(many) * new_tokens / b16,
                "step_ms": med(lambda r: r.duration_s), "verify_ms": med(lambda r: r.verify_time_s),
                "sample_ms": med(lambda r: r.sample_time_s), "draft_ms": med(lambda r: r.draft_time_s),
                "mean_accepted_length": (after["num_accepted_tokens"] - before["num_accepted_tokens"] + steps) / steps
                if steps else None,
            })
            texts[key] = ([o.token_ids for o in outs], [o.token_ids for o in together])
        print(f"repetition {rep + 1}/{repeats} done", flush=True)
    rows = []
    base = {g: statistics.median(r["batch1_tokens_per_s"] for r in runs["no speculation", g]) for g in (True, False)}
    for (name, graph), results in runs.items():
        row = {"config": name, "cuda_graphs": graph, "start_up_s": llms[name, graph][1],
               "graphs_on": llms[name, graph][2]}
        for k in results[0]:
            vals = [r[k] for r in results if r[k] is not None]
            row[k] = statistics.median(vals) if vals else None
        row["batch1_vs_no_spec_same_graphs"] = row["batch1_tokens_per_s"] / base[graph]
        row["batch1_vs_no_spec_eager"] = row["batch1_tokens_per_s"] / base[False]
        row["text_equal_to_eager"] = texts[name, graph] == texts[name, False]
        row["text_equal_to_no_spec"] = texts[name, graph] == texts["no speculation", graph]
        sp = llms[name, graph][0].engine.speculator
        if sp is not None and sp.cost is not None:
            row["profile_step_ms"] = {n: round(1e3 * sp.cost(1, n), 3) for n in (1, 7, 9, 16)}
        rows.append(row)
        print(row, flush=True)
    result = {"machine": machine_info(), "new_tokens": new_tokens, "repeats": repeats, "rows": rows}
    print(f"wrote {write_results('gpu_graphs', result, out_file)}")
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--models", type=Path, default=Path(__file__).resolve().parents[1] / "models")
    p.add_argument("--out", type=Path, required=True)
    u = sub.add_parser("unpack")
    u.add_argument("--pack", type=Path, required=True)
    u.add_argument("--out", type=Path, required=True)
    e = sub.add_parser("exact")
    e.add_argument("--prompts", type=Path, required=True)
    e.add_argument("--out", type=Path, help="result JSON (default: bench/results/<host>/gpu_exact.json)")
    e.add_argument("--device", default="cuda")
    e.add_argument("--new-tokens", type=int, default=64)
    g = sub.add_parser("graphs")
    g.add_argument("--prompts", type=Path, required=True)
    g.add_argument("--out", type=Path, help="result JSON (default: bench/results/<host>/gpu_graphs.json)")
    g.add_argument("--device", default="cuda")
    g.add_argument("--new-tokens", type=int, default=96)
    g.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        pack(args.models, args.out)
    elif args.cmd == "unpack":
        unpack(args.pack, args.out)
    elif args.cmd == "graphs":
        graphs(args.prompts, args.out, args.device, args.new_tokens, args.repeats)
    else:
        exact(args.prompts, args.out, args.device, args.new_tokens)


if __name__ == "__main__":
    main()
