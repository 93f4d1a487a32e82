"""The packed CPU matmul (kernels/csrc/products.cpp `packed_linear`) against another version of the
same sources, interleaved, on the shipped target's matrix shapes: the time of x[M, K] @ w.T for
M rows (1: a decode step, 5 / 9: a verification of 4 / 8 drafts, 16: 16 concurrent requests,
128 / 512: prefill chunks) and the multiply-adds per second. Both versions must give the same
bits (checked; `--other-order` when the baseline sums in another order: the largest relative
difference is reported instead). `--baseline` is a folder of sources (kernels/csrc of another
commit) or one .cpp file (earlier commits' single-file kernels/cpu_rows.cpp). Example, against
the kernels before a change:

    mkdir -p /tmp/before && git archive HEAD kernels/csrc | tar -x -C /tmp/before
    python -m bench.bench_kernels --baseline /tmp/before/kernels/csrc

Timings: per configuration `--reps` interleaved rounds (baseline, current, baseline, ...) of
`--calls` calls each; the medians are reported. One thread unless --threads. Results go to
`bench/results/<host>/kernels.json` (`kernels_step.json` with `--step`, `rows_attention.json` with
`--attention`, `prefill_attention.json` with `--prefill-attention`) unless `--out`.

Layouts (`--layouts`): `widen` (bfloat16 widened to float32 in registers, or float32 weights) and
`dp` (bfloat16 weights for AVX512-BF16 `vdpbf16ps`, where the CPU has it). A shape's weights stay
in cache across calls (warm). `--step` times what a decode or verification step does instead:
every product of the target's forward, each layer's own weights (12 x 4 products and the LM
head, 80 MB in bfloat16), so the weights come from DRAM as in the engine, e.g.

    python -m bench.bench_kernels --step --rows 1,2,4,5,6,8,12,16 --dtypes bfloat16 --layouts dp

`--attention` times the rows path's attention of a step over the 12 layers' bfloat16 caches of the
shipped target's shape (230 positions of context): one decode token, a verification of 5 drafts
(6 tokens of one request), 16 requests' decode tokens; `attention_rows_dp` (AVX512-BF16 dot
products) against the float32 kernel and, on an AMX CPU, `attention_rows_amx` (tiles), interleaved;
with `--baseline`, also `attention_rows_dp` of the other source, interleaved, bits required equal:

    python -m bench.bench_kernels --attention --baseline /tmp/before/kernels/csrc

`--real-shapes` sweeps the matrices of checkpoints people run (SmolLM2-135M, Qwen2.5-0.5B,
Llama-3.2-1B: q/k/v fused, o, gate+up fused, down, the LM head) in every layout this CPU runs
(`widen` and `dp` bfloat16, the GGUF blocks Q4_1 and Q8_0 of `pack_rows_gguf`, Q4_1 with int8
activations `Q4_1a8`: `quantization="gguf_a8"`), at 1 row (a
decode step) and 6 (a verification of 5 drafts), with the weights cold (distinct copies cycled,
more bytes than the L3 cache, as a step streams them): the time per product and the weights'
GB/s, against the host's memory bandwidth measured in the same run at the same thread count (a
512 MiB torch copy, bytes read plus written a second; and a sum over 512 MiB, the read stream a
product's weights are: `of_read_bw`):

    python -m bench.bench_kernels --real-shapes --threads 2

`--prefill-attention` times the torch backend's attention of prompt chunks (q_len query tokens
after `context` cached ones, the shipped target's heads, bfloat16) through
`cpu_kernels.prefill_attention` and through torch's SDPA, interleaved; then the
whole prefill of a 1.5k-token prompt by the shipped target with each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from bench.common import ROOT, machine_info, table, write_results
from kernels import cpu_kernels

SHAPES = ((2816, 512), (1024, 512), (512, 1408))  # gate+up, q/k/v, down of the shipped target
# one forward of the shipped target: per layer q/k/v, o, gate+up, down; then the LM head
STEP = [(1024, 512), (512, 512), (2816, 512), (512, 1408)] * 12 + [(8192, 512)]


def extra(m) -> tuple:
    """rows_attention's trailing tree argument (none) where that build of the source takes one."""
    return (torch.empty(0, dtype=torch.int64),) if "arg7" in (m.rows_attention.__doc__ or "") else ()


def sources(path: Path) -> list[Path]:
    """The translation units of a `--baseline`: a folder's .cpp files, or the one file."""
    return sorted(path.glob("*.cpp")) if path.is_dir() else [path]


