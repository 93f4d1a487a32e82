"""A token's bytes as the tokenizer's vocabulary spells them: what the log-probabilities report
for each token (engine/outputs.py) and what structured output's grammars match
(engine/structured_output.py)."""

from __future__ import annotations

import functools


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: byte-level BPE tokens spell their bytes
    with it (printable bytes as themselves, the others as characters from U+0100 up)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def token_piece(tokenizer, token_id: int) -> tuple[str, bytes]:
    """One token as (text, bytes): its bytes as the tokenizer's vocabulary spells them (a
    byte-level BPE token's from its alphabet; otherwise the UTF-8 of its decoding), and their
    text with U+FFFD where the token holds part of a character. Special tokens: their name."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    alphabet = _byte_level_alphabet()
    if type(decoder).__name__ == "ByteLevel" and piece and all(c in alphabet for c in piece):
        raw = bytes(alphabet[c] for c in piece)
    else:
        raw = tokenizer.decode([token_id]).encode() or (piece or "").encode()
    return raw.decode("utf-8", errors="replace"), raw
