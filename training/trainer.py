"""Generic time-budgeted training loop with resumable checkpoints, plus the four losses.

The learning rate is linear warm-up followed by cosine decay to ``min_lr_ratio * lr``.  Progress
through the decay is keyed on the planned token count; with ``time_aware_lr`` it is
``max(tokens / planned_tokens, elapsed / max_minutes)`` so the schedule also finishes when the wall
time budget runs out on a busy machine (the only non-deterministic element of a run).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from .config import TrainConfig
from .data import SequenceSampler
from .heads import EagleHead, MedusaHeads

LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def lr_at(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    denom = max(1, cfg.planned_steps - cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / denom
    if cfg.time_aware_lr and cfg.max_minutes > 0:
        progress = max(progress, elapsed_s / (cfg.max_minutes * 60.0))
    progress = min(1.0, progress)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(
    path: Path, masters: dict[str, torch.Tensor], opt: torch.optim.Optimizer, state: dict
) -> None:
    """Atomically write fp32 master weights, optimizer, RNG and progress state to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "master": {n: m.detach() for n, m in masters.items()},
            "optim": opt.state_dict(),
            "rng": torch.get_rng_state(),
            **state,
        },
        tmp,
    )
    os.replace(tmp, path)


def train_loop(
    cfg: TrainConfig,
    model: nn.Module,
    loss_fn: LossFn,
    sampler: SequenceSampler,
    ckpt_path: Path | None,
    resume: bool = False,
    log: Callable[[str], None] = print,
    progress: bool = True,
    max_threads: int | None = None,
    stop_after: int | None = None,
    components: dict[str, float] | None = None,
) -> dict:
    """Train ``model`` (its parameters with ``requires_grad``) until planned steps or time run out.

    With ``max_threads > 1`` the intra-op thread count adapts to a shared, busy machine: every tenth
    step tries the other choice of 1 or ``max_threads`` threads, the others use whichever was faster
    last time (a reniced process whose second thread lands on a busy core stalls every barrier).

    ``components`` maps parameter-name prefixes (e.g. ``"drafter."``) to learning-rate multipliers;
    each component then gets its own parameter groups and its own gradient clipping, so several
    independent models can be trained on shared batches in one loop.

    ``stop_after`` ends the run (with a checkpoint) after that many steps without changing the
    schedule, e.g. to test resumption.

    Returns a summary dict (steps, tokens, elapsed seconds, final/first losses).
    """
    # The model runs in cfg.dtype (pure bf16 is fast on AMX CPUs); fp32 master copies are what
    # AdamW updates.
    model.to(getattr(torch, cfg.dtype))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in named}
    comps = components or {"": 1.0}
    comp_params = {c: [m for n, m in masters.items() if n.startswith(c)] for c in comps}
    assert sum(len(v) for v in comp_params.values()) == len(masters), (
        "components must partition the parameters"
    )
    groups = []
    for c, scale in comps.items():
        for decay in (True, False):
            ps = [m for m in comp_params[c] if (m.ndim >= 2) == decay]
            if ps:
                groups.append(
                    {"params": ps, "weight_decay": cfg.weight_decay if decay else 0.0, "lr_scale": scale}
                )
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)
    step, tokens, elapsed = 0, 0, 0.0
    history: list[float] = []
    if resume and ckpt_path is not None and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        with torch.no_grad():
            for n, p in named:
                masters[n].copy_(ck["master"][n])
                p.copy_(masters[n])
        opt.load_state_dict(ck["optim"])
        torch.set_rng_state(ck["rng"])
        sampler.load_state_dict(ck["sampler"])
        step, tokens, elapsed = ck["step"], ck["tokens"], ck["elapsed_s"]
        history = ck.get("history", [])
        log(f"[{cfg.name}] resumed from {ckpt_path} at step {step} ({tokens} tokens, {elapsed / 60:.1f} min)")

    def state() -> dict:
        return {
            "step": step,
            "tokens": tokens,
            "elapsed_s": elapsed,
            "sampler": sampler.state_dict(),
            "history": history,
            "config": asdict(cfg),
        }

    model.train()
    budget_s = cfg.max_minutes * 60.0
    start = time.monotonic() - elapsed
    last_ckpt = time.monotonic()
    bar = tqdm(total=cfg.planned_steps, initial=step, desc=cfg.name, disable=not progress, mininterval=10)
    ema = None
    first_metrics: dict[str, float] = {}
    metrics_ema: dict[str, float] = {}
    thread_choices = [1, max_threads] if max_threads and max_threads > 1 else []
    step_time = dict.fromkeys(thread_choices, 0.0)
    last_step = min(cfg.planned_steps, stop_after or cfg.planned_steps)
    while step < last_step and elapsed < budget_s:
        n_threads = 0
        if thread_choices:
            best = min(thread_choices, key=lambda n: step_time[n])
            n_threads = best if step % 10 else [n for n in thread_choices if n != best][0]
            torch.set_num_threads(n_threads)
        t_step = time.monotonic()
        lr = lr_at(cfg, step, elapsed)
        for group in opt.param_groups:
            group["lr"] = lr * group["lr_scale"]
        metrics: dict[str, float] = {}
        for _ in range(cfg.grad_accum):
            batch = sampler.next_batch()
            loss, metrics = loss_fn(batch)
            (loss / cfg.grad_accum).backward()
        for n, p in named:
            masters[n].grad = p.grad.float() if p.grad is not None else torch.zeros_like(masters[n])
            p.grad = None
        gnorm = max(float(torch.nn.utils.clip_grad_norm_(ps, cfg.grad_clip)) for ps in comp_params.values())
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in named:
                p.copy_(masters[n])
        step += 1
        tokens += cfg.tokens_per_step
        elapsed = time.monotonic() - start
        if n_threads:
            step_time[n_threads] = time.monotonic() - t_step
        lv = float(loss.detach())
        history.append(lv)
        first_metrics = first_metrics or dict(metrics)
        metrics_ema = {
            k: v if k not in metrics_ema else 0.98 * metrics_ema[k] + 0.02 * v for k, v in metrics.items()
        }
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens / max(elapsed, 1e-6):.0f}")
        if step % 50 == 0 or step == 1:
            extra = " ".join(f"{k}={v:.3f}" for k, v in metrics.items())
            log(
                f"[{cfg.name}] step {step}/{cfg.planned_steps} loss {lv:.4f} ema {ema:.4f} lr {lr:.2e} "
                f"gnorm {gnorm:.2f} tok/s {tokens / max(elapsed, 1e-6):.0f} "
                f"elapsed {elapsed / 60:.1f}m threads {n_threads} {extra}"
            )
        if ckpt_path is not None and time.monotonic() - last_ckpt > cfg.checkpoint_minutes * 60:
            save_checkpoint(ckpt_path, masters, opt, state())
            last_ckpt = time.monotonic()
    bar.close()
    if ckpt_path is not None:
        save_checkpoint(ckpt_path, masters, opt, state())
    return {
        "steps": step,
        "tokens": tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / max(elapsed, 1e-6),
        "first_loss": history[0] if history else float("nan"),
        "final_loss_ema": ema if ema is not None else float("nan"),
        "first_metrics": first_metrics,
        "final_metrics_ema": metrics_ema,
        "history": history,
    }