def build(name: str, files: list[Path]):
    out = Path("build") / "bench_kernels" / name
    out.mkdir(parents=True, exist_ok=True)
    return load(name=f"bench_rows_{name}", sources=[str(s) for s in files],
                extra_cflags=cpu_kernels.CFLAGS, build_directory=str(out))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="other kernel sources to compare against: a folder of .cpp files or one .cpp file (optional)")
    ap.add_argument("--other-order", action="store_true",
                    help="the baseline sums in another order: report the largest difference instead of requiring equal bits")
    ap.add_argument("--rows", default="1,5,9,16,128,512")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layouts", default="widen,dp", help="widen, dp (AVX512-BF16; bfloat16 only)")
    ap.add_argument("--step", action="store_true", help="time a whole step's products (cold weights)")
    ap.add_argument("--prefill-attention", action="store_true",
                    help="prefill_attention vs SDPA on prompt chunks, and a 1.5k-token prefill with each")
    ap.add_argument("--attention", action="store_true",
                    help="the rows path's attention of a step: dot products (bfloat16) vs the float32 kernel")
    ap.add_argument("--real-shapes", action="store_true",
                    help="products of published checkpoints' matrices in every layout, GB/s against the copy bandwidth")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.real_shapes:
        return real_shapes_bench(args.reps, args.threads, args.out)
    if args.attention:
        return rows_attention_bench(args.reps, args.out,
                                    build("baseline", sources(args.baseline)) if args.baseline else None)
    if args.prefill_attention:
        return prefill_attention_bench(args.reps, args.out)
    mods = {"current": build("current", cpu_kernels.SOURCES)}
    if args.baseline:
        mods["baseline"] = build("baseline", sources(args.baseline))
    rows = []
    g = torch.Generator().manual_seed(0)
    dp_ok = all(m.has_dot_bf16() for m in mods.values())
    for dtype in args.dtypes.split(","):
        for layout in args.layouts.split(","):
            if layout == "dp" and (dtype != "bfloat16" or not dp_ok):
                continue
            for n, k, products in ([("step", 512, STEP)] if args.step else [(n, k, [(n, k)]) for n, k in SHAPES]):
                ws = [torch.randn(pn, pk, generator=g).to(getattr(torch, dtype)) for pn, pk in products]
                # on huge pages, as the engine keeps them (else one module's weights may land on
                # transparent huge pages and the other's not: a 5-20% bias at a step's 80-160 MB)
                packed = {name: cpu_kernels.on_huge_pages([m.pack_rows(w, layout == "dp") for w in ws])
                          for name, m in mods.items()}
                macs_per_row = sum(pn * pk for pn, pk in products)
                for m_rows in (int(r) for r in args.rows.split(",")):
                    xs = {pk: torch.randn(m_rows, pk, generator=g) for pk in {pk for _, pk in products}}

                    def run(name, xs=xs, products=products, packed=packed):
                        return [mods[name].packed_linear(xs[pk], wp, pn, torch.empty(0))
                                for (pn, pk), wp in zip(products, packed[name], strict=True)]

                    outs = {name: run(name) for name in mods}
                    diff = None
                    if "baseline" in outs and args.other_order:
                        diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(outs["current"], outs["baseline"], strict=True))
                    elif "baseline" in outs:
                        assert all(torch.equal(a, b) for a, b in zip(outs["current"], outs["baseline"], strict=True)), (dtype, n, k, m_rows)
                    calls = 1 if args.step else max(1, args.calls * 16 // max(m_rows, 16))
                    times: dict[str, list[float]] = {name: [] for name in mods}
                    for rep in range(args.reps):
                        for name in (list(mods) if rep % 2 == 0 else list(mods)[::-1]):
                            t0 = time.perf_counter()
                            for _ in range(calls):
                                run(name)
                            times[name].append((time.perf_counter() - t0) / calls)
                    row = {"dtype": dtype, "layout": layout, "shape": n if args.step else f"{n}x{k}", "rows": m_rows}
                    for name, ts in times.items():
                        row[f"{name}_us"] = 1e6 * statistics.median(ts)
                        row[f"{name}_gmac_s"] = macs_per_row * m_rows / statistics.median(ts) / 1e9
                    if "baseline" in times:
                        row["speedup"] = row["baseline_us"] / row["current_us"]
                    if diff is not None:
                        row["max_rel_diff"] = diff
                    rows.append(row)
                    print(row, flush=True)
    cols = ["dtype", "layout", "shape", "rows", "current_us", "current_gmac_s"]
    if args.baseline:
        cols += ["baseline_us", "baseline_gmac_s", "speedup"]
    print(table(rows, cols))
    results = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    print(f"wrote {write_results('kernels_step' if args.step else 'kernels', results, args.out)}")
    return results


# (hidden, heads, kv heads, head dim, intermediate, vocabulary) of published checkpoints
REAL_MODELS = {
    "SmolLM2-135M": (576, 9, 3, 64, 1536, 49152),
    "Qwen2.5-0.5B": (896, 14, 2, 64, 4864, 151936),
    "Llama-3.2-1B": (2048, 32, 8, 64, 8192, 128256),
}
COLD_BYTES = 96 << 20  # copies of a matrix cycled per timing: 3x this host class's L3 at least


def model_matrices(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, vocab: int) -> dict:
    """name -> (N, K) of y = x @ w.T: the decoder layer's four products and the LM head."""
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter), "lm_head": (vocab, hidden)}


