"""Command line entry point: ``python -m training <step> [options]``.

Steps (run in this order)::

    corpus     split the stdlib sources into train / held-out files (models/heldout_files.txt)
    tokenizer  train the byte-level BPE, check round-trip, cache token streams under runs/data
    corpus-extra  tokenize the installed packages' Python sources (decontaminated against the
               held-out files) into runs/data/extra_tokens.pt: the --corpus extended data
    target     pre-train models/target (LlamaForCausalLM) from scratch
    shrink     drop decoder layers of a pre-trained target and heal it by distillation from the
               full model (fits the 100 MB weight budget; --teacher, --drop-layers)
    target-continue  continue pre-training models/target (--corpus extended: with the installed
               packages' sources) into runs/target-continued; resumable
    compare-targets  held-out NLL and greedy completions of models/target and runs/target-continued
    drafter    distil models/drafter from the frozen target (KL(target || drafter))
    eagle      train models/eagle-head (EAGLE-1) on the frozen target's features
    eagle3     train models/eagle3-head (EAGLE-3, training-time test) on the frozen target's features
    medusa     train models/medusa-heads (Medusa-1 heads) on the frozen target's features
    mtp        train a native MTP module (DeepSeek-V3 layout) on the frozen target, stored with a
               copy of it (runs/target-mtp)
    draft-all  drafter + eagle + medusa in one loop on shared batches (one target forward per batch)
    draft-vocab  rank tokens by training-set frequency into each drafter's draft_vocab.json
    cards      write the README.md model cards from runs/*_stats.json and bench/results
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from . import data
from .config import DRAFTER_SPEC, TARGET_SPEC, LlamaSpec, TrainConfig
from .eagle3 import Eagle3Config, Eagle3Head, draft_vocabulary, eagle3_loss_fn, save_eagle3
from .heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, save_head
from .trainer import (
    TargetOutputs,
    distill_loss_fn,
    eagle_loss_fn,
    joint_loss_fn,
    lm_loss_fn,
    medusa_loss_fn,
    train_loop,
)

RUNS = Path("runs")
CKPTS = Path("checkpoints")
MODELS = Path("models")
DATA = RUNS / "data"
TOKENIZER_DIR = RUNS / "tokenizer"


def tokenizer_dir() -> Path:
    """The trained tokenizer (runs/tokenizer, written by the `tokenizer` step), else the shipped
    target's copy of it (a checkout that has not re-run that step)."""
    return TOKENIZER_DIR if (TOKENIZER_DIR / "tokenizer.json").exists() else MODELS / "target"


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    torch.set_num_interop_threads(1)


def step_corpus(args: argparse.Namespace) -> None:
    stats = data.write_corpus(DATA, MODELS / "heldout_files.txt")
    log(f"corpus: {stats} (root {data.stdlib_root()})")


