"""Load-test workloads: which prompts a simulated user sends, and how it samples.

code: held-out code completion, greedy (speculation-friendly). Prompts are windows of held-out
  standard-library files (bench.common.code_prompts) when models/target has a tokenizer and a
  held-out file list, else a few built-in code snippets. A window goes as its token ids to the
  model whose tokenizer cut it (models/target), as its text to any other model with a tokenizer.
text: open-ended prose at temperature 1.0 (unpredictable: drafts are rejected more often).
chat: a one-turn conversation, [{"role": "user", "content": prompt}], rendered by the served
  model's chat template. Prompts are the held-out chat prompts (models/chat_heldout_prompts.json,
  never trained on) when that file exists, else a few built-in questions. Sampled at temperature
  0.7, top_p 0.9: chat clients sample rather than decode greedily, so this is the traffic
  speculation meets in chat, and greedy decoding would overstate its acceptance.
mix: each request picks code or text with equal odds.
A prompt is {"text": str}, {"token_ids": [int]}, or both with "ids_for": the model id the ids
belong to; `adapt` fits one to the served model (no tokenizer: bytes mapped onto the vocabulary;
ids outside the vocabulary folded into it). A chat prompt is {"text": str}, its message.
Imports nothing heavy unless held-out code prompts are built (transformers, torch).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
WORKLOADS = ("code", "text", "chat", "mix")
KINDS = ("code", "text", "chat")  # the prompt kinds; a workload is one kind, or "mix"
MIX_KINDS = ("code", "text")
CHAT_PROMPTS_FILE = MODELS_DIR / "chat_heldout_prompts.json"
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
BUILTIN_CHAT = [
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "How do I reverse a string in Python?",
    "Explain what a hash table is in two sentences.",
]
SAMPLING = {
    "code": {"temperature": 0.0},
    "text": {"temperature": 1.0, "top_p": 1.0},
    "chat": {"temperature": 0.7, "top_p": 0.9},
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


def heldout_chat_prompts(num: int, path: Path = CHAT_PROMPTS_FILE) -> list[dict]:
    """The first `num` held-out chat prompts of `path` ({"prompts": [str, ...]}, written by
    `python -m training chat-data`). FileNotFoundError if it is missing, ValueError if it holds
    no prompts or anything but strings."""
    with open(path) as f:
        data = json.load(f)
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not prompts or not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"{path}: want {{\"prompts\": [non-empty strings]}}, got {str(data)[:80]!r}")
    return [{"text": p} for p in prompts[:num]]


def build_prompts(num: int = 32, prompt_len: int = 128, models_dir: Path = MODELS_DIR, heldout: bool = True) -> dict:
    """{"code": [...], "text": [...], "chat": [...], "sources": {...}}: the prompts `run.py` hands
    to locust; `heldout` False: the built-in code snippets and chat questions."""
    sources = {"text": "built-in prose prompts"}
    code: list[dict[str, Any]] = []
    chat: list[dict[str, Any]] = []
    if heldout:
        try:
            code = heldout_code_prompts(num, prompt_len, models_dir)
            sources["code"] = f"{len(code)} held-out stdlib windows of {prompt_len} tokens ({models_dir / 'target'} tokenizer)"
        except (FileNotFoundError, ImportError, ValueError, IndexError) as e:
            sources["code"] = f"built-in code snippets (no held-out prompts: {e})"
        chat_file = models_dir / CHAT_PROMPTS_FILE.name
        try:
            chat = heldout_chat_prompts(num, chat_file)
            sources["chat"] = f"{len(chat)} held-out chat prompts ({chat_file})"
        except (FileNotFoundError, ValueError) as e:
            sources["chat"] = f"built-in questions (no held-out chat prompts: {e})"
    if not code:
        code = [{"text": t} for t in BUILTIN_CODE]
        sources.setdefault("code", "built-in code snippets")
    if not chat:
        chat = [{"text": t} for t in BUILTIN_CHAT]
        sources.setdefault("chat", "built-in questions")
    return {"code": code, "text": [{"text": t} for t in BUILTIN_TEXT], "chat": chat, "sources": sources}


def workload_kinds(workload: str) -> tuple[str, ...]:
    """The prompt kinds a workload draws from: ("code", "text") for mix, else its own."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload: must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    return MIX_KINDS if workload == "mix" else (workload,)


def load_prompts(path: str | None, workload: str = "mix") -> dict:
    """Prompts from a `build_prompts` JSON file, or the built-in ones when `path` is empty. The
    file needs the kinds `workload` draws from (one written before the chat workload has no
    "chat" prompts, and still serves code, text and mix)."""
    if not path:
        return build_prompts(heldout=False)
    with open(path) as f:
        prompts = json.load(f)
    for kind in workload_kinds(workload):
        if not prompts.get(kind):
            raise ValueError(f"{path}: no {kind!r} prompts for the {workload!r} workload (rebuild the file with "
                             "loadtest.workloads.build_prompts)")
    return prompts


def pick_kind(workload: str, rng: random.Random) -> str:
    return rng.choice(workload_kinds(workload))


def chat_messages(prompt: dict) -> list[dict[str, str]]:
    """The conversation a chat prompt is sent as: one user turn."""
    return [{"role": "user", "content": prompt["text"]}]


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
