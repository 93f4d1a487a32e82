"""Corpus, tokenizer and token-stream utilities.

The corpus is the Python standard library of the running interpreter (``*.py`` files only,
without test suites and ``site-packages``).  Files are split deterministically into a train
and a held-out set (sorted relative paths, ``random.Random(0)`` shuffle, ~5 % held out).

The tokenizer is a byte-level BPE (no normalizer, ByteLevel pre-tokenizer/decoder) with two
special tokens: ``<|bos|>`` (id 0) and ``<|endoftext|>`` (id 1, also used as EOS and PAD).
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
BOS_ID = 0
EOS_ID = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths (posix) of all corpus ``*.py`` files under ``root``."""
    root = root or stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if path.is_file():
            out.append(rel.as_posix())
    return sorted(out)


def split_files(
    files: Sequence[str], heldout_frac: float = 0.05, seed: int = 0
) -> tuple[list[str], list[str]]:
    """Deterministic file-level train / held-out split; both lists returned sorted."""
    shuffled = sorted(files)
    random.Random(seed).shuffle(shuffled)
    n_held = max(1, round(len(shuffled) * heldout_frac))
    return sorted(shuffled[n_held:]), sorted(shuffled[:n_held])


def read_text(root: Path, rel: str) -> str:
    """Read one corpus file as UTF-8 (undecodable bytes replaced)."""
    return (root / rel).read_text(encoding="utf-8", errors="replace")


def write_corpus(out_dir: Path, heldout_list: Path, root: Path | None = None) -> dict[str, int]:
    """Write ``train_files.txt`` / ``heldout_files.txt`` into ``out_dir`` and the held-out list."""
    files = list_corpus_files(root)
    train, held = split_files(files)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_files.txt").write_text("\n".join(train) + "\n")
    (out_dir / "heldout_files.txt").write_text("\n".join(held) + "\n")
    heldout_list.parent.mkdir(parents=True, exist_ok=True)
    heldout_list.write_text("\n".join(held) + "\n")
    return {"files": len(files), "train": len(train), "heldout": len(held)}


def packages_root() -> Path:
    """Directory of the installed third-party packages (the environment's ``purelib``)."""
    return Path(sysconfig.get_paths()["purelib"])


def list_package_files(root: Path | None = None, max_bytes: int = 256_000) -> list[str]:
    """Sorted relative paths of the ``*.py`` files of the installed packages (the extended corpus).

    Same exclusions as the stdlib corpus (test suites, caches); files over ``max_bytes`` are left
    out (generated tables and vendored bundles, not code a person writes)."""
    root = root or packages_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS or part.endswith((".dist-info", ".egg-info")) for part in rel.parts[:-1]):
            continue
        if path.is_file() and 0 < path.stat().st_size <= max_bytes:
            out.append(rel.as_posix())
    return sorted(out)


def _long_lines(text: str, min_chars: int) -> list[str]:
    return [line.strip() for line in text.splitlines() if len(line.strip()) >= min_chars]


class Decontaminator:
    """Drops documents that copy held-out code: the installed packages vendor parts of the stdlib
    (setuptools carries distutils, backports carry enum, pprint, ...), and the held-out stdlib files
    are what the perplexity and the speculation benchmarks measure on.

    A document is contaminated when at least ``max_shared`` of its long lines (``min_chars`` or
    more after stripping), and at least ``min_lines`` of them, occur verbatim in a held-out file."""

    def __init__(self, heldout_texts: Sequence[str], min_chars: int = 32, max_shared: float = 0.1,
                 min_lines: int = 3) -> None:
        self.min_chars, self.max_shared, self.min_lines = min_chars, max_shared, min_lines
        self.lines = {line for text in heldout_texts for line in _long_lines(text, min_chars)}

    def contaminated(self, text: str) -> bool:
        lines = _long_lines(text, self.min_chars)
        shared = sum(line in self.lines for line in lines)
        return shared >= self.min_lines and shared >= self.max_shared * len(lines)


def read_file_list(path: Path) -> list[str]:
    """Read a list of relative paths, one per line."""
    return [line for line in path.read_text().splitlines() if line.strip()]


def train_tokenizer(texts: Iterator[str] | Sequence[str], vocab_size: int = 8192):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` with BOS post-processing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(BOS_TOKEN) == BOS_ID and tok.token_to_id(EOS_TOKEN) == EOS_ID
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tok


def save_tokenizer(tok, folder: Path, max_length: int = 2048) -> None:
    """Save ``tokenizer.json`` plus the ``transformers`` config files into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the tokenizer files from ``src`` to ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        (dst / name).write_bytes((src / name).read_bytes())


def encode_documents(tok, texts: Sequence[str]) -> torch.Tensor:
    """Encode texts as ``<|bos|> tokens <|endoftext|>`` and concatenate into one int32 stream.

    ``tok`` is a ``tokenizers.Tokenizer`` whose post-processor prepends BOS.
    """
    encs = tok.encode_batch(list(texts))
    stream: list[int] = []
    for enc in encs:
        ids = enc.ids
        if not ids or ids[0] != BOS_ID:
            ids = [BOS_ID, *ids]
        stream.extend(ids)
        stream.append(EOS_ID)
    return torch.tensor(stream, dtype=torch.int32)


def chunk_stream(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a token stream into ``[n, seq_len]`` non-overlapping sequences (tail dropped)."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len).long()


class SequenceSampler:
    """Epoch-based shuffled batches of fixed-length sequences, resumable via its state."""

    def __init__(self, seqs: torch.Tensor, batch_size: int, seed: int) -> None:
        self.seqs = seqs
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self._perm = self._make_perm()

    def _make_perm(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.seqs.shape[0], generator=g)

    def next_batch(self) -> torch.Tensor:
        if self.pos + self.batch_size > self._perm.numel():
            self.epoch += 1
            self.pos = 0
            self._perm = self._make_perm()
        idx = self._perm[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return self.seqs[idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]
        self.pos = state["pos"]
        self._perm = self._make_perm()