def step_tokenizer(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    root = data.stdlib_root()
    train_files = data.read_file_list(DATA / "train_files.txt")
    held_files = data.read_file_list(DATA / "heldout_files.txt")
    train_texts = [data.read_text(root, f) for f in train_files]
    held_texts = [data.read_text(root, f) for f in held_files]
    t0 = time.time()
    tok = data.train_tokenizer(train_texts, vocab_size=args.vocab_size)
    data.save_tokenizer(tok, TOKENIZER_DIR)
    log(f"tokenizer: trained vocab {tok.get_vocab_size()} in {time.time() - t0:.1f}s -> {TOKENIZER_DIR}")
    hf = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    assert hf.bos_token_id == data.BOS_ID and hf.eos_token_id == data.EOS_ID
    bad = [
        f
        for f, t in zip(held_files, held_texts, strict=True)
        if hf.decode(hf(t)["input_ids"], skip_special_tokens=True) != t
    ]
    if bad:
        raise SystemExit(f"round-trip failed on {len(bad)} held-out files, e.g. {bad[:3]}")
    log(f"tokenizer: round-trip OK on all {len(held_files)} held-out files")
    train_stream = data.encode_documents(tok, train_texts)
    held_stream = data.encode_documents(tok, held_texts)
    torch.save(train_stream, DATA / "train_tokens.pt")
    torch.save(held_stream, DATA / "heldout_tokens.pt")
    n_bytes = sum(len(t.encode()) for t in train_texts)
    stats = {
        "vocab_size": tok.get_vocab_size(),
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "train_tokens": int(train_stream.numel()),
        "heldout_tokens": int(held_stream.numel()),
        "train_bytes": n_bytes,
        "bytes_per_token": n_bytes / train_stream.numel(),
    }
    (RUNS / "tokenizer_stats.json").write_text(json.dumps(stats, indent=2))
    log(f"tokenizer: {stats}")


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


def step_corpus_extra(args: argparse.Namespace) -> None:
    """Python sources of the installed packages, in a fixed shuffled order, up to --extra-tokens,
    without any file that copies held-out stdlib code (`data.Decontaminator`)."""
    import random

    from tokenizers import Tokenizer

    src = Path(args.init_from) if args.init_from else MODELS / "target"
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    root, std = data.packages_root(), data.stdlib_root()
    held = [data.read_text(std, f) for f in data.read_file_list(DATA / "heldout_files.txt")]
    clean = data.Decontaminator(held)
    files = data.list_package_files(root)
    random.Random(0).shuffle(files)
    kept, dropped, chunks, n_tokens = [], [], [], 0
    for i in range(0, len(files), 256):
        batch = [(f, data.read_text(root, f)) for f in files[i : i + 256]]
        copied = [clean.contaminated(t) for _, t in batch]
        good = [(f, t) for (f, t), bad in zip(batch, copied, strict=True) if not bad]
        dropped += [f for (f, _), bad in zip(batch, copied, strict=True) if bad]
        stream = data.encode_documents(tok, [t for _, t in good])
        kept += [f for f, _ in good]
        chunks.append(stream)
        n_tokens += stream.numel()
        if n_tokens >= args.extra_tokens:
            break
    torch.save(torch.cat(chunks), DATA / "extra_tokens.pt")
    (DATA / "extra_files.txt").write_text("\n".join(kept) + "\n")
    stats = {"root": str(root), "candidates": len(files), "files": len(kept), "tokens": n_tokens,
             "decontaminated": dropped}
    (RUNS / "corpus_extra_stats.json").write_text(json.dumps(stats, indent=2))
    log(f"corpus-extra: {len(kept)} files, {n_tokens} tokens, {len(dropped)} dropped as copies of held-out code: {dropped[:20]}")


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


def step_target(args: argparse.Namespace) -> None:
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


def step_target_continue(args: argparse.Namespace) -> None:
    """Continued pre-training of an already trained target (``--init-from``, default models/target).

    Same next-token loss and data as ``target`` but a new sampling order (seed + 5), written to
    ``--out`` (default runs/target-continued) rather than models/, so that the shipped family stays
    consistent until its drafters are retrained on the new weights. Resumable with ``--resume``;
    ``--max-minutes`` is the total budget over all resumptions (raise it to continue a finished run)."""
    from transformers import LlamaForCausalLM

    cfg = train_config(args, "target-continue")
    train, held = load_streams(cfg.seq_len, args.corpus)
    src = Path(args.init_from) if args.init_from else MODELS / "target"
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


def step_compare_targets(args: argparse.Namespace) -> None:
    """Held-out NLL (the same 64 x 512 tokens as every card) and greedy completions of a few prompts,
    for `--before` (default models/target) and `--init-from` (default runs/target-continued), as
    markdown for the card: transformers' `generate` on the prompt as tokenized, and our engine with
    token healing (the prompt's last token dropped, the first generated one constrained to start
    with its text: a prompt ending in a newline otherwise ends with a lone newline token)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from engine import LLM, SamplingParams

    _, held = load_streams(args.seq_len)
    folders = [Path(args.before or MODELS / "target"), Path(args.init_from or "runs/target-continued")]
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
    (RUNS / "compare_targets.md").write_text(text)
    print(text)


def step_mtp(args: argparse.Namespace) -> None:
    """A native MTP module (DeepSeek-V3 layout, training/mtp.py) trained post hoc on the frozen
    target (`--init-from`, default models/target), saved with a copy of it in `--out`
    (default runs/target-mtp): copy model.safetensors and config.json over the target's to ship."""
    from transformers import LlamaForCausalLM

    from training.mtp import MTPModule, mtp_loss_fn, save_mtp

    cfg = train_config(args, "mtp")
    train, _ = load_streams(cfg.seq_len, args.corpus)
    src = Path(args.init_from) if args.init_from else MODELS / "target"
    target = LlamaForCausalLM.from_pretrained(str(src), dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    target.eval().requires_grad_(False)
    torch.manual_seed(cfg.seed)
    module = MTPModule(target.config)
    if args.warm_start:  # an MTP stored with an earlier target (DeepSeek-V3 names)
        from safetensors.torch import load_file

        layer = json.loads((Path(args.warm_start) / "config.json").read_text())["num_hidden_layers"]
        module.load_published(load_file(str(Path(args.warm_start) / "model.safetensors")), layer)
        log(f"mtp: initialized from {args.warm_start}")
    n_params = sum(p.numel() for p in module.parameters())
    log(f"mtp: {n_params / 1e6:.2f}M params, unroll {args.ttt_steps}, target {src}, config {asdict(cfg)}")
    loss_fn = mtp_loss_fn(module, target, unroll=args.ttt_steps)
    out = fit(args, cfg, module, loss_fn, train, 6, "mtp.pt")
    if out is None:
        return
    folder = save_mtp(module.float(), src, Path(args.out))
    # the drafters' frequency-ranked draft vocabulary (`draft-vocab`), which the MTP proposer
    # reads from its target's folder: the module's LM head then costs a quarter at 2048 of 8192
    ranking = next((MODELS / n / "draft_vocab.json" for n in DRAFT_FOLDERS
                    if (MODELS / n / "draft_vocab.json").exists()), None)
    if ranking is not None:
        shutil.copy(ranking, folder / "draft_vocab.json")
    out.update(params=n_params, target=str(src), folder=str(folder), config=asdict(cfg))
    write_stats("mtp", out)


def step_shrink(args: argparse.Namespace) -> None:
    """models/target = the --teacher model without --drop-layers, healed by KL(teacher || student).

    Dropping every third layer of a deep target costs far less than training a shallower one
    for the same time (measured on the 16-layer target: held-out loss 4.39 -> 4.52 before
    healing, dropping layers 3, 6, 9, 12; dropping the last four: 5.12)."""
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


def step_drafter(args: argparse.Namespace) -> None:
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


def step_eagle(args: argparse.Namespace) -> None:
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
    folder = MODELS / "eagle-head"
    save_head(head, ecfg.to_json_dict(), folder)
    data.copy_tokenizer(tokenizer_dir(), folder)
    out.update(params=n_params, rollout_weight=args.rollout_weight, config=asdict(cfg))
    write_stats("eagle", out)


def step_medusa(args: argparse.Namespace) -> None:
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
    folder = MODELS / "medusa-heads"
    save_head(heads, mcfg.to_json_dict(), folder)
    data.copy_tokenizer(tokenizer_dir(), folder)
    out.update(params=n_params, config=asdict(cfg))
    write_stats("medusa", out)


def step_eagle3(args: argparse.Namespace) -> None:
    """Train models/eagle3-head on the frozen shipped target (`python -m training eagle3`)."""
    cfg = train_config(args, "eagle3")
    train, _ = load_streams(cfg.seq_len, args.corpus)
    target = load_target(dtype=args.dtype)
    t = target.config
    ranked = json.loads((MODELS / "drafter" / "draft_vocab.json").read_text())["ranked_token_ids"]
    token_ids = draft_vocabulary(ranked, args.draft_vocab_size)
    layers = t.num_hidden_layers
    c = Eagle3Config(
        hidden_size=t.hidden_size, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.hidden_size // t.num_attention_heads,
        intermediate_size=args.head_intermediate_size or t.intermediate_size, vocab_size=t.vocab_size,
        draft_vocab_size=token_ids.numel(),
        aux_layer_ids=tuple(int(i) for i in args.aux_layers.split(",")) if args.aux_layers else (2, layers // 2, layers - 3),
        rms_norm_eps=t.rms_norm_eps, rope_theta=float(t.rope_parameters["rope_theta"]),
        max_position_embeddings=t.max_position_embeddings,
    )
    torch.manual_seed(cfg.seed + 5)
    head = Eagle3Head(c)
    with torch.no_grad():  # start the head's LM head and norm at the target's (rows of the draft vocabulary)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[token_ids])
        head.norm.weight.copy_(target.model.norm.weight)
    if args.init_from:  # warm start: every tensor of an earlier head (e.g. trained on other aux layers)
        from safetensors.torch import load_file

        state = load_file(str(Path(args.init_from) / "model.safetensors"))
        head.load_state_dict({k: v.float() for k, v in state.items() if k not in ("d2t", "t2d")})
        log(f"eagle3: initialized from {args.init_from}")
    n_params = sum(p.numel() for p in head.parameters())
    log(f"eagle3: {n_params / 1e6:.2f}M params, ttt_steps {args.ttt_steps}, {c}, config {asdict(cfg)}")
    loss_fn = eagle3_loss_fn(head, target, token_ids, args.ttt_steps)
    out = fit(args, cfg, head, loss_fn, train, 5, "eagle3.pt")
    if out is None:
        return
    folder = MODELS / "eagle3-head"
    save_eagle3(head, token_ids, folder)  # no tokenizer copy: the head reads the target's token ids
    out.update(params=n_params, ttt_steps=args.ttt_steps, head=asdict(c), config=asdict(cfg))
    write_stats("eagle3", out)


DRAFT_PARTS = ("drafter", "eagle", "medusa")


def step_draft_all(args: argparse.Namespace) -> None:
    """Train the draft models named by ``--parts`` together; each batch's target forward is shared.

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
            drafter.to(torch.bfloat16).save_pretrained(str(MODELS / "drafter"))
            data.copy_tokenizer(tokenizer_dir(), MODELS / "drafter")
            stats.update(
                heldout_nll=nll, heldout_ppl=float(torch.tensor(nll).exp()), lr_scale=args.drafter_lr_scale
            )
        if name == "eagle":
            save_head(modules["eagle"], ecfg.to_json_dict(), MODELS / "eagle-head")
            data.copy_tokenizer(tokenizer_dir(), MODELS / "eagle-head")
            stats["rollout_weight"] = args.rollout_weight
        if name == "medusa":
            save_head(modules["medusa"], mcfg.to_json_dict(), MODELS / "medusa-heads")
            data.copy_tokenizer(tokenizer_dir(), MODELS / "medusa-heads")
            stats["position_stride"] = args.medusa_stride
        write_stats(name, stats)


DRAFT_FOLDERS = ("drafter", "eagle-head", "medusa-heads")


def step_draft_vocab(args: argparse.Namespace) -> None:
    """Frequency ranking of the vocabulary on the training split (FR-Spec draft vocabulary)."""
    train = torch.load(DATA / "train_tokens.pt").long()
    held = torch.load(DATA / "heldout_tokens.pt").long()
    counts = torch.bincount(train, minlength=args.vocab_size)
    ranked = torch.sort(counts, descending=True, stable=True).indices  # ties: lower id first
    held_counts = torch.bincount(held, minlength=args.vocab_size).double()
    coverage = {
        str(n): round(float(held_counts[ranked[:n]].sum() / held_counts.sum()), 4)
        for n in (512, 1024, 2048, 4096)
        if n < args.vocab_size
    }
    doc = {
        "description": "token ids ranked by frequency on the training split, most frequent first; "
        "the engine drafts over the first `default_size` (SpeculativeConfig.draft_vocab_size)",
        "source": f"{DATA / 'train_tokens.pt'} ({train.numel()} tokens)",
        "default_size": args.draft_vocab_size,
        "heldout_token_coverage": coverage,
        "ranked_token_ids": ranked.tolist(),
    }
    for name in DRAFT_FOLDERS:
        folder = MODELS / name
        if folder.is_dir():
            (folder / "draft_vocab.json").write_text(json.dumps(doc) + "\n")
            log(f"draft-vocab: wrote {folder / 'draft_vocab.json'} (default {args.draft_vocab_size}, held-out coverage {coverage})")


def strip_models_dir(argv: str) -> str:
    """A recorded command line without its `--models-dir X` (runs staged elsewhere before shipping)."""
    words = argv.split()
    if "--models-dir" in words:
        i = words.index("--models-dir")
        del words[i : i + 2]
    return " ".join(words)


def step_cards(args: argparse.Namespace) -> None:
    from .cards import update_cards, write_cards

    if not (RUNS / "target_stats.json").exists():  # the pre-training's stats live on another machine
        for path in update_cards(MODELS):
            log(f"cards: updated {path}")
        return

    def stats(name: str) -> dict:
        path = RUNS / f"{name}_stats.json"
        return json.loads(path.read_text()) if path.exists() else {}

    run = "nohup nice -n 19 python -m training {} > runs/{}.log 2>&1 &"
    lines: list[str] = []
    for n in DRAFT_PARTS:
        st = stats(n)
        log_name = "draft-" + "-".join(st.get("parts", DRAFT_PARTS)) if st.get("joint") else n
        line = run.format(strip_models_dir(st.get("argv", n)), log_name)
        if line not in lines:
            lines.append(line)
    downstream = "\n".join(lines)
    target_argv = strip_models_dir(stats("target").get("argv", "target"))
    shrink = stats("shrink")
    shrink_line = ""
    if shrink:
        # the full-depth target goes to runs/target-full first (the shrink step's --teacher default)
        words = [w for w in strip_models_dir(shrink.get("argv", "shrink")).split() if w]
        if "--teacher" in words:
            del words[words.index("--teacher") : words.index("--teacher") + 2]
        shrink_line = "mv models/target runs/target-full\npython -m training " + " ".join(words)
    args_ = {"downstream": downstream, "target": target_argv, "shrink": shrink_line}
    for path in write_cards(args_, MODELS):
        log(f"cards: wrote {path}")


STEP_DEFAULTS: dict[str, dict] = {
    "target": {"lr": 1e-3, "planned_tokens": 16_000_000, "max_minutes": 70.0, "warmup_steps": 100},
    "target-continue": {"lr": 4e-4, "planned_tokens": 4_000_000, "max_minutes": 150.0, "warmup_steps": 30},
    "mtp": {"lr": 1e-3, "planned_tokens": 1_200_000, "max_minutes": 60.0, "warmup_steps": 20},
    "shrink": {"lr": 3e-4, "planned_tokens": 1_000_000, "max_minutes": 10.0, "warmup_steps": 10},
    "drafter": {"lr": 2e-3, "planned_tokens": 4_000_000, "max_minutes": 15.0, "warmup_steps": 50},
    "eagle": {"lr": 1e-3, "planned_tokens": 4_000_000, "max_minutes": 15.0, "warmup_steps": 50},
    "medusa": {"lr": 1e-3, "planned_tokens": 4_000_000, "max_minutes": 10.0, "warmup_steps": 50},
    "eagle3": {"lr": 1e-3, "planned_tokens": 1_200_000, "max_minutes": 70.0, "warmup_steps": 20},
    "draft-all": {"lr": 1e-3, "planned_tokens": 2_000_000, "max_minutes": 25.0, "warmup_steps": 30},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__.split("\n")[0])
    parser.add_argument(
        "step",
        choices=[
            "corpus", "tokenizer", "corpus-extra", "target", "target-continue", "compare-targets", "mtp", "shrink", "drafter", "eagle", "medusa", "eagle3", "draft-all", "draft-vocab",
            "cards",
        ],
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="training dtype of every step (and of the frozen target): float32 where the CPU only emulates bf16 (no AMX / AVX512-BF16)")
    parser.add_argument("--ttt-steps", type=int, default=5,
                        help="eagle3: training-time-test unroll depth; mtp: recursive unroll steps")
    parser.add_argument("--aux-layers", default="",
                        help="eagle3: comma-separated layer boundaries feeding fc (default: 2, L/2, L-3)")
    parser.add_argument("--init-from", default=None,
                        help="eagle3: start from this head folder's weights; target-continue: the target to continue")
    parser.add_argument("--warm-start", default=None,
                        help="drafter / mtp: start from the weights in this folder (a drafter, or a target with its MTP layer); "
                        "draft-all: a models folder holding the parts")
    parser.add_argument("--before", default=None, help="compare-targets: the first model (default models/target)")
    parser.add_argument("--out", default=None,
                        help="target-continue / mtp: output folder (default runs/target-continued, runs/target-mtp)")
    parser.add_argument("--head-intermediate-size", type=int, default=None,
                        help="eagle3: the midlayer's MLP width (default: the target's)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--corpus", default="stdlib", choices=["stdlib", "extended"],
                        help="training data: the stdlib files, or those plus the installed packages' (corpus-extra)")
    parser.add_argument("--extra-tokens", type=int, default=12_000_000, help="corpus-extra: tokens to keep")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--warmup-steps", type=int, default=None)
    parser.add_argument("--planned-tokens", type=int, default=None)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--checkpoint-minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--measure-steps", type=int, default=0, help="only time this many steps, save nothing"
    )
    parser.add_argument("--eval-seqs", type=int, default=64)
    parser.add_argument(
        "--rollout-weight", type=float, default=0.5, help="eagle: weight of the 2nd-step loss"
    )
    parser.add_argument("--num-heads", type=int, default=8, help="medusa: number of heads")
    parser.add_argument(
        "--drafter-lr-scale", type=float, default=2.0, help="draft-all: drafter lr multiplier"
    )
    parser.add_argument("--parts", default="drafter,eagle,medusa", help="draft-all: comma-separated models")
    parser.add_argument(
        "--medusa-stride", type=int, default=4, help="draft-all: Medusa loss on every n-th position"
    )
    parser.add_argument("--teacher", default="runs/target-full", help="shrink: the pre-trained full-depth target")
    parser.add_argument("--drop-layers", default="3,6,9,12", help="shrink: decoder layers to remove")
    parser.add_argument("--draft-vocab-size", type=int, default=2048, help="draft-vocab: default size")
    parser.add_argument("--models-dir", default=None, help="output/input models folder (default models/)")
    args = parser.parse_args(argv)
    if args.models_dir:
        global MODELS
        MODELS = Path(args.models_dir)
    if args.out is None:
        args.out = {"mtp": "runs/target-mtp"}.get(args.step, "runs/target-continued")
    for key, value in STEP_DEFAULTS.get(args.step, {}).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    set_threads(args.threads)
    log(f"python -m training {' '.join(argv if argv is not None else sys.argv[1:])}")
    {
        "corpus": step_corpus,
        "tokenizer": step_tokenizer,
        "corpus-extra": step_corpus_extra,
        "target": step_target,
        "target-continue": step_target_continue,
        "compare-targets": step_compare_targets,
        "mtp": step_mtp,
        "shrink": step_shrink,
        "drafter": step_drafter,
        "eagle": step_eagle,
        "medusa": step_medusa,
        "eagle3": step_eagle3,
        "draft-all": step_draft_all,
        "draft-vocab": step_draft_vocab,
        "cards": step_cards,
    }[args.step](args)


if __name__ == "__main__":
    main()
