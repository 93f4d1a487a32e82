"""The engine against references: transformers greedy generation, HF's top-k/top-p warpers;
continuous batching with staggered arrivals and forced preemption; errors that leave it serving."""

import asyncio

import pytest
import torch
import transformers
from helpers import assert_no_leaked_blocks, save_tiny_model

from engine import (
    LLM,
    AsyncLLM,
    CheckpointError,
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
)
from engine.sampler import probs_from_logits

PROMPTS = [
    [1, 2, 3],
    [5] * 9,
    list(range(10, 40)),
    [42],
    list(range(60, 96)) + list(range(0, 20)),
    [7, 8, 9, 10, 11, 12, 13],
    [90, 3, 44, 17, 2, 2, 2, 9, 31, 60, 12],
    list(range(96, 0, -3)),
    [33, 34] * 12,
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("engine_llama")), "llama")


@pytest.fixture(scope="module")
def reference_outputs(model_dir):
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_greedy(ref, p, 24) for p in PROMPTS]


def hf_greedy(ref, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        r = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=None)
    return r[0, len(prompt):].tolist()


def run_staggered(engine: LLMEngine, prompts, params, arrival_steps) -> dict[str, list[int]]:
    """Add prompt i at engine step arrival_steps[i]; step until all finish. Checks invariants."""
    outputs: dict[str, list[int]] = {}
    pending = sorted(range(len(prompts)), key=lambda i: arrival_steps[i])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and arrival_steps[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], params)
            outputs[f"r{i}"] = []
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        assert_no_leaked_blocks(engine)
        step += 1
    assert_no_leaked_blocks(engine)
    return outputs


def test_generate_batch_matches_transformers(model_dir, reference_outputs):
    llm = LLM(model_dir, dtype="float32", device="cpu")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference_outputs
    assert all(o.finish_reason == "length" for o in outs)
    assert_no_leaked_blocks(llm.engine)


def test_staggered_arrivals_and_chunked_prefill(model_dir, reference_outputs):
    engine = LLMEngine(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=24, max_num_seqs=4)
    outs = run_staggered(engine, PROMPTS, GREEDY, [0, 0, 1, 3, 3, 5, 8, 13, 14])
    assert [outs[f"r{i}"] for i in range(len(PROMPTS))] == reference_outputs


def test_preemption_keeps_outputs_identical(model_dir, reference_outputs):
    # 14 blocks of 4 tokens: far fewer than 9 requests of up to 80 tokens need -> preemption.
    bytes_per_token = 2 * 2 * 2 * 16 * 4
    engine = LLMEngine(model_dir, dtype="float32", device="cpu", block_size=4,
                       kv_cache_memory_bytes=14 * 4 * bytes_per_token, max_model_len=56)
    assert engine.num_blocks == 14
    prompts = [p[:30] for p in PROMPTS]
    outs = run_staggered(engine, prompts, GREEDY, [0, 0, 0, 1, 2, 2, 4, 5, 6])
    assert engine.scheduler.num_preemptions > 0
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(ref, p, 24), f"prompt {i}"


def test_prefix_cache_hits_give_identical_output(model_dir):
    engine = LLMEngine(model_dir, dtype="float32", device="cpu", block_size=4)
    shared = list(range(1, 41))
    first = run_staggered(engine, [shared + [50]], GREEDY, [0])["r0"]
    queries = engine.block_manager.num_prefix_hits
    second = run_staggered(engine, [shared + [50]], GREEDY, [0])["r0"]
    assert engine.block_manager.num_prefix_hits == queries + 1
    assert first == second


def test_seeded_sampling_is_reproducible_and_batch_independent(model_dir):
    llm = LLM(model_dir, dtype="float32", device="cpu")
    sp = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=20, seed=123, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], sp)[0].token_ids
    other = SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)
    batched = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]], [other, sp, other])[1].token_ids
    assert alone == batched
    different = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=1.0, seed=124, ignore_eos=True))
    assert different[0].token_ids != alone


