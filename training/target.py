"""The target's pipelines: pre-training from scratch, shrinking to the shipped depth, continued
pre-training, and the side-by-side comparison of two targets.

The target is trained with next-token cross-entropy (or distilled from a deeper copy of itself);
the draft models are trained on it afterwards (training/drafters.py, eagle3.py, mtp.py).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

import torch

from . import data, pipeline
from .config import TARGET_SPEC
from .pipeline import build_llama, fit, heldout_nll, load_streams, load_target, log, save_lm, train_config
from .trainer import distill_loss_fn, lm_loss_fn


def pretrain(args: argparse.Namespace) -> None:
    """`target`: pre-train models/target (LlamaForCausalLM) from scratch."""
    cfg = train_config(args, "target")
    train, held = load_streams(cfg.seq_len, args.corpus)
    model = build_llama(TARGET_SPEC, cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"target: {n_params / 1e6:.2f}M params, {train.shape[0]} train seqs of {cfg.seq_len}, config {asdict(cfg)}"
    )
    out = fit(args, cfg, model, lm_loss_fn(model), train, 0, "target.pt")
    if out is None:
        return
    save_lm("target", model, held, out, cfg, n_params, args)


def continue_pretraining(args: argparse.Namespace) -> None:
    """`target-continue`: continued pre-training of an already trained target (``--init-from``,
    default models/target).

    Same next-token loss and data as ``target`` but a new sampling order (seed + 5), written to
    ``--out`` (default runs/target-continued) rather than models/, so that the shipped family stays
    consistent until its drafters are retrained on the new weights. Resumable with ``--resume``;
    ``--max-minutes`` is the total budget over all resumptions (raise it to continue a finished run)."""
    from transformers import LlamaForCausalLM

    cfg = train_config(args, "target-continue")
    train, held = load_streams(cfg.seq_len, args.corpus)
    src = Path(args.init_from) if args.init_from else pipeline.MODELS / "target"
    model = LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32, attn_implementation="sdpa")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target-continue: from {src}, {n_params / 1e6:.2f}M params, config {asdict(cfg)}")
    loss_fn = lm_loss_fn(model)
    model.eval()
    if not args.measure_steps:
        nll_before = heldout_nll(lambda b: model(input_ids=b).logits, held, max_seqs=args.eval_seqs)
        log(f"target-continue: held-out NLL before {nll_before:.4f}")
    out = fit(args, cfg, model, loss_fn, train, 5, "target-continue.pt")
    if out is None:
        return
    out.update(init_from=str(src), heldout_nll_before=nll_before)
    save_lm("target-continue", model, held, out, cfg, n_params, args, folder=Path(args.out), tokenizer_from=src)


COMPARE_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',  # `make demo`'s prompt
    "import os\n\n\ndef find_files(root, suffix):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
)


def compare_targets(args: argparse.Namespace) -> None:
    """`compare-targets`: held-out NLL (the same 64 x 512 tokens as every card) and greedy
    completions of a few prompts, for `--before` (default models/target) and `--init-from`
    (default runs/target-continued), as markdown for the card: transformers' `generate` on the
    prompt as tokenized, and our engine with token healing (the prompt's last token dropped, the
    first generated one constrained to start with its text: a prompt ending in a newline otherwise
    ends with a lone newline token)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from engine import LLM, SamplingParams

    _, held = load_streams(args.seq_len)
    folders = [Path(args.before or pipeline.MODELS / "target"), Path(args.init_from or "runs/target-continued")]
    tok = AutoTokenizer.from_pretrained(str(folders[0]))
    lines = ["| model | held-out NLL (nats/token) | perplexity |", "|---|---|---|"]
    samples = []
    healed = SamplingParams(max_tokens=64, temperature=0.0, token_healing=True)
    for folder in folders:
        model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        nll = heldout_nll(lambda b, m=model: m(input_ids=b).logits, held, max_seqs=args.eval_seqs)
        lines.append(f"| {folder} | {nll:.4f} | {float(torch.tensor(nll).exp()):.2f} |")
        llm = LLM(str(folder), dtype="float32", device="cpu")
        for prompt in COMPARE_PROMPTS:
            ids = tok(prompt, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=data.EOS_ID)
            samples.append(f"**{folder}**, greedy, 64 tokens:\n\n```python\n{prompt}{tok.decode(out[0, ids.shape[1]:])}\n```\n")
            text = llm.generate([prompt], healed)[0].text
            samples.append(f"**{folder}**, greedy, 64 tokens, token healing (our engine):\n\n```python\n{prompt}{text}\n```\n")
    text = "\n".join(lines) + "\n\n" + "\n".join(samples)
    (pipeline.RUNS / "compare_targets.md").write_text(text)
    print(text)


def shrink(args: argparse.Namespace) -> None:
    """`shrink`: models/target = the --teacher model without --drop-layers, healed by
    KL(teacher || student).

    Dropping every third layer of a deep pre-trained target keeps more of it than dropping its
    last layers, and costs far less than pre-training a shallower target for the same time."""
    from transformers import LlamaForCausalLM

    cfg = train_config(args, "shrink")
    train, held = load_streams(cfg.seq_len, args.corpus)
    teacher = load_target(Path(args.teacher), args.dtype)
    student = LlamaForCausalLM.from_pretrained(args.teacher, dtype=torch.float32, attn_implementation="sdpa")
    drop = sorted({int(i) for i in args.drop_layers.split(",") if i.strip()})
    n_layers = student.config.num_hidden_layers
    if not drop or any(not 0 <= i < n_layers for i in drop):
        raise SystemExit(f"--drop-layers must name layers in [0, {n_layers}), got {args.drop_layers!r}")
    keep = [i for i in range(n_layers) if i not in drop]
    student.model.layers = torch.nn.ModuleList(student.model.layers[i] for i in keep)
    for new, layer in enumerate(student.model.layers):
        layer.self_attn.layer_idx = new
    student.config.num_hidden_layers = len(keep)
    if getattr(student.config, "layer_types", None):
        student.config.layer_types = [student.config.layer_types[i] for i in keep]
    n_params = sum(p.numel() for p in student.parameters())
    log(f"shrink: {n_layers} -> {len(keep)} layers (dropped {drop}), {n_params / 1e6:.2f}M params, config {asdict(cfg)}")
    loss_fn = distill_loss_fn(student, teacher)
    out = fit(args, cfg, student, loss_fn, train, 3, "shrink.pt")
    if out is None:
        return
    out.update(dropped_layers=drop, teacher=args.teacher, teacher_layers=n_layers)
    save_lm("target", student, held, out, cfg, n_params, args, stats_name="shrink")
