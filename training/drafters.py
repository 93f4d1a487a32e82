"""The pipelines of the draft models trained on the frozen target's outputs: the distilled
drafter, the EAGLE-1 head, the Medusa heads, and any of them together on shared batches.

The EAGLE-3 head and the MTP module have their own pipelines next to their models
(training/eagle3.py, training/mtp.py).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

import torch

from . import data, pipeline
from .config import DRAFTER_SPEC
from .heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, save_head
from .pipeline import (
    build_llama,
    fit,
    heldout_nll,
    load_streams,
    load_target,
    log,
    save_lm,
    tokenizer_dir,
    train_config,
    write_stats,
)
from .trainer import TargetOutputs, distill_loss_fn, eagle_loss_fn, joint_loss_fn, medusa_loss_fn

DRAFT_PARTS = ("drafter", "eagle", "medusa")


def train_drafter(args: argparse.Namespace) -> None:
    """`drafter`: distil models/drafter from the frozen target (KL(target || drafter))."""
    cfg = train_config(args, "drafter")
    train, held = load_streams(cfg.seq_len, args.corpus)
    target = load_target(dtype=args.dtype)
    model = build_llama(DRAFTER_SPEC, cfg.seed)
    if args.warm_start:  # a drafter distilled from an earlier target
        from safetensors.torch import load_file

        state = load_file(str(Path(args.warm_start) / "model.safetensors"))
        result = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:  # tied: no lm_head
            raise SystemExit(f"--warm-start {args.warm_start}: not a drafter checkpoint ({result})")
        log(f"drafter: initialized from {args.warm_start}")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"drafter: {n_params / 1e6:.2f}M params, config {asdict(cfg)}")
    loss_fn = distill_loss_fn(model, target)
    out = fit(args, cfg, model, loss_fn, train, 1, "drafter.pt")
    if out is None:
        return
    save_lm("drafter", model, held, out, cfg, n_params, args)


def eagle_config_from_target(target) -> EagleConfig:
    c = target.config
    return EagleConfig(
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=float(c.rope_parameters["rope_theta"]),
        max_position_embeddings=c.max_position_embeddings,
        vocab_size=c.vocab_size,
    )


def train_eagle(args: argparse.Namespace) -> None:
    """`eagle`: train models/eagle-head (EAGLE-1) on the frozen target's features."""
    cfg = train_config(args, "eagle")
    train, _ = load_streams(cfg.seq_len, args.corpus)
    target = load_target(dtype=args.dtype)
    torch.manual_seed(cfg.seed)
    ecfg = eagle_config_from_target(target)
    head = EagleHead(ecfg)
    n_params = sum(p.numel() for p in head.parameters())
    log(f"eagle: {n_params / 1e6:.2f}M params, rollout_weight {args.rollout_weight}, config {asdict(cfg)}")
    loss_fn = eagle_loss_fn(head, target, rollout_weight=args.rollout_weight)
    out = fit(args, cfg, head, loss_fn, train, 2, "eagle.pt")
    if out is None:
        return
    folder = pipeline.MODELS / "eagle-head"
    save_head(head, ecfg.to_json_dict(), folder)
    data.copy_tokenizer(tokenizer_dir(), folder)
    out.update(params=n_params, rollout_weight=args.rollout_weight, config=asdict(cfg))
    write_stats("eagle", out)


def train_medusa(args: argparse.Namespace) -> None:
    """`medusa`: train models/medusa-heads (Medusa-1 heads) on the frozen target's features."""
    cfg = train_config(args, "medusa")
    train, _ = load_streams(cfg.seq_len, args.corpus)
    target = load_target(dtype=args.dtype)
    torch.manual_seed(cfg.seed)
    mcfg = MedusaConfig(
        num_heads=args.num_heads, hidden_size=target.config.hidden_size, vocab_size=target.config.vocab_size
    )
    heads = MedusaHeads(mcfg)
    n_params = sum(p.numel() for p in heads.parameters())
    log(f"medusa: {n_params / 1e6:.2f}M params, config {asdict(cfg)}")
    loss_fn = medusa_loss_fn(heads, target)
    out = fit(args, cfg, heads, loss_fn, train, 3, "medusa.pt")
    if out is None:
        return
    folder = pipeline.MODELS / "medusa-heads"
    save_head(heads, mcfg.to_json_dict(), folder)
    data.copy_tokenizer(tokenizer_dir(), folder)
    out.update(params=n_params, config=asdict(cfg))
    write_stats("medusa", out)