@pytest.mark.parametrize("top_k,top_p", [(0, 0.7), (5, 1.0), (10, 0.5), (1, 0.3), (0, 1.0)])
def test_top_k_top_p_match_transformers_warpers(top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    temp = 0.7
    ref = TemperatureLogitsWarper(temp)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    expected = ref.softmax(-1)
    got = probs_from_logits(logits, torch.full((6,), temp), torch.full((6,), top_k), torch.full((6,), top_p))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_bad_input_raises_specific_errors_and_engine_keeps_serving(model_dir, reference_outputs):
    engine = LLMEngine(model_dir, dtype="float32", device="cpu", max_model_len=64)
    engine.add_request("good", PROMPTS[0], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(InvalidRequestError, match="max_model_len is 64"):
        engine.add_request("b", [1] * 64, GREEDY)
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \[0, 96\]"):
        engine.add_request("c", [1, 97], GREEDY)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(InvalidRequestError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidRequestError, match="top_k"):
        SamplingParams(top_k=-1)
    out = []
    while engine.has_unfinished_requests():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert out == reference_outputs[0]
    assert_no_leaked_blocks(engine)
    with pytest.raises(CheckpointError):
        LLMEngine(model_dir + "-missing")
    with pytest.raises(ValueError, match="dtype"):
        LLMEngine(model_dir, dtype="int8")


def test_abort_frees_blocks_at_once(model_dir):
    engine = LLMEngine(model_dir, dtype="float32", device="cpu")
    engine.add_request("x", PROMPTS[4], GREEDY)
    engine.add_request("y", PROMPTS[2], GREEDY)
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort_request("x")
    assert not engine.abort_request("x")
    assert_no_leaked_blocks(engine)
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaked_blocks(engine)


def test_stop_strings_hold_back_and_truncate():
    from engine.llm_engine import EngineOutput
    from engine.outputs import RequestState

    class CharTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    state = RequestState("r", None, [0], SamplingParams(stop=["cde"], max_tokens=50), CharTokenizer())
    deltas = []
    for tok in [0, 1, 2, 3, 4, 5]:
        ro, stop_hit = state.process(EngineOutput("r", [tok]))
        deltas.append(ro.delta_text)
        if ro.finished:
            break
    assert "".join(deltas) == "ab" and ro.text == "ab"
    assert stop_hit and ro.finish_reason == "stop"


def test_async_llm_streams_and_aborts(model_dir, reference_outputs):
    llm = AsyncLLM(model_dir, dtype="float32", device="cpu")

    async def collect(prompt, rid):
        tokens = []
        async for out in llm.generate(prompt, GREEDY, request_id=rid):
            tokens.extend(out.delta_token_ids)
            assert out.token_ids == tokens
        return tokens

    async def cancelled():
        n = 0
        async for _ in llm.generate(PROMPTS[4], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)):
            n += 1
            if n == 3:
                break

    async def main():
        results = await asyncio.gather(*(collect(p, f"s{i}") for i, p in enumerate(PROMPTS[:5])), cancelled())
        with pytest.raises(InvalidRequestError):
            async for _ in llm.generate([], GREEDY):
                pass
        stats = await llm.wait_idle()
        return results[:5], stats

    try:
        results, stats = asyncio.run(main())
    finally:
        llm.shutdown()
    assert results == reference_outputs[:5]
    assert stats["num_used_blocks"] == 0
    assert_no_leaked_blocks(llm.engine)


def test_async_llm_outlives_a_consumer_whose_event_loop_closed(model_dir, reference_outputs):
    """A consumer that leaves mid-stream and closes its event loop (asyncio.run returning) queues
    an abort that the engine thread may handle after the loop is gone: the engine thread must
    neither die nor keep the stream, and keeps serving other loops."""
    llm = AsyncLLM(model_dir, dtype="float32", device="cpu")

    async def leave_early() -> None:
        async for _ in llm.generate(PROMPTS[4], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)):
            return  # the generator is closed by asyncio.run's shutdown, then the loop is closed

    async def collect(prompt) -> list[int]:
        tokens = []
        async for out in llm.generate(prompt, GREEDY):
            tokens.extend(out.delta_token_ids)
        return tokens

    try:
        for _ in range(5):
            asyncio.run(leave_early())
        assert asyncio.run(asyncio.wait_for(collect(PROMPTS[0]), 60)) == reference_outputs[0]
        assert llm._thread.is_alive()
        assert asyncio.run(asyncio.wait_for(llm.wait_idle(), 60))["num_used_blocks"] == 0
        assert not llm._streams
    finally:
        llm.shutdown()


def test_gpu_kv_budget_is_the_cards_share_and_refuses_a_full_card_actionably():
    """Sized automatically on a GPU, the KV cache is gpu_memory_utilization of the whole card less
    what is already in use on it; a second engine on a card the first filled is refused with the
    numbers and the two ways out (found on an H200: engines made one after another in one process)."""
    from engine.llm_engine import gpu_kv_budget

    gib = 1 << 30
    assert gpu_kv_budget(100 * gib, 90 * gib, 0.85, gib) == 85 * gib - 10 * gib - gib
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.85 .* 100.0 GiB .* 86.0 GiB are already in use"
                       r".*kv_cache_memory_bytes"):
        gpu_kv_budget(100 * gib, 14 * gib, 0.85, 0)