def memory_bandwidth(reps: int) -> tuple[float, float]:
    """(copy, read) in GB/s at the current thread count, medians: a 512 MiB torch copy (bytes read
    plus bytes written a second) and a sum over 512 MiB (a read stream, as a product's weights are)."""
    src = torch.ones(128 << 20)
    dst = torch.empty_like(src)
    copy, read = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        src.sum()
        copy.append(t1 - t0)
        read.append(time.perf_counter() - t1)
    nbytes = src.numel() * 4
    return 2 * nbytes / statistics.median(copy) / 1e9, nbytes / statistics.median(read) / 1e9


def packed_copies(layout: str, n: int, k: int, copies: int, g: torch.Generator) -> list[torch.Tensor]:
    """`copies` distinct packings of one random n x k matrix in `layout` (widen, dp, Q4_1, Q8_0,
    Q4_1a8: Q4_1 blocks marked for int8 activations)."""
    w = torch.randn(n, k, generator=g) * 0.05
    blocks = layout.removesuffix("a8")
    if blocks in cpu_kernels.GGUF_PACKED_TYPES:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        raw = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType[blocks]))
        one = cpu_kernels.pack_rows_gguf(raw, blocks, k)
        if layout.endswith("a8"):
            one = cpu_kernels.gguf_int8_activations(one)
    else:
        one = cpu_kernels.pack_rows(w.bfloat16(), layout == "dp")
    # copies of one packing: the bytes differ in place only, the time depends on where they live
    return cpu_kernels.on_huge_pages([one] * copies)


