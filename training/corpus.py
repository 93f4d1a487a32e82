"""The data pipelines: the stdlib train / held-out split, the tokenizer and its token streams, the
installed packages' sources as extra training data, and the draft vocabularies ranked on them.

Each writes under runs/data (and models/ for the held-out list and the draft vocabularies); the
training pipelines only read those files.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from . import data, pipeline
from .pipeline import log


def split_corpus(args: argparse.Namespace) -> None:
    """`corpus`: split the stdlib sources into train / held-out files (models/heldout_files.txt)."""
    stats = data.write_corpus(pipeline.DATA, pipeline.MODELS / "heldout_files.txt")
    log(f"corpus: {stats} (root {data.stdlib_root()})")


def build_tokenizer(args: argparse.Namespace) -> None:
    """`tokenizer`: train the byte-level BPE, check its round trip on every held-out file, and
    cache the train / held-out token streams under runs/data."""
    from transformers import AutoTokenizer

    data_dir, tokenizer_dir = pipeline.DATA, pipeline.TOKENIZER_DIR
    root = data.stdlib_root()
    train_files = data.read_file_list(data_dir / "train_files.txt")
    held_files = data.read_file_list(data_dir / "heldout_files.txt")
    train_texts = [data.read_text(root, f) for f in train_files]
    held_texts = [data.read_text(root, f) for f in held_files]
    t0 = time.time()
    tok = data.train_tokenizer(train_texts, vocab_size=args.vocab_size)
    data.save_tokenizer(tok, tokenizer_dir)
    log(f"tokenizer: trained vocab {tok.get_vocab_size()} in {time.time() - t0:.1f}s -> {tokenizer_dir}")
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
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
    torch.save(train_stream, data_dir / "train_tokens.pt")
    torch.save(held_stream, data_dir / "heldout_tokens.pt")
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
    (pipeline.RUNS / "tokenizer_stats.json").write_text(json.dumps(stats, indent=2))
    log(f"tokenizer: {stats}")


def tokenize_packages(args: argparse.Namespace) -> None:
    """`corpus-extra`: Python sources of the installed packages, in a fixed shuffled order, up to
    --extra-tokens, without any file that copies held-out stdlib code (`data.Decontaminator`),
    into runs/data/extra_tokens.pt (the data of `--corpus extended`)."""
    from tokenizers import Tokenizer

    data_dir = pipeline.DATA
    src = Path(args.init_from) if args.init_from else pipeline.MODELS / "target"
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    root, std = data.packages_root(), data.stdlib_root()
    held = [data.read_text(std, f) for f in data.read_file_list(data_dir / "heldout_files.txt")]
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
    torch.save(torch.cat(chunks), data_dir / "extra_tokens.pt")
    (data_dir / "extra_files.txt").write_text("\n".join(kept) + "\n")
    stats = {"root": str(root), "candidates": len(files), "files": len(kept), "tokens": n_tokens,
             "decontaminated": dropped}
    (pipeline.RUNS / "corpus_extra_stats.json").write_text(json.dumps(stats, indent=2))
    log(f"corpus-extra: {len(kept)} files, {n_tokens} tokens, {len(dropped)} dropped as copies of held-out code: {dropped[:20]}")


def rank_draft_vocab(args: argparse.Namespace) -> None:
    """`draft-vocab`: frequency ranking of the vocabulary on the training split (FR-Spec draft
    vocabulary), written as draft_vocab.json into every drafter folder present."""
    train = torch.load(pipeline.DATA / "train_tokens.pt").long()
    held = torch.load(pipeline.DATA / "heldout_tokens.pt").long()
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
        "source": f"{pipeline.DATA / 'train_tokens.pt'} ({train.numel()} tokens)",
        "default_size": args.draft_vocab_size,
        "heldout_token_coverage": coverage,
        "ranked_token_ids": ranked.tolist(),
    }
    for name in pipeline.DRAFT_FOLDERS:
        folder = pipeline.MODELS / name
        if folder.is_dir():
            (folder / "draft_vocab.json").write_text(json.dumps(doc) + "\n")
            log(f"draft-vocab: wrote {folder / 'draft_vocab.json'} (default {args.draft_vocab_size}, held-out coverage {coverage})")
