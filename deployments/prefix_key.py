"""A request's `PrefixKey` as the ingress computes it, for prefix-aware routing.

The prompt is rendered and tokenized as an engine replica's `translate` does it (a text prompt's
tokens, the ids given, or the conversation through the chat template with its tools) and hashed
by block with the engine's prefix-cache hash (`engine.block_manager.prefix_block_hashes`). The
router (deployments/router.py) matches the key against the blocks each replica reports its prefix
cache holds. A key is only a hint: a wrong one costs a cache miss, never a wrong answer, so a
request whose prompt cannot be rendered here simply has none (the replica refuses it with the
reason), and so does every request until the tokenizer, loaded in a thread from the ingress's
start, is ready.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from deployments.router import PrefixKey
from protos.specdecode.v1 import specdecode_pb2 as pb

logger = logging.getLogger("ray.serve")

# Text beyond this many characters is not tokenized here: it bounds what a hostile prompt costs
# the ingress, far above any prompt a replica accepts.
MAX_KEY_CHARS = 200_000


class PrefixKeys:
    """Computes `PrefixKey`s with the model's tokenizer (`tokenizer_path`: a checkpoint folder or
    a GGUF file) for blocks of `block_size` tokens."""

    def __init__(self, tokenizer_path: str, block_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.block_size = block_size
        self.tokenizer: Any = None  # set by the loader thread once loaded (None: no keys)
        self._loader: threading.Thread | None = None

    async def key(self, request: pb.GenerateRequest, messages: list[dict] | None) -> PrefixKey | None:
        """The request's key, or None (no tokenizer yet, or a prompt that does not render)."""
        if self.tokenizer is None:
            self.start_loading()
            return None
        try:
            ids = await asyncio.to_thread(self.token_ids, request, messages)
        except Exception:  # noqa: BLE001 - a bad prompt is the replica's to refuse, with its reason
            return None
        if not ids:
            return None
        from engine.block_manager import prefix_block_hashes

        return PrefixKey(self.block_size, tuple(prefix_block_hashes(ids, self.block_size)))

    def token_ids(self, request: pb.GenerateRequest, messages: list[dict] | None) -> list[int]:
        """The prompt's token ids as a replica renders them (the first MAX_KEY_CHARS characters
        of a long text; a cut may change the last tokens, so one block is dropped then)."""
        from deployments.replica import chat_message, request_tools
        from deployments.tools import render_chat

        kind = request.WhichOneof("input")
        if kind == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        if kind == "prompt":
            text, cut = request.prompt[:MAX_KEY_CHARS], len(request.prompt) > MAX_KEY_CHARS
            ids = list(self.tokenizer.encode(text))
            return ids[: -self.block_size] if cut else ids
        if kind == "chat":
            messages = [chat_message(m) for m in request.chat.messages]
        if not messages or not getattr(self.tokenizer, "chat_template", None):
            return []
        if sum(len(m.get("content") or "") for m in messages) > MAX_KEY_CHARS:
            return []
        tools, _ = request_tools(request)
        return render_chat(self.tokenizer, messages, tools)

    def start_loading(self) -> None:
        """Load the tokenizer in a thread of its own (importing transformers and reading a GGUF's
        vocabulary take seconds, which no request should wait for)."""
        if self._loader is None:
            self._loader = threading.Thread(target=self._load, name="prefix-key-tokenizer", daemon=True)
            self._loader.start()

    @property
    def ready(self) -> bool:
        return self.tokenizer is not None

    def _load(self) -> None:
        from engine.llm import load_tokenizer

        try:
            tokenizer = load_tokenizer(self.tokenizer_path)
        except Exception as e:  # noqa: BLE001 - routing goes on by load alone
            logger.warning("prefix-aware routing is off: the tokenizer %s did not load (%s)", self.tokenizer_path, e)
            return
        if tokenizer is None:
            logger.warning("prefix-aware routing is off: %s has no tokenizer", self.tokenizer_path)
        self.tokenizer = tokenizer
