"""Exact speculation: a token's logits must not depend on how many tokens its step computes.

BLAS rounds a product by the kernel it picks for the number of rows (MKL fp32 on this host: 1 |
2-3 | >= 4 rows differ in the last bits), so verifying k drafts in one (k + 1)-row step can give
other logits than k + 1 one-token steps, and greedy text changes at near-ties. The engine's
`exact` modes (engine/model_runner.py) compute each token as a one-token step would; these tests
compare logits bit for bit (torch.equal), with a negative control showing that the plain batched
step ("off") does differ where this host's BLAS rounds by row count.
"""

from __future__ import annotations

import pytest
import torch
from helpers import save_perturbed_copy, save_tiny_heads, save_tiny_model

from engine import LLM, SamplingParams, SpeculativeConfig
from engine.model_runner import (
    EXACT_ROWS,
    ROW_KERNEL_MAX_TOKENS,
    ROW_KERNEL_MAX_TOKENS_AMX,
    ROW_KERNEL_SHORT_CHUNK,
    ModelRunner,
    SeqChunk,
    choose_exact_mode,
)
from engine.models.llama import ROW_KERNEL

PROMPT = [5, 17, 33, 2, 71, 9, 40, 12, 88, 3, 61, 27, 14, 50, 6, 93, 21, 38, 7, 44]
TOKENS = [11, 64, 29, 80, 35]  # the next token and four drafts
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("exact")
    return {family: save_tiny_model(str(root / family), family)
            for family in ("llama", "qwen3")}


def make_runner(path: str, dtype: str, exact: str) -> ModelRunner:
    """exact "rows-torch": the "rows" mode without the CPU kernels (its fallback path)."""
    r = ModelRunner(path, torch.device("cpu"), DTYPES[dtype], 512, "torch", exact.removesuffix("-torch"))
    if exact.endswith("-torch"):
        r.row_kernel = False
    r.init_kv_cache(64, 16)
    return r


@torch.inference_mode()
def step_logits(r: ModelRunner, chunks: list[SeqChunk], rows: list[int]) -> torch.Tensor:
    batch, hidden = r.forward(chunks)
    return r.logits_rows(hidden, rows, r.row_tiles(batch, chunks, rows))


def one_by_one(r: ModelRunner, blocks: list[int]) -> torch.Tensor:
    """Prefill PROMPT, then TOKENS one per step: the logits of each step [len(TOKENS), vocab]."""
    step_logits(r, [SeqChunk(PROMPT, 0, blocks)], [len(PROMPT) - 1])
    return torch.cat([step_logits(r, [SeqChunk([t], len(PROMPT) + i, blocks)], [0]) for i, t in enumerate(TOKENS)])


def verified_at_once(r: ModelRunner, blocks: list[int], others: list[SeqChunk] = ()) -> torch.Tensor:
    """Prefill PROMPT, then all TOKENS in one step (a verification), optionally next to other
    requests' chunks: the logits of TOKENS' positions."""
    step_logits(r, [SeqChunk(PROMPT, 0, blocks)], [len(PROMPT) - 1])
    return step_logits(r, [SeqChunk(TOKENS, len(PROMPT), blocks), *others], list(range(len(TOKENS))))


BLOCKS_A, BLOCKS_B, BLOCKS_C = [0, 1], [2, 3], [4, 5, 6, 7]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["rows", "rows-torch", "pad", "batch_invariant"])
def test_verification_gives_the_logits_of_one_token_steps(models, family, dtype, mode):
    r = make_runner(models[family], dtype, mode)
    assert torch.equal(verified_at_once(r, BLOCKS_B), one_by_one(r, BLOCKS_A))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_negative_control_plain_batched_step_differs(models, dtype):
    """The same comparison with exact="off" (one product per step): on a BLAS that rounds 1-row
    and 5-row products differently the logits differ, which is what the modes above remove."""
    r = make_runner(models["llama"], dtype, "off")
    if torch.equal(verified_at_once(r, BLOCKS_B), one_by_one(r, BLOCKS_A)):
        pytest.skip(f"this host's BLAS rounds 1-row and {len(TOKENS)}-row {dtype} products alike")
    assert not torch.equal(verified_at_once(r, BLOCKS_B), one_by_one(r, BLOCKS_A))


