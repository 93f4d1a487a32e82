"""Engine benchmark (no speculation): batch-1 greedy decode vs transformers `generate` on the same
weights and dtype, throughput at 16 concurrent requests vs batch 1, and the decode step time
against the memory-bandwidth bound (weight bytes / measured copy bandwidth).

    python -m bench.bench_engine [--model models/target] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import MODELS, code_prompts, machine_info, median, table, timed, write_results
from engine import LLM, SamplingParams


def copy_bandwidth_bytes_per_s(num_bytes: int = 256 << 20, reps: int = 5) -> float:
    """Read+write bandwidth of a large tensor copy (bytes moved / second), median of reps."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        _, dt = timed(lambda: dst.copy_(src))
        times.append(dt)
    return 2 * num_bytes / median(times)


def hf_generate_tokens_per_s(model_dir: str, prompts, new_tokens: int, dtype) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outs, total = [], 0.0
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            r, dt = timed(lambda ids=ids: model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                         pad_token_id=0))
        outs.append(r[0, len(p):].tolist())
        total += dt
    return len(prompts) * new_tokens / total, outs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(MODELS / "target"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for every system measured (1: steady on a shared 2-core host)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_num_seqs=max(64, args.concurrency))
    prompts = code_prompts(llm.tokenizer, max(args.prompts, args.concurrency), args.prompt_len)
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up

    step_times: list[float] = []
    llm.engine.step_listeners.append(lambda rec: step_times.append(rec.duration_s) if rec.num_batched_tokens == 1 else None)
    ours_outs, total = [], 0.0
    for p in prompts[: args.prompts]:
        out, dt = timed(lambda p=p: llm.generate([p], sp)[0])
        ours_outs.append(out.token_ids)
        total += dt
    ours_b1 = args.prompts * args.new_tokens / total
    decode_step = median(step_times)
    llm.engine.step_listeners.clear()

    batch = prompts[: args.concurrency]
    _, dt = timed(lambda: llm.generate(batch, sp))
    ours_bn = len(batch) * args.new_tokens / dt

    hf_b1, hf_outs = hf_generate_tokens_per_s(args.model, prompts[: args.prompts], args.new_tokens, dtype)
    same = sum(a == b for a, b in zip(ours_outs, hf_outs, strict=True))

    weight_bytes = llm.engine.runner.weight_bytes()
    bw = copy_bandwidth_bytes_per_s()
    bound = weight_bytes / bw
    results = {
        "machine": machine_info(),
        "model": args.model,
        "dtype": args.dtype,
        "num_parameters": llm.engine.runner.num_parameters,
        "weight_bytes": weight_bytes,
        "ours_batch1_tokens_per_s": ours_b1,
        "transformers_batch1_tokens_per_s": hf_b1,
        "speedup_vs_transformers": ours_b1 / hf_b1,
        f"ours_{args.concurrency}_concurrent_tokens_per_s": ours_bn,
        "throughput_ratio_concurrent_vs_batch1": ours_bn / ours_b1,
        "decode_step_median_s": decode_step,
        "copy_bandwidth_bytes_per_s": bw,
        "bandwidth_bound_step_s": bound,
        "step_over_bound": decode_step / bound,
        "greedy_outputs_identical_to_transformers": f"{same}/{args.prompts}",
    }
    path = write_results("engine", results)
    rows = [
        {"what": "ours, batch 1 (tokens/s)", "value": ours_b1},
        {"what": "transformers generate, batch 1 (tokens/s)", "value": hf_b1},
        {"what": "speedup vs transformers (goal >= 1.3)", "value": ours_b1 / hf_b1},
        {"what": f"ours, {args.concurrency} concurrent (tokens/s)", "value": ours_bn},
        {"what": f"{args.concurrency} concurrent / batch 1 (goal >= 4)", "value": ours_bn / ours_b1},
        {"what": "decode step, median (ms)", "value": decode_step * 1e3},
        {"what": "bandwidth bound: weights / copy bandwidth (ms)", "value": bound * 1e3},
        {"what": "step / bound", "value": decode_step / bound},
        {"what": "greedy outputs identical to transformers (bf16)", "value": f"{same}/{args.prompts}"},
    ]
    print(table(rows, ["what", "value"]))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
