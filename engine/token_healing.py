"""Token healing at the edge: a text prompt that ends inside what the model would write as one
token (code ending with "\\n" before an indented line: the tokenizer merges a newline with the
indentation that follows it) loses its last token, and the first generated token must start with
that token's text (guidance; transformers' `generate(token_healing=True)`).

The engine only sees the result: shorter prompt ids and `SamplingParams.first_token_ids`, which
the model runner applies as a mask. Token texts are each token decoded on its own
(`tokenizer.decode([id])`: byte-level tokens by their bytes, not their 'Ċ' symbols), as the edge's
detokenizer decodes a request's first output token, computed once per tokenizer.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import weakref
from typing import Any, NamedTuple

from engine.sampling_params import SamplingParams


class HealedPrompt(NamedTuple):
    token_ids: list[int]  # the prompt without its healed last token (unchanged when not healed)
    first_token_ids: list[int] | None  # the tokens the first output may be (ascending); None: any
    prefix_text: str  # the removed token's text, which the first output token repeats; "" if none


class TokenTexts:
    """Every token's text, and the non-special ones sorted by text, so that the tokens whose text
    starts with a given string are one contiguous run (`starting_with`)."""

    def __init__(self, tokenizer: Any) -> None:
        special = set(tokenizer.all_special_ids)
        special.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
        num_tokens = len(tokenizer)
        self.texts: list[str] = tokenizer.batch_decode([[i] for i in range(num_tokens)])
        self.is_special = [i in special for i in range(num_tokens)]
        pairs = sorted((t, i) for i, t in enumerate(self.texts) if not self.is_special[i])
        self.sorted_texts = [t for t, _ in pairs]
        self.sorted_ids = [i for _, i in pairs]

    def starting_with(self, prefix: str) -> list[int]:
        """The non-special token ids whose text starts with `prefix`, ascending."""
        ids = []
        for j in range(bisect.bisect_left(self.sorted_texts, prefix), len(self.sorted_texts)):
            if not self.sorted_texts[j].startswith(prefix):
                break
            ids.append(self.sorted_ids[j])
        return sorted(ids)


_texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_texts_lock = threading.Lock()


def token_texts(tokenizer: Any) -> TokenTexts:
    """The `TokenTexts` of a tokenizer, built at its first use (one decode of the vocabulary:
    ~25 ms for 8192 tokens) and kept as long as the tokenizer lives."""
    with _texts_lock:
        texts = _texts.get(tokenizer)
        if texts is None:
            texts = _texts[tokenizer] = TokenTexts(tokenizer)
        return texts


def heal_prompt(tokenizer: Any, prompt_ids: list[int]) -> HealedPrompt:
    """Remove the prompt's last token when healing can change what follows it: it is not a special
    token, a non-special token stays before it (a lone token, or one after BOS, is kept), its
    text is clean ('\\ufffd'-free, not empty), and another token's text starts with it. Then the
    allowed first tokens are every non-special token whose text starts with the removed token's
    (itself included). Otherwise the ids come back unchanged, with no constraint.

    Example (byte-level BPE where "\\n    " is one token): "def f(n):\\n" ends with "\\n" ->
    the prompt loses it, and the first token may be "\\n", "\\n    ", "\\n\\n", ...
    """
    ids = list(prompt_ids)
    unchanged = HealedPrompt(ids, None, "")
    if not ids:
        return unchanged
    texts = token_texts(tokenizer)
    last = ids[-1]
    if not 0 <= last < len(texts.texts) or texts.is_special[last]:
        return unchanged
    if not any(0 <= t < len(texts.texts) and not texts.is_special[t] for t in ids[:-1]):
        return unchanged
    prefix = texts.texts[last]
    if not prefix or "\ufffd" in prefix:
        return unchanged
    allowed = texts.starting_with(prefix)
    if len(allowed) < 2:
        return unchanged
    return HealedPrompt(ids[:-1], allowed, prefix)


def wants_healing(prompt_text: str | None, params: SamplingParams) -> bool:
    """Whether `apply_token_healing` has a prompt to heal: the request asks for it, its prompt was
    text, and its params carry no first-token constraint yet."""
    return params.token_healing and prompt_text is not None and params.first_token_ids is None


def apply_token_healing(
    tokenizer: Any, prompt_text: str | None, prompt_ids: list[int], params: SamplingParams
) -> tuple[list[int], SamplingParams]:
    """The prompt ids and sampling params a request runs with: healed (`heal_prompt`, on a copy of
    the params carrying `first_token_ids` and `healed_prefix`) when it asks for token healing and
    its prompt was text; as given otherwise: prompts given as token ids, and params that already
    carry a first-token constraint (healed before: the decode side of a handoff, a deployment
    that healed while translating), are not healed."""
    if tokenizer is None or not wants_healing(prompt_text, params):
        return prompt_ids, params
    healed = heal_prompt(tokenizer, prompt_ids)
    if healed.first_token_ids is None:
        return prompt_ids, params
    return healed.token_ids, dataclasses.replace(
        params, first_token_ids=healed.first_token_ids, healed_prefix=healed.prefix_text
    )
