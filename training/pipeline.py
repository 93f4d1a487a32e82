"""What every training pipeline shares: its folders, its log, the token streams, `fit` and the
stats file.

A pipeline reads its folders from this module at call time (``pipeline.MODELS``), so that
``--models-dir`` (set once by ``python -m training``) stages a whole run in another folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from . import data
from .config import LlamaSpec, TrainConfig
from .trainer import train_loop

RUNS = Path("runs")
CKPTS = Path("checkpoints")
MODELS = Path("models")
DATA = RUNS / "data"
TOKENIZER_DIR = RUNS / "tokenizer"
# the drafter folders that carry a draft_vocab.json (`python -m training draft-vocab`)
DRAFT_FOLDERS = ("drafter", "eagle-head", "medusa-heads")


def tokenizer_dir() -> Path:
    """The trained tokenizer (runs/tokenizer, written by the `tokenizer` pipeline), else the
    shipped target's copy of it (a checkout that has not re-run that pipeline)."""
    return TOKENIZER_DIR if (TOKENIZER_DIR / "tokenizer.json").exists() else MODELS / "target"


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    if torch.get_num_interop_threads() != 1:  # settable once per process, before parallel work
        torch.set_num_interop_threads(1)


def load_streams(seq_len: int, corpus: str = "stdlib") -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out sequences. ``corpus="extended"`` adds the installed packages' sources
    (``corpus-extra``) to the stdlib training files; the held-out set is the same either way."""
    train = data.chunk_stream(torch.load(DATA / "train_tokens.pt"), seq_len)
    if corpus == "extended":
        if not (DATA / "extra_tokens.pt").exists():
            raise SystemExit("--corpus extended needs runs/data/extra_tokens.pt: run `python -m training corpus-extra`")
        train = torch.cat([train, data.chunk_stream(torch.load(DATA / "extra_tokens.pt"), seq_len)])
    held = data.chunk_stream(torch.load(DATA / "heldout_tokens.pt"), seq_len)
    return train, held


def build_llama(spec: LlamaSpec, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = spec.to_hf()
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def load_target(folder: Path | None = None, dtype: str = "bfloat16"):
    """The frozen target (models/target) in `dtype` (--dtype: float32 where the CPU only emulates bf16)."""
    from transformers import LlamaForCausalLM

    folder = folder or MODELS / "target"
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def heldout_nll(model_fn, held: torch.Tensor, batch_size: int = 8, max_seqs: int = 64) -> float:
    """Mean next-token NLL (nats) over up to ``max_seqs`` held-out sequences."""
    from torch.nn import functional as F

    total, count = 0.0, 0
    seqs = held[:max_seqs]
    for i in range(0, seqs.shape[0], batch_size):
        b = seqs[i : i + batch_size]
        logits = model_fn(b)
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), b[:, 1:].flatten(), reduction="sum")
        total += float(nll)
        count += b[:, 1:].numel()
    return total / count


def train_config(args: argparse.Namespace, name: str) -> TrainConfig:
    return TrainConfig(
        name=name,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        planned_tokens=args.planned_tokens,
        max_minutes=args.max_minutes,
        checkpoint_minutes=args.checkpoint_minutes,
        seed=args.seed,
        dtype=args.dtype,
    )


def write_stats(name: str, stats: dict) -> None:
    RUNS.mkdir(exist_ok=True)
    stats = {k: v for k, v in stats.items() if k != "history"}
    stats["argv"] = " ".join(sys.argv[1:])
    (RUNS / f"{name}_stats.json").write_text(json.dumps(stats, indent=2))
    log(f"{name}: {stats}")


def fit(args: argparse.Namespace, cfg: TrainConfig, model, loss_fn, train: torch.Tensor, seed_offset: int,
        checkpoint: str, **train_kw) -> dict | None:
    """Train ``model`` on batches of ``train`` drawn in the order of seed ``cfg.seed + seed_offset``
    (resumable from checkpoints/<checkpoint>); with ``--measure-steps`` only time that many steps
    (the first included: allocation warm-up) and return None."""
    sampler = data.SequenceSampler(train, cfg.batch_size, cfg.seed + seed_offset)
    if args.measure_steps:
        steps = args.measure_steps
        tcfg = replace(cfg, planned_tokens=cfg.tokens_per_step * steps, warmup_steps=1, max_minutes=60)
        out = train_loop(tcfg, model, loss_fn, sampler, None, log=log, progress=False, **train_kw)
        log(f"measure: {steps} steps, {out['tokens_per_s']:.0f} tok/s, {out['elapsed_s'] / steps:.2f} s/step")
        return None
    return train_loop(cfg, model, loss_fn, sampler, CKPTS / checkpoint, resume=args.resume, log=log,
                      max_threads=args.threads, **train_kw)


def save_lm(
    name: str,
    model,
    held,
    out: dict,
    cfg,
    n_params: int,
    args: argparse.Namespace,
    stats_name: str | None = None,
    folder: Path | None = None,
    tokenizer_from: Path | None = None,
) -> None:
    """Held-out NLL, then the bf16 checkpoint + tokenizer (from ``tokenizer_from``, default the
    trained tokenizer in runs/) in ``folder`` (default models/<name>/) and runs/<name>_stats.json."""
    model.eval()
    nll = heldout_nll(lambda b: model(input_ids=b).logits, held, max_seqs=args.eval_seqs)
    folder = folder or MODELS / name
    model.to(torch.bfloat16).save_pretrained(str(folder))
    data.copy_tokenizer(tokenizer_from or tokenizer_dir(), folder)
    out.update(
        params=n_params, heldout_nll=nll, heldout_ppl=float(torch.tensor(nll).exp()), config=asdict(cfg)
    )
    write_stats(stats_name or name, out)