def train_draft_all(args: argparse.Namespace) -> None:
    """`draft-all`: train the draft models named by ``--parts`` together; each batch's target
    forward is shared.

    The models are independent (separate parameters, per-component gradient clipping, learning-rate
    multiplier ``--drafter-lr-scale`` for the drafter); the summed loss only shares the frozen
    target's forward pass.  ``--parts drafter`` alone is plain distillation.
    """
    parts = [p for p in DRAFT_PARTS if p in args.parts.split(",")]
    tag = "draft-" + "-".join(parts)
    cfg = train_config(args, tag)
    train, held = load_streams(cfg.seq_len, args.corpus)
    target = load_target(dtype=args.dtype)
    outputs = TargetOutputs(target)
    modules: dict[str, torch.nn.Module] = {}
    losses = {}
    if "drafter" in parts:
        modules["drafter"] = build_llama(DRAFTER_SPEC, cfg.seed)
        losses["drafter"] = distill_loss_fn(modules["drafter"], outputs)
    if "eagle" in parts:
        torch.manual_seed(cfg.seed + 2)
        ecfg = eagle_config_from_target(target)
        modules["eagle"] = EagleHead(ecfg)
        losses["eagle"] = eagle_loss_fn(modules["eagle"], outputs, rollout_weight=args.rollout_weight)
    if "medusa" in parts:
        torch.manual_seed(cfg.seed + 3)
        mcfg = MedusaConfig(
            num_heads=args.num_heads,
            hidden_size=target.config.hidden_size,
            vocab_size=target.config.vocab_size,
        )
        modules["medusa"] = MedusaHeads(mcfg)
        losses["medusa"] = medusa_loss_fn(modules["medusa"], outputs, stride=args.medusa_stride)
    if args.warm_start:  # a models folder holding these parts trained for an earlier target
        from safetensors.torch import load_file

        for name, module in modules.items():
            path = Path(args.warm_start) / {"drafter": "drafter", "eagle": "eagle-head", "medusa": "medusa-heads"}[name]
            state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
            result = module.load_state_dict(state, strict=name != "drafter")
            if name == "drafter" and (result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}):
                raise SystemExit(f"--warm-start {path}: not a drafter checkpoint ({result})")
            log(f"{tag}: {name} initialized from {path}")
    joint = torch.nn.ModuleDict(modules)
    loss_fn = joint_loss_fn(losses)
    sizes = {n: sum(p.numel() for p in m.parameters()) for n, m in modules.items()}
    log(f"{tag}: params {sizes}, config {asdict(cfg)}")
    comps = {f"{n}.": (args.drafter_lr_scale if n == "drafter" else 1.0) for n in parts}
    out = fit(args, cfg, joint, loss_fn, train, 1, f"{tag}.pt", components=comps)
    if out is None:
        return
    shared = {k: v for k, v in out.items() if k not in ("first_metrics", "final_metrics_ema", "history")}
    for name in parts:
        stats = dict(shared, params=sizes[name], config=asdict(cfg), joint=True, parts=parts)
        stats["first_loss"] = out["first_metrics"].get(f"{name}_loss", float("nan"))
        stats["final_loss_ema"] = out["final_metrics_ema"].get(f"{name}_loss", float("nan"))
        stats["metrics_ema"] = {k: v for k, v in out["final_metrics_ema"].items() if k.startswith(name)}
        if name == "drafter":
            drafter = modules["drafter"].eval()
            nll = heldout_nll(lambda b, m=drafter: m(input_ids=b).logits, held, max_seqs=args.eval_seqs)
            drafter.to(torch.bfloat16).save_pretrained(str(pipeline.MODELS / "drafter"))
            data.copy_tokenizer(tokenizer_dir(), pipeline.MODELS / "drafter")
            stats.update(
                heldout_nll=nll, heldout_ppl=float(torch.tensor(nll).exp()), lr_scale=args.drafter_lr_scale
            )
        if name == "eagle":
            save_head(modules["eagle"], ecfg.to_json_dict(), pipeline.MODELS / "eagle-head")
            data.copy_tokenizer(tokenizer_dir(), pipeline.MODELS / "eagle-head")
            stats["rollout_weight"] = args.rollout_weight
        if name == "medusa":
            save_head(modules["medusa"], mcfg.to_json_dict(), pipeline.MODELS / "medusa-heads")
            data.copy_tokenizer(tokenizer_dir(), pipeline.MODELS / "medusa-heads")
            stats["position_stride"] = args.medusa_stride
        write_stats(name, stats)