@pytest.mark.parametrize("mode", ["pad", "batch_invariant", "rows"])
def test_other_requests_in_the_step_change_nothing(models, mode):
    """pad: within a step of <= EXACT_ROWS tokens; rows through the CPU kernels: within a step
    of <= ROW_KERNEL_MAX_TOKENS tokens (a long prefill's step too); batch_invariant: always."""
    if mode == "rows" and not make_runner(models["llama"], "float32", "rows").row_kernel:
        pytest.skip("rows without the CPU kernels is exact for single-request steps only")
    r = make_runner(models["llama"], "float32", mode)
    alone = verified_at_once(r, BLOCKS_A)
    other = SeqChunk([3, 4, 5, 6, 7, 8], 0, BLOCKS_B)  # 5 + 6 tokens <= EXACT_ROWS
    assert torch.equal(verified_at_once(r, BLOCKS_C, [other]), alone)
    if mode in ("batch_invariant", "rows"):
        long_prefill = SeqChunk(list(range(1, 41)), 0, [8, 9, 10])  # 45 tokens in the step
        if mode == "rows":
            assert r.tile_rows([long_prefill, SeqChunk(TOKENS, 0, [11, 12])]) == ROW_KERNEL
            assert r.tile_rows([SeqChunk([1] * (ROW_KERNEL_MAX_TOKENS + 1), 0, [])]) == 0  # torch's path
        assert torch.equal(verified_at_once(r, [11, 12], [long_prefill]), alone)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_verification_beside_a_prompt_too_long_for_the_row_kernels_is_unchanged(models, dtype, monkeypatch):
    """rows through the CPU kernels: a step over ROW_KERNEL_MAX_TOKENS (a long prompt's chunk)
    goes through torch's path, but its short chunks (ROW_SPLIT_MAX_CHUNK: a verification, decode
    steps) still go through the row kernels in a forward of their own, so a request's logits are
    those of its step alone. Negative control: the whole step on torch's path differs."""
    import engine.model_runner as model_runner

    r = make_runner(models["llama"], dtype, "rows")
    if not r.row_kernel:
        pytest.skip("no CPU row kernels")
    n = r.row_kernel_max_tokens + 40
    prompt = SeqChunk([(7 * i) % 90 + 1 for i in range(n)], 0, list(range(20, 20 + -(-n // 16))))
    decoding = [SeqChunk([9], 30, [40, 41]), SeqChunk([4, 8], 12, [42])]  # two more short chunks
    step = [SeqChunk(TOKENS, len(PROMPT), BLOCKS_C), prompt, *decoding]
    assert r.tile_rows(step) == 0 and r.split_rows(step) == [[0, 2, 3]]
    alone = verified_at_once(r, BLOCKS_A)
    assert torch.equal(verified_at_once(r, BLOCKS_C, [prompt, *decoding]), alone)
    with torch.inference_mode():  # the prompt's rows: as its chunk alone on torch's path
        _, mixed = r.forward([SeqChunk(TOKENS, len(PROMPT), BLOCKS_C), prompt])
        _, by_itself = r.forward([prompt])
    assert torch.equal(mixed[len(TOKENS):], by_itself)
    monkeypatch.setattr(model_runner, "ROW_SPLIT_MAX_CHUNK", 0)  # one forward on torch's path
    assert r.split_rows(step) is None
    if torch.equal(verified_at_once(r, BLOCKS_C, [prompt, *decoding]), alone):
        pytest.skip(f"torch's path and the row kernels round this {dtype} model's rows alike here")


def test_short_chunks_go_through_the_row_kernels_in_groups_of_at_most_their_bound(models):
    r = make_runner(models["llama"], "float32", "rows")
    if not r.row_kernel:
        pytest.skip("no CPU row kernels")
    bound = r.row_kernel_max_tokens
    shorts = [SeqChunk([1] * 30, 0, []) for _ in range(bound // 30 + 1)]  # one more than a group holds
    long_chunk = SeqChunk([1] * 33, 0, [])
    groups = r.split_rows([long_chunk, *shorts])
    assert [i for g in groups for i in g] == list(range(1, len(shorts) + 1))
    assert len(groups) == 2 and all(sum(30 for _ in g) <= bound for g in groups)
    assert r.split_rows(shorts) is None  # no long chunk: the step's own path
    assert make_runner(models["llama"], "float32", "off").split_rows([long_chunk, *shorts]) is None


def test_row_steps_reach_further_for_bfloat16_on_amx(models):
    """The row kernels serve steps of up to ROW_KERNEL_MAX_TOKENS_AMX tokens for a bfloat16 model
    where AMX tiles run the products (ROW_KERNEL_MAX_TOKENS elsewhere and for float32), and such
    a step is still row-exact: a request's verification alone or next to a long prefill."""
    from kernels import cpu_kernels

    f32 = make_runner(models["llama"], "float32", "rows")
    if not f32.row_kernel:
        pytest.skip("no CPU row kernels")
    assert f32.row_kernel_max_tokens == ROW_KERNEL_MAX_TOKENS
    bf16 = make_runner(models["llama"], "bfloat16", "rows")
    bound = ROW_KERNEL_MAX_TOKENS_AMX if cpu_kernels.amx_available() else ROW_KERNEL_MAX_TOKENS
    assert bf16.row_kernel_max_tokens == bound
    assert bf16.tile_rows([SeqChunk([1] * bound, 0, [])]) == ROW_KERNEL
    assert bf16.tile_rows([SeqChunk([1] * (bound + 1), 0, [])]) == 0  # torch's path
    alone = verified_at_once(bf16, BLOCKS_A)
    prefill = SeqChunk([(5 * i) % 90 + 1 for i in range(bound - 10)], 0, list(range(20, 20 + bound // 16)))
    assert torch.equal(verified_at_once(bf16, BLOCKS_C, [prefill]), alone)
    # with AMX, also a longer step of short chunks (prompts admitted next to decoding requests)
    short = [SeqChunk([(3 * i + j) % 90 + 1 for i in range(ROW_KERNEL_SHORT_CHUNK)], 0,
                      list(range(40 + 8 * j, 40 + 8 * j + ROW_KERNEL_SHORT_CHUNK // 16))) for j in range(3)]
    many = sum(len(c.token_ids) for c in short) + len(TOKENS)
    assert many > bound
    if bound == ROW_KERNEL_MAX_TOKENS_AMX:
        assert bf16.tile_rows(short + [SeqChunk(TOKENS, 0, [11, 12])]) == ROW_KERNEL
        assert torch.equal(verified_at_once(bf16, BLOCKS_C, short), alone)
    long_chunk = [SeqChunk([1] * (ROW_KERNEL_SHORT_CHUNK + 1), 0, []), *short]
    assert bf16.tile_rows(long_chunk) == 0  # a longer chunk in it: torch's path


def test_batch_invariant_prefill_does_not_depend_on_chunking(models):
    r = make_runner(models["llama"], "float32", "batch_invariant")
    whole = step_logits(r, [SeqChunk(PROMPT, 0, BLOCKS_A)], [len(PROMPT) - 1])
    step_logits(r, [SeqChunk(PROMPT[:7], 0, BLOCKS_B)], [6])
    step_logits(r, [SeqChunk(PROMPT[7:13], 7, BLOCKS_B)], [5])
    chunked = step_logits(r, [SeqChunk(PROMPT[13:], 13, BLOCKS_B)], [len(PROMPT) - 14])
    assert torch.equal(whole, chunked)


def test_auto_picks_pad_or_rows_and_bad_modes_are_refused(models):
    r = make_runner(models["llama"], "float32", "auto")
    assert r.exact in ("pad", "rows")
    assert choose_exact_mode(r.model, torch.device("cpu"), torch.float32) in ("pad", "rows")
    with pytest.raises(ValueError, match="exact must be one of"):
        make_runner(models["llama"], "float32", "sometimes")
    assert EXACT_ROWS >= 16  # k <= 15 drafts verify exactly at batch 1 in "pad" mode


# --- through the engine: greedy with speculation == greedy without, every drafter ---------------
@pytest.fixture(scope="module")
def drafters(models, tmp_path_factory) -> dict[str, str | None]:
    root = tmp_path_factory.mktemp("exact_drafters")
    target = models["llama"]
    eagle, medusa = save_tiny_heads(str(root), target)
    return {"draft": save_perturbed_copy(target, str(root / "draft"), noise=0.05), "eagle": eagle, "medusa": medusa,
            "ngram": None}


def greedy_mismatches(models, drafters, method: str, dtype: str, exact: str) -> tuple[int, int]:
    """(prompts whose greedy text with speculation differs from without, draft tokens), batch 1
    (one request at a time), 30 random prompts x 40 tokens."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 97) for _ in range(20)] for _ in range(30)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(models["llama"], device="cpu", dtype=dtype)
    spec = SpeculativeConfig(method=method, model=drafters[method], num_speculative_tokens=4, adaptive=False)
    fast = LLM(models["llama"], device="cpu", dtype=dtype, speculative=spec, exact=exact)
    differ = sum(fast.generate([p], params)[0].token_ids != plain.generate([p], params)[0].token_ids for p in prompts)
    return differ, fast.engine.spec_stats.num_draft_tokens


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("method", ["draft", "eagle", "medusa", "ngram"])
def test_greedy_speculation_equals_greedy_without(models, drafters, method, dtype):
    differ, drafted = greedy_mismatches(models, drafters, method, dtype, "auto")
    assert differ == 0 and drafted > 0


@pytest.mark.slow  # make test-fast skips it
def test_negative_control_bf16_speculation_without_exactness_changes_text(models, drafters):
    """Seen on this host: 2-3 of the 30 prompts change in bf16 with exact="off", per drafter."""
    differ, _ = greedy_mismatches(models, drafters, "eagle", "bfloat16", "off")
    if differ == 0:
        pytest.skip("this host's BLAS rounds bf16 products alike whatever their row count")
    assert differ > 0