# ----------------------------------------------------------------------------------------------
# Losses.  Each takes a ``[B, T]`` long batch and returns ``(loss, metrics)``.


def lm_loss_fn(model: nn.Module) -> LossFn:
    """Next-token cross-entropy of a causal LM."""

    def fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        logits = model(input_ids=batch).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())
        return loss, {}

    return fn


class TargetOutputs:
    """Frozen-target outputs for a batch, computed once and shared by several losses."""

    def __init__(self, target: nn.Module) -> None:
        self.target = target
        self._batch: torch.Tensor | None = None
        self._hidden: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None

    @torch.no_grad()
    def hidden(self, batch: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states (``last_hidden_state``) ``[B, T, H]``."""
        if self._batch is not batch:
            self._hidden = self.target.model(input_ids=batch).last_hidden_state
            self._logits = None
            self._batch = batch
        return self._hidden

    @torch.no_grad()
    def log_probs(self, batch: torch.Tensor) -> torch.Tensor:
        """fp32 log-softmax of the target's logits ``[B, T, V]``."""
        h = self.hidden(batch)
        if self._logits is None:
            self._logits = F.log_softmax(self.target.lm_head(h).float(), dim=-1)
        return self._logits


def _outputs(target: nn.Module | TargetOutputs) -> TargetOutputs:
    return target if isinstance(target, TargetOutputs) else TargetOutputs(target)


def distill_loss_fn(student: nn.Module, teacher: nn.Module | TargetOutputs) -> LossFn:
    """Token-level ``KL(teacher || student)`` on the frozen teacher's logits."""
    outputs = _outputs(teacher)

    def fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        with torch.no_grad():
            t_logp = outputs.log_probs(batch).flatten(0, 1)
        s_logp = F.log_softmax(student(input_ids=batch).logits.float(), dim=-1).flatten(0, 1)
        loss = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")
        with torch.no_grad():
            agree = (s_logp.argmax(-1) == t_logp.argmax(-1)).float().mean()
        return loss, {"agree": float(agree)}

    return fn


def eagle_loss_fn(
    head: EagleHead, target: nn.Module | TargetOutputs, cls_weight: float = 0.1, rollout_weight: float = 0.0
) -> LossFn:
    """EAGLE-1 loss: ``SmoothL1(f, h_{t+1}) + cls_weight * CE(lm_head(f), token_{t+2})``.

    Teacher-forced: the element at index ``t`` gets ``(embed(token_{t+1}), h_t)`` at RoPE position
    ``t+1``.  With ``rollout_weight > 0`` a second pass feeds the head's own (detached) predicted
    features back in place of the true ones (shifted by one), adding the same loss for the
    two-steps-ahead predictions, which reduces exposure bias.
    """
    outputs = _outputs(target)
    embed = outputs.target.get_input_embeddings()
    lm_head = outputs.target.get_output_embeddings()

    def step_loss(f: torch.Tensor, h_next: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
        reg = F.smooth_l1_loss(f.float(), h_next.float())
        n = labels.shape[1]
        logits = lm_head(f[:, :n]).float()
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        acc = (logits.argmax(-1) == labels).float().mean()
        return reg + cls_weight * ce, {
            "reg": float(reg.detach()),
            "ce": float(ce.detach()),
            "acc": float(acc),
        }

    def fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        bsz, seq = batch.shape
        h = outputs.hidden(batch)
        with torch.no_grad():
            emb = embed(batch)
        pos = torch.arange(1, seq, device=batch.device).unsqueeze(0).expand(bsz, -1)
        f = head(emb[:, 1:], h[:, :-1], pos)  # index t -> f_{t+1}
        loss, metrics = step_loss(f, h[:, 1:], batch[:, 2:])
        if rollout_weight > 0:
            # index t: (embed(token_{t+2}), f_{t+1} predicted) at position t+2 -> f_{t+2}
            f2 = head(emb[:, 2:], f[:, :-1].detach(), pos[:, 1:])
            loss2, m2 = step_loss(f2, h[:, 2:], batch[:, 3:])
            loss = loss + rollout_weight * loss2
            metrics.update({f"{k}2": v for k, v in m2.items()})
        return loss, metrics

    return fn


def medusa_loss_fn(
    heads: MedusaHeads, target: nn.Module | TargetOutputs, decay: float = 0.8, stride: int = 1
) -> LossFn:
    """Sum over heads of ``decay**i * CE(lm_head(head_i(h_t)), token_{t+i+2})``.

    With ``stride > 1`` only every ``stride``-th position (random offset per batch) is used: the
    heads are tiny, and the full-vocabulary projections dominate the cost.
    """
    outputs = _outputs(target)
    lm_head = outputs.target.get_output_embeddings()

    def fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        h = outputs.hidden(batch)
        seq = batch.shape[1]
        total = torch.zeros((), dtype=torch.float32)
        metrics: dict[str, float] = {}
        if stride > 1:
            offset = int(torch.randint(stride, ()))
            idx = torch.arange(offset, seq - heads.config.num_heads - 1, stride)
        else:
            idx = torch.arange(seq)
        for i, feat in enumerate(heads(h[:, idx])):
            shift = i + 2
            keep = idx + shift < seq
            labels = batch[:, idx[keep] + shift]
            logits = lm_head(feat[:, keep]).float()
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            total = total + (decay**i) * ce
            if i in (0, 1, heads.config.num_heads - 1):
                metrics[f"acc{i}"] = float((logits.detach().argmax(-1) == labels).float().mean())
        return total, metrics

    return fn


def joint_loss_fn(parts: dict[str, LossFn]) -> LossFn:
    """Sum of independent losses (one per component) on the same batch; metrics are prefixed."""

    def fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        total = torch.zeros((), dtype=torch.float32)
        metrics: dict[str, float] = {}
        for name, part in parts.items():
            loss, m = part(batch)
            total = total + loss
            metrics[f"{name}_loss"] = float(loss.detach())
            metrics.update({f"{name}_{k}": v for k, v in m.items()})
        return total, metrics

    return fn
