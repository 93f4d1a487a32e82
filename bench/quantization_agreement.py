"""How far each `quantization` of a GGUF target moves its next-token predictions from the same
file dequantized to float32: teacher-forced along the dequantized model's own greedy responses
to held-out chat prompts, the share of positions whose top token agrees, and the largest logit
error relative to its row's largest logit. A property of the products, not a timing.

    python -m bench.quantization_agreement [--model GGUF] [--prompts 6] [--max-tokens 96]
        [--quantizations gguf,gguf_a8]

Every position runs as a decode step does (one token over the paged cache, through the CPU row
kernels), so the logits are those the engine's steps compute.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import machine_info, table, write_results
from engine import LLM, SamplingParams


def step_logits(model, tokens: list[int], block_size: int = 16) -> torch.Tensor:
    """The logits of every position of `tokens`, one token a step through the row kernels."""
    from engine.model_runner import SeqChunk, allocate_kv_cache, build_forward_batch
    from engine.models.llama import ROW_KERNEL
    from kernels import get_attention_backend

    cpu = torch.device("cpu")
    backend = get_attention_backend(cpu, "torch")
    num_blocks = -(-len(tokens) // block_size)
    caches = allocate_kv_cache(model.cfg, num_blocks, block_size, torch.float32, cpu)
    out = []
    for pos in range(len(tokens)):
        batch = build_forward_batch([SeqChunk(tokens[pos : pos + 1], pos, list(range(num_blocks)))], block_size,
                                    backend, cpu, row_exact="kernel")
        hidden = model(batch.input_ids, batch.positions, caches, batch.attn_metadata, backend, tile_rows=ROW_KERNEL)
        out.append(model.compute_logits(hidden, tile_rows=ROW_KERNEL))
    return torch.cat(out)


def main(argv=None) -> dict:
    from bench.bench_chat import chat_prompts
    from engine.models.loader import load_model
    from models.fetch import cached_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the fetched SmolLM2 GGUF)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--quantizations", default="gguf,gguf_a8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = args.model or str(cached_path("smollm2"))
    quantizations = args.quantizations.split(",")

    reference_llm = LLM(model=path, dtype="float32", quantization="none")
    sequences = []
    for ids in chat_prompts(reference_llm, args.prompts):
        out = reference_llm.generate([ids], SamplingParams(max_tokens=args.max_tokens, temperature=0.0))[0]
        sequences.append(list(ids) + list(out.token_ids))
    del reference_llm
    max_len = max(len(s) for s in sequences) + 16
    models = {q: load_model(path, torch.float32, torch.device("cpu"), max_len, quantization=q)[0]
              for q in ["none", *quantizations]}
    rows = {q: {"quantization": q, "positions": 0, "top1_agree": 0, "max_logit_error": 0.0} for q in quantizations}
    for seq in sequences:
        reference = step_logits(models["none"], seq)
        ref_top = reference.argmax(-1)
        ref_scale = reference.abs().max(-1).values
        for q in quantizations:
            got = step_logits(models[q], seq)
            r = rows[q]
            r["positions"] += len(seq)
            r["top1_agree"] += int((got.argmax(-1) == ref_top).sum())
            r["max_logit_error"] = max(r["max_logit_error"], float(((got - reference).abs().max(-1).values / ref_scale).max()))
    for r in rows.values():
        r["top1_agreement"] = r["top1_agree"] / r["positions"]
    print(table(list(rows.values()), ["quantization", "positions", "top1_agreement", "max_logit_error"]))
    results = {"machine": machine_info(), "model": path, "prompts": args.prompts, "max_tokens": args.max_tokens,
               "reference": "the same file dequantized to float32 (quantization 'none'), its greedy responses",
               "rows": list(rows.values())}
    print(f"wrote {write_results('quantization_agreement', results, args.out)}")
    return results


if __name__ == "__main__":
    main()
