"""Incremental detokenization: tokenizers' DecodeStream against the window decoder and the full
decode, over the shipped tokenizer with multi-byte characters split across tokens."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from bench.common import MODELS
from engine.outputs import IncrementalDetokenizer

TEXTS = [
    "def add(a, b):\n    return a + b  # sum\n",
    "naïve café — 東京の天気は晴れ 🙂🙃 ok",
    "x = 'ünïcödé'\n\tprint(x)  \n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(MODELS / "target"))


@pytest.mark.parametrize("seed", range(4))
def test_stream_deltas_equal_the_window_decoders_and_the_whole_text(tokenizer, seed):
    rng = random.Random(seed)
    specials = [tokenizer.eos_token_id, tokenizer.bos_token_id]
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if seed % 2:  # a special token in the middle: skipped by both
            ids.insert(len(ids) // 2, specials[seed % len(specials)])
        fast, slow = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(tokenizer, stream=False)
        assert fast.stream is not None and slow.stream is None
        got_fast, got_slow, i = [], [], 0
        while i < len(ids):
            n = rng.randint(1, 5)  # speculative steps push several ids at once
            chunk = ids[i : i + n]
            got_fast.append(fast.push(chunk))
            got_slow.append(slow.push(chunk))
            i += n
        assert got_fast == got_slow
        assert "".join(got_fast) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_split_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character split over tokens"
    d = IncrementalDetokenizer(tokenizer)
    assert [d.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1:]) == "🙂"
    assert d.push([]) == ""


@pytest.mark.parametrize("stream", [True, False])
def test_flush_gives_the_held_back_bytes_as_the_whole_decode_does(tokenizer, stream):
    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte never comes (max_tokens, EOS)
    d = IncrementalDetokenizer(tokenizer, stream=stream)
    text = "".join(d.push([t]) for t in cut)
    assert text == "ok "
    tail = d.flush()
    assert tail and set(tail) == {"\ufffd"}
    assert text + tail == tokenizer.decode(cut, skip_special_tokens=True)
    assert d.flush() == "" and d.push([]) == ""


def test_a_finished_request_keeps_its_cut_character_a_handed_off_one_does_not(tokenizer):
    """The text a request ends with is the whole decode of its ids, bytes of a character that
    max_tokens cut included (before: silently dropped, `text` '' for several tokens); a request
    handed off after its prefill holds them back for the engine that goes on with it."""
    from engine.llm_engine import EngineOutput
    from engine.outputs import RequestState
    from engine.sampling_params import SamplingParams

    ids = tokenizer.encode("x 🙂", add_special_tokens=False)[:-1]
    for reason, want in (("length", tokenizer.decode(ids, skip_special_tokens=True)), ("handoff", "x ")):
        state = RequestState("r", None, [5], SamplingParams(max_tokens=len(ids)), tokenizer)
        deltas = [state.process(EngineOutput("r", [t]))[0].delta_text for t in ids[:-1]]
        last, _ = state.process(EngineOutput("r", ids[-1:], reason))
        assert last.text == "".join(deltas) + last.delta_text == want, reason