def real_shapes_bench(reps: int, threads: int, out: str | None = None) -> dict:
    """See the module docstring (`--real-shapes`)."""
    g = torch.Generator().manual_seed(0)
    layouts = ["widen"] + (["dp"] if cpu_kernels.dot_bf16_available() else [])
    layouts += list(("Q4_1", "Q4_1a8", "Q8_0") if cpu_kernels.gguf_available() else ())
    copy_gb_s, read_gb_s = memory_bandwidth(2 * reps + 1)
    print(f"memory bandwidth ({threads} threads): copy {copy_gb_s:.1f} GB/s (read + written), read {read_gb_s:.1f} GB/s",
          flush=True)
    rows = []
    for model, dims in REAL_MODELS.items():
        for name, (n, k) in model_matrices(*dims).items():
            for layout in layouts:
                nbytes = None
                for m_rows in (1, 6):
                    if nbytes is None:
                        probe = packed_copies(layout, n, k, 1, g)[0]
                        nbytes = probe.numel() * probe.element_size()
                        ws = packed_copies(layout, n, k, max(2, -(-COLD_BYTES // nbytes)), g)
                    x = torch.randn(m_rows, k, generator=g)
                    for w in ws:  # once over every copy: page faults and first-touch out of the timing
                        cpu_kernels.packed_linear(x, w, n, None)
                    times = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        for w in ws:
                            cpu_kernels.packed_linear(x, w, n, None)
                        times.append((time.perf_counter() - t0) / len(ws))
                    t = statistics.median(times)
                    row = {"model": model, "matrix": name, "shape": f"{n}x{k}", "layout": layout, "rows": m_rows,
                           "bytes": nbytes, "us": 1e6 * t, "gb_s": nbytes / t / 1e9,
                           "of_read_bw": nbytes / t / 1e9 / read_gb_s, "gmac_s": n * k * m_rows / t / 1e9}
                    rows.append(row)
                    print(row, flush=True)
                del ws
    print(table(rows, ["model", "matrix", "shape", "layout", "rows", "us", "gb_s", "of_read_bw", "gmac_s"]))
    results = {"machine": machine_info(), "threads": threads, "copy_gb_s": copy_gb_s, "read_gb_s": read_gb_s, "rows": rows}
    print(f"wrote {write_results('kernels_real_shapes', results, out)}")
    return results


def rows_attention_bench(reps: int, out: str | None = None, baseline=None) -> dict:
    """See the module docstring (`--attention`); `baseline`: another build's module, whose dot
    kernel is timed too (and must give the same bits)."""
    g = torch.Generator().manual_seed(0)
    bs, hkv, d, h, blocks, ctx = 16, 4, 64, 8, 128, 230  # the shipped target's heads, bfloat16 caches
    layers = [tuple(torch.randn(blocks, bs, hkv, d, generator=g).bfloat16() for _ in range(2)) for _ in range(12)]
    mod = cpu_kernels._module()
    rows = []
    for name, tokens, requests in (("decode, 1 request", 1, 1), ("verification of 5 drafts", 6, 1),
                                   ("decode, 16 requests", 16, 16)):
        tables = torch.stack([torch.randperm(blocks, generator=g)[: -(-ctx // bs)] for _ in range(requests)])
        tables = tables.repeat_interleave(tokens // requests, 0).contiguous()
        lens = (torch.arange(ctx - tokens + 1, ctx + 1) if requests == 1 else torch.full((tokens,), ctx)).to(torch.int64)
        q = torch.randn(tokens, h, d, generator=g)
        # (module, dot products, AMX tiles where they run)
        variants = {"dot": (mod, True, False), "float32": (mod, False, False)}
        if cpu_kernels.amx_available():
            variants["amx"] = (mod, True, True)
        if baseline is not None:
            variants["baseline_dot"] = (baseline, True, False)
            if cpu_kernels.amx_available() and hasattr(baseline, "set_amx_attention"):
                variants["baseline_amx"] = (baseline, True, True)
                baseline.set_amx_attention(False)
            k, v = layers[0]
            mod.set_amx_attention(False)
            ours, theirs = (m.rows_attention(q, k, v, tables, lens, d**-0.5, True, *extra(m)) for m in (mod, baseline))
            if not torch.equal(ours, theirs):
                raise SystemExit(f"{name}: the baseline's attention_rows_dp gives other bits")
        times: dict[str, list[float]] = {key: [] for key in variants}
        for rep in range(reps * 20):
            for key in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
                m, dot, amx = variants[key]
                if hasattr(m, "set_amx_attention"):
                    m.set_amx_attention(amx)
                t0 = time.perf_counter()
                for k, v in layers:
                    m.rows_attention(q, k, v, tables, lens, d**-0.5, dot, *extra(m))
                times[key].append(time.perf_counter() - t0)
        row = {"step": name, "query_tokens": tokens, "context": ctx,
               "float32_us": 1e6 * statistics.median(times["float32"]), "dot_us": 1e6 * statistics.median(times["dot"])}
        row["speedup"] = row["float32_us"] / row["dot_us"]
        if "amx" in times:
            row["amx_us"] = 1e6 * statistics.median(times["amx"])
            row["amx_speedup_over_dot"] = row["dot_us"] / row["amx_us"]
        if baseline is not None:
            row["baseline_dot_us"] = 1e6 * statistics.median(times["baseline_dot"])
            row["speedup_over_baseline"] = row["baseline_dot_us"] / row["dot_us"]
            if "baseline_amx" in times:
                row["baseline_amx_us"] = 1e6 * statistics.median(times["baseline_amx"])
        rows.append(row)
        print(row, flush=True)
    mod.set_amx_attention(True)  # (the default)
    print(table(rows, ["step", "query_tokens", "context", "float32_us", "dot_us", "speedup"]
                + (["amx_us", "amx_speedup_over_dot"] if cpu_kernels.amx_available() else [])
                + (["baseline_dot_us", "speedup_over_baseline"] if baseline is not None else [])
                + (["baseline_amx_us"] if rows and "baseline_amx_us" in rows[0] else [])))
    results = {"machine": machine_info(), "rows": rows}
    print(f"wrote {write_results('rows_attention', results, out)}")
    return results


PREFILL_CHUNKS = ((16, 0), (64, 0), (128, 0), (512, 0), (1500, 0), (32, 1500), (256, 1250), (512, 1000))


def prefill_attention_bench(reps: int, out: str | None = None) -> dict:
    """See the module docstring (`--prefill-attention`)."""
    from unittest import mock

    from kernels import torch_attn

    if not cpu_kernels.prefill_attention_available():
        raise SystemExit("prefill_attention needs the CPU kernels and AVX512-BF16")
    cfg = json.loads((ROOT / "models" / "target" / "config.json").read_text())
    h, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, bs = cfg["hidden_size"] // h, 16
    backend = torch_attn.TorchAttentionBackend()
    g = torch.Generator().manual_seed(0)
    rows = []
    for q_len, context in PREFILL_CHUNKS:
        seq = context + q_len
        nblocks = -(-seq // bs)
        k_cache = torch.randn(nblocks, bs, hkv, d, generator=g).bfloat16()
        v_cache = torch.randn(nblocks, bs, hkv, d, generator=g).bfloat16()
        table_ = list(range(nblocks))
        q = torch.randn(q_len, h, d, generator=g).bfloat16()
        slots = list(range(context, seq))
        mds = {}
        for name, threshold in (("kernel", torch_attn.PREFILL_KERNEL_MIN_QUERY), ("sdpa", 10**9)):
            with mock.patch.object(torch_attn, "PREFILL_KERNEL_MIN_QUERY", threshold):
                mds[name] = backend.build_metadata([q_len], [seq], [table_], slots, bs, torch.device("cpu"))
        times: dict[str, list[float]] = {name: [] for name in mds}
        outs = {name: backend.attention(q, k_cache, v_cache, md, d**-0.5) for name, md in mds.items()}
        for rep in range(reps):
            for name in (list(mds) if rep % 2 == 0 else list(mds)[::-1]):
                t0 = time.perf_counter()
                backend.attention(q, k_cache, v_cache, mds[name], d**-0.5)
                times[name].append(time.perf_counter() - t0)
        row = {"q_len": q_len, "context": context, "kernel_ms": 1e3 * statistics.median(times["kernel"]),
               "sdpa_ms": 1e3 * statistics.median(times["sdpa"]),
               "max_abs_diff": (outs["kernel"].float() - outs["sdpa"].float()).abs().max().item()}
        row["speedup"] = row["sdpa_ms"] / row["kernel_ms"]
        rows.append(row)
        print(row, flush=True)
    # the whole prefill of a long prompt (the EAGLE-3 head's catch-up is not in it: max_tokens 1)
    from transformers import AutoTokenizer

    from bench.common import code_prompts
    from engine import LLM, SamplingParams

    target = ROOT / "models" / "target"
    prompts = code_prompts(AutoTokenizer.from_pretrained(str(target)), 2 * reps + 1, 1500, seed=0)
    llm = LLM(str(target), dtype="bfloat16", device="cpu", enable_prefix_caching=False, num_threads=1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[-1]], params)
    prefill: dict[str, list[float]] = {"kernel": [], "sdpa": []}
    for rep in range(reps):
        for i, name in enumerate(("kernel", "sdpa") if rep % 2 == 0 else ("sdpa", "kernel")):
            threshold = torch_attn.PREFILL_KERNEL_MIN_QUERY if name == "kernel" else 10**9
            with mock.patch.object(torch_attn, "PREFILL_KERNEL_MIN_QUERY", threshold):
                t0 = time.perf_counter()
                llm.generate([prompts[2 * rep + i]], params)
                prefill[name].append(time.perf_counter() - t0)
    whole = {f"{name}_s": statistics.median(ts) for name, ts in prefill.items()}
    whole["prompt_tokens"] = len(prompts[0])
    print(table(rows, ["q_len", "context", "kernel_ms", "sdpa_ms", "speedup", "max_abs_diff"]))
    print(f"prefill of a {whole['prompt_tokens']}-token prompt: {whole['kernel_s']:.3f} s with prefill_attention, "
          f"{whole['sdpa_s']:.3f} s with SDPA")
    results = {"machine": machine_info(), "heads": [h, hkv, d], "rows": rows, "prefill": whole}
    print(f"wrote {write_results('prefill_attention', results, out)}")
    return results


if __name__ == "__main__":
    main()
