"""Load-test workloads: which prompts a simulated user sends, and how it samples.

code: held-out code completion, greedy (speculation-friendly). Prompts are windows of held-out
  standard-library files (bench.common.code_prompts) when models/target has a tokenizer and a
  held-out file list, else a few built-in code snippets. A window goes as its token ids to the
  model whose tokenizer cut it (models/target), as its text to any other model with a tokenizer.
text: open-ended prose at temperature 1.0 (unpredictable: drafts are rejected more often).
mix: each request picks code or text with equal odds.
A prompt is {"text": str}, {"token_ids": [int]}, or both with "ids_for": the model id the ids
belong to; `adapt` fits one to the served model (no tokenizer: bytes mapped onto the vocabulary;
ids outside the vocabulary folded into it).
Imports nothing heavy unless held-out prompts are built (transformers, torch).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
WORKLOADS = ("code", "text", "mix")
KINDS = ("code", "text")
CODE_MODEL_ID = "models/target"  # the code family's model id in the APIs (serve_config_code.yaml)
NUM_SPECIAL_IDS = 3  # ids 0..2 are <unk>/<s>/</s> in the project's tokenizers: keep byte prompts off them

BUILTIN_CODE = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\n\n\ndef list_python_files(root):\n    for dirpath, dirnames, filenames in os.walk(root):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n",
    "def parse_header(line):\n    key, _, value = line.partition(':')\n",
    "async def fetch_all(urls, session):\n    results = []\n    for url in urls:\n",
    "def merge_sorted(a, b):\n    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n",
]
BUILTIN_TEXT = [
    "Once upon a time, in a village at the edge of a forest,",
    "The most surprising thing about the city at night was",
    "Write a short letter to a friend describing your first day at a new job.",
    "In the year 2300, the oceans had",
    "My grandmother's recipe for soup begins with",
    "The committee met for the third time that week, and still nobody could agree on",
]
SAMPLING = {
    "code": {"temperature": 0.0},
    "text": {"temperature": 1.0, "top_p": 1.0},
}


def heldout_code_prompts(num: int, prompt_len: int, models_dir: Path = MODELS_DIR, seed: int = 0) -> list[dict]:
    """`num` windows of held-out stdlib files, tokenized with models/target's tokenizer: their ids
    (for that model) and their text (for others). Raises FileNotFoundError if the tokenizer or the
    held-out file list is missing."""
    target = models_dir / "target"
    for needed in (target / "tokenizer.json", models_dir / "heldout_files.txt"):
        if not needed.is_file():
            raise FileNotFoundError(f"{needed} is missing (train the target model first)")
    from transformers import AutoTokenizer

    from bench.common import code_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return [{"token_ids": ids, "text": tokenizer.decode(ids), "ids_for": CODE_MODEL_ID}
            for ids in code_prompts(tokenizer, num, prompt_len, seed=seed)]


def build_prompts(num: int = 32, prompt_len: int = 128, models_dir: Path = MODELS_DIR, heldout: bool = True) -> dict:
    """{"code": [...], "text": [...], "sources": {...}}: the prompts `run.py` hands to locust."""
    sources = {"text": "built-in prose prompts"}
    code: list[dict[str, Any]] = []
    if heldout:
        try:
            code = heldout_code_prompts(num, prompt_len, models_dir)
            sources["code"] = f"{len(code)} held-out stdlib windows of {prompt_len} tokens ({models_dir / 'target'} tokenizer)"
        except (FileNotFoundError, ImportError, ValueError, IndexError) as e:
            sources["code"] = f"built-in code snippets (no held-out prompts: {e})"
    if not code:
        code = [{"text": t} for t in BUILTIN_CODE]
        sources.setdefault("code", "built-in code snippets")
    return {"code": code, "text": [{"text": t} for t in BUILTIN_TEXT], "sources": sources}


def load_prompts(path: str | None) -> dict:
    """Prompts from a `build_prompts` JSON file, or the built-in ones when `path` is empty."""
    if not path:
        return build_prompts(heldout=False)
    with open(path) as f:
        prompts = json.load(f)
    for kind in KINDS:
        if not prompts.get(kind):
            raise ValueError(f"{path}: no {kind!r} prompts")
    return prompts


def pick_kind(workload: str, rng: random.Random) -> str:
    if workload not in WORKLOADS:
        raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    return rng.choice(KINDS) if workload == "mix" else workload


def bytes_to_ids(text: str, vocab_size: int) -> list[int]:
    """A model without a tokenizer still gets a prompt that varies with the text: its UTF-8 bytes
    folded onto the non-special ids, e.g. "ab" with vocab 97 -> [3 + 97 % 94, 3 + 98 % 94] = [6, 7]."""
    span = vocab_size - NUM_SPECIAL_IDS
    if span <= 0:
        raise ValueError(f"vocab_size: must be > {NUM_SPECIAL_IDS}, got {vocab_size}")
    return [NUM_SPECIAL_IDS + b % span for b in text.encode()]


def adapt(prompt: dict, *, has_tokenizer: bool, vocab_size: int, max_prompt_tokens: int,
          model: str | None = None) -> str | list[int]:
    """What to send for `prompt` to model `model` with this vocabulary: its token ids if they were
    cut for that model, else its text if the server tokenizes, else token ids in [0, vocab_size)
    cut to the last max_prompt_tokens."""
    own_ids = "token_ids" in prompt and prompt.get("ids_for") == model
    if "text" in prompt and has_tokenizer and not own_ids:
        return prompt["text"]
    ids: Sequence[int] = prompt["token_ids"] if "token_ids" in prompt else bytes_to_ids(prompt["text"], vocab_size)
    if any(not 0 <= t < vocab_size for t in ids):
        ids = [NUM_SPECIAL_IDS + t % (vocab_size - NUM_SPECIAL_IDS) for t in ids]
    return list(ids[-max_prompt_tokens:])
