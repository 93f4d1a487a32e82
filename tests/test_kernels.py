"""Paged attention kernels: torch backend vs a naive per-request reference, Triton vs torch.

* Torch backend (``kernels.torch_attn``) is checked in fp32 against ``naive_attention`` below,
  written independently: per request, gather the context K/V slot by slot (cached prefix from the
  cache as it was *before* this step, this step's tokens straight from ``key``/``value``), explicit
  causal softmax per head. So ``write_kv`` + ``attention`` are tested together.
* Triton kernels run under ``TRITON_INTERPRET=1`` in a *subprocess* (this file run as a script
  with ``--interpret-check``): the env var must be set before triton/kernel decoration, and other
  test modules in this process may already have imported triton. Sizes are tiny.
* ``@pytest.mark.gpu``: the compiled Triton path on CUDA (skipped without a device).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest
import torch

from kernels import AttentionMetadata, get_attention_backend, triton_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------------
# Case construction and the naive reference
# --------------------------------------------------------------------------------------------


@dataclass
class Case:
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    block_size: int
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    key: torch.Tensor  # [num_tokens, Hkv, D]
    value: torch.Tensor  # [num_tokens, Hkv, D]
    query: torch.Tensor  # [num_tokens, H, D]

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.query.shape[-1])

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> Case:
        def cv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype or t.dtype)

        return Case(
            self.query_lens,
            self.seq_lens,
            self.block_tables,
            self.slot_mapping,
            self.block_size,
            cv(self.k_cache),
            cv(self.v_cache),
            cv(self.key),
            cv(self.value),
            cv(self.query),
        )


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """Random caches (every slot finite random, i.e. 'stale' data outside the contexts), random
    non-contiguous block tables (some with an extra unused trailing block), fresh K/V/Q for the
    step's tokens. Example: seq_lens=[5], block_size=4 -> block_tables=[[7, 2]] or [[7, 2, 0]]."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    extra = [rng.randint(0, 1) for _ in seq_lens]
    num_blocks = sum(need) + sum(extra) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    block_tables, i = [], 0
    for n, e in zip(need, extra, strict=True):
        block_tables.append(perm[i : i + n + e])
        i += n + e
    slot_mapping = [
        bt[p // block_size] * block_size + p % block_size
        for bt, q, s in zip(block_tables, query_lens, seq_lens, strict=True)
        for p in range(s - q, s)
    ]
    n_tok = sum(query_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return Case(
        list(query_lens),
        list(seq_lens),
        block_tables,
        slot_mapping,
        block_size,
        rand(num_blocks, block_size, num_kv_heads, head_dim),
        rand(num_blocks, block_size, num_kv_heads, head_dim),
        rand(n_tok, num_kv_heads, head_dim),
        rand(n_tok, num_kv_heads, head_dim),
        rand(n_tok, num_heads, head_dim),
    )


def naive_attention(case: Case) -> torch.Tensor:  # [num_tokens, H, D] fp32
    """Per-request loop in fp32: context = cached prefix (from the pre-step cache) + step tokens."""
    h, d = case.query.shape[1:]
    hkv = case.k_cache.shape[2]
    group = h // hkv
    bs = case.block_size
    k_flat = case.k_cache.reshape(-1, hkv, d).float()
    v_flat = case.v_cache.reshape(-1, hkv, d).float()
    outs, t = [], 0
    for q, s, bt in zip(case.query_lens, case.seq_lens, case.block_tables, strict=True):
        ctx = s - q
        slots = [bt[p // bs] * bs + p % bs for p in range(ctx)]
        k = torch.cat([k_flat[slots], case.key[t : t + q].float()])  # [s, Hkv, D]
        v = torch.cat([v_flat[slots], case.value[t : t + q].float()])  # [s, Hkv, D]
        qq = case.query[t : t + q].float()  # [q, H, D]
        out = torch.empty(q, h, d)
        for head in range(h):
            kvh = head // group
            scores = qq[:, head] @ k[:, kvh].T * case.scale  # [q, s]
            for i in range(q):
                scores[i, ctx + i + 1 :] = float("-inf")
            out[:, head] = torch.softmax(scores, dim=-1) @ v[:, kvh]
        outs.append(out)
        t += q
    return torch.cat(outs)


def run_backend(backend_name: str, case: Case, device: str = "cpu") -> tuple[torch.Tensor, Case]:
    """write_kv then attention on copies of the case's caches; returns (output, case with caches)."""
    be = get_attention_backend(torch.device(device), backend_name)
    c = case.to(device)
    c.k_cache, c.v_cache = c.k_cache.clone(), c.v_cache.clone()
    md = be.build_metadata(
        c.query_lens, c.seq_lens, c.block_tables, c.slot_mapping, c.block_size, torch.device(device)
    )
    be.write_kv(c.key, c.value, c.k_cache, c.v_cache, md)
    out = be.attention(c.query, c.k_cache, c.v_cache, md, c.scale)
    return out, c


# name -> (query_lens, seq_lens, H, Hkv, D, block_size)
# q=1 decode (incl. seq_len 1), q=k+1 verification with context, long prefill chunk with a cached
# prefix, fresh prefill (q == seq_len), MHA / GQA / MQA, non-power-of-2 group and head_dim.
CASES: dict[str, tuple[list[int], list[int], int, int, int, int]] = {
    "mixed_gqa_bs16": ([1, 4, 37, 1, 5], [1, 30, 70, 130, 5], 8, 2, 32, 16),
    "decodes_around_prefill": ([1, 2, 1, 33, 1, 1], [20, 7, 3, 50, 64, 1], 8, 2, 16, 16),
    "mixed_mha_bs1": ([1, 4, 37, 1, 5], [1, 30, 70, 130, 5], 4, 4, 16, 1),
    "mixed_gqa_bs4_odd": ([3, 1, 12], [3, 45, 20], 6, 2, 24, 4),
    "decode_batch_gqa": ([1] * 6, [17, 3, 64, 1, 33, 16], 8, 4, 16, 16),
    "decode_single_mqa": ([1], [100], 4, 1, 32, 16),
    "decode_single_block_boundary": ([1], [64], 4, 2, 16, 16),
    "verify_uniform": ([4, 4, 4], [10, 4, 50], 8, 2, 16, 16),
    "prefill_single": ([40], [40], 4, 2, 16, 16),
    "chunked_prefill_single": ([20], [55], 4, 2, 16, 4),
    "prefill_pair_equal_mha": ([24, 24], [24, 24], 4, 4, 16, 16),  # causal from 0, two requests
}


def as_qkv_split(case: Case) -> Case:
    """Same values, but query/key/value are non-contiguous views of one fused qkv tensor, the way
    a model's qkv projection produces them."""
    n, h, d = case.query.shape
    hkv = case.key.shape[1]
    qkv = torch.cat([case.query.reshape(n, -1), case.key.reshape(n, -1), case.value.reshape(n, -1)], dim=-1)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    case.query, case.key, case.value = q.view(n, h, d), k.view(n, hkv, d), v.view(n, hkv, d)
    assert n == 1 or not case.query.is_contiguous()
    return case


def case_by_name(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Case:
    ql, sl, h, hkv, d, bs = CASES[name]
    return make_case(ql, sl, h, hkv, d, bs, seed=seed, dtype=dtype)


# --------------------------------------------------------------------------------------------
# Torch backend vs naive reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_backend_matches_naive_fp32(name: str) -> None:
    case = case_by_name(name)
    out, _ = run_backend("torch", case)
    assert out.shape == case.query.shape and out.dtype == torch.float32
    assert out.is_contiguous()
    torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["mixed_gqa_bs16", "decode_batch_gqa", "verify_uniform", "prefill_single", "prefill_pair_equal_mha"])
def test_torch_backend_non_contiguous_qkv(name: str) -> None:
    case = as_qkv_split(case_by_name(name))
    out, _ = run_backend("torch", case)
    torch.testing.assert_close(out, naive_attention(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_write_kv_places_tokens_at_slots(name: str) -> None:
    case = case_by_name(name)
    _, after = run_backend("torch", case)
    hkv, d = case.k_cache.shape[2:]
    expected_k = case.k_cache.reshape(-1, hkv, d).clone()
    expected_v = case.v_cache.reshape(-1, hkv, d).clone()
    expected_k[case.slot_mapping] = case.key
    expected_v[case.slot_mapping] = case.value
    assert torch.equal(after.k_cache.reshape(-1, hkv, d), expected_k)
    assert torch.equal(after.v_cache.reshape(-1, hkv, d), expected_v)


@pytest.mark.parametrize("backend_name", ["torch"])
def test_write_kv_skips_minus_one_slots(backend_name: str) -> None:
    be = get_attention_backend("cpu", backend_name)
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    key = torch.randn(5, 2, 8)
    value = torch.randn(5, 2, 8)
    slots = [9, -1, 0, -1, 5]  # slot 9 -> block 2, offset 1; slot 5 -> block 1, offset 1
    md = be.build_metadata([5], [5], [[0, 1]], slots, 4, torch.device("cpu"))
    be.write_kv(key, value, k_cache, v_cache, md)
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    for t, s in enumerate(slots):
        if s >= 0:
            assert torch.equal(flat_k[s], key[t]) and torch.equal(flat_v[s], value[t])
    untouched = [s for s in range(12) if s not in (9, 0, 5)]
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["mixed_gqa_bs16", "decode_batch_gqa", "verify_uniform", "prefill_single", "prefill_pair_equal_mha"])
def test_torch_backend_low_precision(name: str, dtype: torch.dtype) -> None:
    case = case_by_name(name, dtype=dtype)
    out, _ = run_backend("torch", case)
    assert out.dtype == dtype
    ref = naive_attention(case)  # fp32 math on the same (rounded) inputs
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_torch_metadata_contents() -> None:
    """The worked example of kernels/torch_attn.py's docstring."""
    be = get_attention_backend("cpu", "torch")
    md = be.build_metadata([1, 3], [6, 3], [[5, 1], [2]], [9, -1, 9, 10], 4, torch.device("cpu"))
    assert isinstance(md, AttentionMetadata)
    assert md.query_start_loc.tolist() == [0, 1, 4] and md.query_start_loc.dtype == torch.int32
    assert md.seq_lens.tolist() == [6, 3] and md.seq_lens.dtype == torch.int32
    assert md.block_tables.tolist() == [[5, 1], [2, 0]] and md.block_tables.dtype == torch.int32
    assert md.slot_mapping.dtype == torch.int64
    assert (md.max_query_len, md.max_seq_len) == (3, 6)
    ex = md.extras
    assert ex["write_idx"].tolist() == [0, 2, 3]
    (g,) = ex["groups"]  # 2 * 3 padded rows <= 2 * 4 tokens: one group
    assert g["token_idx"] is None
    assert g["gather_idx"].tolist() == [5, 1, 2, 0]
    assert g["pad_idx"].tolist() == [0, 3, 4, 5]
    mask = g["attn_mask"].int()
    assert mask.shape == (2, 1, 3, 6)
    assert mask[0, 0].tolist() == [[1, 1, 1, 1, 1, 1]] * 3
    assert mask[1, 0].tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]


def test_torch_fast_paths() -> None:
    be = get_attention_backend("cpu", "torch")
    # Single decode request: no mask, no query padding, no write filtering.
    for seq_len in (32, 27):
        md = be.build_metadata([1], [seq_len], [[3, 1]], [16 + seq_len - 17], 16, torch.device("cpu"))
        (g,) = md.extras["groups"]
        assert g["attn_mask"] is None and g["pad_idx"] is None and g["token_idx"] is None
        assert md.extras["write_idx"] is None
    # Batch decode with equal seq_lens: no mask either.
    md = be.build_metadata([1, 1], [20, 20], [[3, 1], [0, 2]], [19, 35], 16, "cpu")
    (g,) = md.extras["groups"]
    assert g["attn_mask"] is None
    # Uniform verification: reshape instead of padding, mask still needed.
    md = be.build_metadata([3, 3], [5, 9], [[0], [1]], list(range(2, 5)) + list(range(22, 25)), 16, "cpu")
    (g,) = md.extras["groups"]
    assert g["pad_idx"] is None and g["attn_mask"] is not None
    # A new prompt's only chunk (or several of one length): causal attention without a mask;
    # a chunk after cached tokens, a tree or unequal lengths keep the mask.
    for query_lens, seq_lens, causal in (([40], [40], True), ([24, 24], [24, 24], True), ([20], [55], False),
                                         ([24, 20], [24, 20], False), ([1], [1], False)):
        slots = [s for q, n in zip(query_lens, seq_lens, strict=True) for s in range(n - q, n)]
        md = be.build_metadata(query_lens, seq_lens, [[0, 1, 2, 3]] * len(query_lens), slots, 16, "cpu")
        assert all(g["causal"] == causal for g in md.extras["groups"]), (query_lens, seq_lens)
        if causal:
            assert all(g["attn_mask"] is None for g in md.extras["groups"])
    tree = torch.ones(3, 3, dtype=torch.bool).tril()
    md = be.build_metadata([3], [3], [[0]], [0, 1, 2], 16, "cpu", tree_masks=[tree])
    assert not md.extras["groups"][0]["causal"]


def test_torch_groups_keep_padding_bounded() -> None:
    """A prefill chunk next to decodes gets its own group instead of padding every request to
    its length; the groups' tokens partition the step's tokens."""
    from kernels.torch_attn import group_requests

    assert group_requests([1] * 16) == [list(range(16))]
    assert group_requests([5, 5, 5]) == [[0, 1, 2]]
    assert group_requests([1, 4, 37, 1, 5]) == [[0, 1, 3, 4], [2]]
    assert group_requests([1] * 15 + [128]) == [list(range(15)), [15]]
    assert group_requests([128, 100]) == [[0, 1]]  # 2 * 128 <= 2 * 228
    be = get_attention_backend("cpu", "torch")
    qls, sls = [1, 1, 40, 1], [9, 30, 40, 12]
    tables = [[0], [1, 2], [3, 4, 5], [6]]
    slots = [8, 45, *range(48, 88), 107]
    md = be.build_metadata(qls, sls, tables, slots, 16, "cpu")
    groups = md.extras["groups"]
    assert [g["num_reqs"] for g in groups] == [3, 1]
    assert [g["max_query_len"] for g in groups] == [1, 40]
    assert sorted(torch.cat([g["token_idx"] for g in groups]).tolist()) == list(range(43))


def test_get_attention_backend_selection_and_validation() -> None:
    assert get_attention_backend(torch.device("cpu")).name == "torch"
    assert get_attention_backend("cpu", "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("cpu", "flash")
    be = get_attention_backend("cpu", "torch")
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        be.build_metadata([4], [3], [[0]], [0, 1, 2, 3], 16, "cpu")
    with pytest.raises(ValueError, match="too few"):
        be.build_metadata([1], [40], [[0, 1]], [5], 16, "cpu")
    with pytest.raises(ValueError, match="slot_mapping"):
        be.build_metadata([2], [2], [[0]], [0], 16, "cpu")


def test_metadata_is_reusable_across_layers() -> None:
    """One metadata, several 'layers' (fresh caches and activations): each matches its reference."""
    be = get_attention_backend("cpu", "torch")
    base = case_by_name("mixed_gqa_bs4_odd")
    md = be.build_metadata(
        base.query_lens, base.seq_lens, base.block_tables, base.slot_mapping, base.block_size, "cpu"
    )
    for layer in range(3):
        gen = torch.Generator().manual_seed(100 + layer)
        c = Case(
            base.query_lens,
            base.seq_lens,
            base.block_tables,
            base.slot_mapping,
            base.block_size,
            *(
                torch.randn(t.shape, generator=gen)
                for t in (base.k_cache, base.v_cache, base.key, base.value)
            ),
            torch.randn(base.query.shape, generator=gen),
        )
        kc, vc = c.k_cache.clone(), c.v_cache.clone()
        be.write_kv(c.key, c.value, kc, vc, md)
        out = be.attention(c.query, kc, vc, md, c.scale)
        torch.testing.assert_close(out, naive_attention(c), atol=2e-5, rtol=2e-5)


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:  # pragma: no cover - hypothesis is a dev dependency
    HAVE_HYPOTHESIS = False

if HAVE_HYPOTHESIS:

    @st.composite
    def random_batches(draw: st.DrawFn) -> Case:
        b = draw(st.integers(1, 4))
        query_lens = [draw(st.integers(1, 9)) for _ in range(b)]
        seq_lens = [q + draw(st.integers(0, 40)) for q in query_lens]
        h, hkv = draw(st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 2), (6, 3)]))
        d = draw(st.sampled_from([8, 16, 20]))
        bs = draw(st.sampled_from([1, 4, 16]))
        return make_case(query_lens, seq_lens, h, hkv, d, bs, seed=draw(st.integers(0, 2**16)))

    @settings(max_examples=40, deadline=None)
    @given(case=random_batches())
    def test_torch_backend_random_batches(case: Case) -> None:
        out, _ = run_backend("torch", case)
        torch.testing.assert_close(out, naive_attention(case), atol=3e-5, rtol=3e-5)


# --------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (subprocess) and compiled on CUDA
# --------------------------------------------------------------------------------------------

# (case name, dtype name) run by the interpreter subprocess
INTERPRET_CASES = [(name, "float32") for name in sorted(CASES)] + [
    ("mixed_gqa_bs16", "bfloat16"),
    ("verify_uniform", "float16"),
]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compare_triton_to_torch(name: str, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """Run both backends on one case; max |diff| of outputs and whether caches match exactly."""
    case = as_qkv_split(case_by_name(name, dtype=dtype, seed=seed))
    # Every third token's slot is -1: both backends must skip writing it.
    case.slot_mapping = [-1 if t % 3 == 2 else s for t, s in enumerate(case.slot_mapping)]
    be_t = get_attention_backend(torch.device(device), "triton")
    be_r = get_attention_backend(torch.device(device), "torch")
    c = case if device == "cpu" else as_qkv_split(case.to(device))
    caches, mds = {}, {}
    for be in (be_t, be_r):
        kc, vc = c.k_cache.clone(), c.v_cache.clone()
        md = be.build_metadata(c.query_lens, c.seq_lens, c.block_tables, c.slot_mapping, c.block_size, device)
        be.write_kv(c.key, c.value, kc, vc, md)
        caches[be.name], mds[be.name] = (kc, vc), md
    # Attention of both backends on the same (torch-written) caches.
    kc, vc = caches["torch"]
    out_t = be_t.attention(c.query, kc, vc, mds["triton"], c.scale)
    out_r = be_r.attention(c.query, kc, vc, mds["torch"], c.scale)
    return {
        "write_equal": bool(
            torch.equal(caches["triton"][0], caches["torch"][0])
            and torch.equal(caches["triton"][1], caches["torch"][1])
        ),
        "max_err": float((out_t.float() - out_r.float()).abs().max()),
        "nan": bool(torch.isnan(out_t).any()),
        "shape_ok": out_t.shape == c.query.shape and out_t.dtype == dtype,
    }


def _tolerance(dtype_name: str) -> float:
    return {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}[dtype_name]


def _interpret_main() -> None:
    """Subprocess entry: TRITON_INTERPRET=1 must already be set. Prints one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for name, dtype_name in INTERPRET_CASES:
        results[f"{name}/{dtype_name}"] = compare_triton_to_torch(name, _DTYPES[dtype_name], "cpu")
    print("RESULTS " + json.dumps(results))


def run_triton_interpreter(script: str, timeout: int = 300, parts: tuple[str, ...] = ()) -> dict:
    """Run `python script --interpret-check [part]` with TRITON_INTERPRET=1 in a subprocess (the
    variable must be set before triton is imported, and this process may have imported it
    already) and return the JSON the script prints on its last line starting with "RESULTS ".
    With `parts`, one subprocess per part, all at once (the interpreter is one Python thread: a
    2-core host runs two side by side), their results merged."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results: dict = {}
    with contextlib.ExitStack() as stack:  # output to files: a full pipe would stall a process
        runs = []
        for part in parts or ("",):
            out, err = (stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
            runs.append((subprocess.Popen([sys.executable, script, "--interpret-check", *([part] if part else [])],
                                          cwd=ROOT, env=env, stdout=out, stderr=err, text=True), out, err))
        deadline = time.monotonic() + timeout
        try:
            for proc, out, err in runs:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
                out.seek(0)
                err.seek(0)
                stdout, stderr = out.read(), err.read()
                lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULTS ")]
                assert proc.returncode == 0 and lines, f"interpreter run failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
                results.update(json.loads(lines[-1][len("RESULTS ") :]))
        finally:
            for proc, _, _ in runs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return results


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    if not triton_available():
        pytest.skip("triton not importable")
    return run_triton_interpreter(os.path.abspath(__file__))


@pytest.mark.parametrize("name,dtype_name", INTERPRET_CASES)
@pytest.mark.slow  # make test-fast skips it
def test_triton_interpreter_matches_torch(interpreter_results: dict, name: str, dtype_name: str) -> None:
    r = interpreter_results[f"{name}/{dtype_name}"]
    assert r["write_equal"], "triton write_kv differs from torch write_kv"
    assert r["shape_ok"] and not r["nan"]
    assert r["max_err"] <= _tolerance(dtype_name), r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_compiled_cuda_matches_torch(name: str, dtype_name: str) -> None:
    assert get_attention_backend(torch.device("cuda")).name == "triton"
    r = compare_triton_to_torch(name, _DTYPES[dtype_name], "cuda")
    assert r["write_equal"] and r["shape_ok"] and not r["nan"]
    assert r["max_err"] <= _tolerance(dtype_name), r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_compiled_cuda_large_vs_naive(dtype: torch.dtype) -> None:
    """Engine-sized shapes: batch-16 decode and a long prefill chunk, vs the fp32 naive loop."""
    for ql, sl in (([1] * 16, [512 - 7 * i for i in range(16)]), ([300, 1], [700, 900])):
        case = make_case(ql, sl, 32, 8, 128, 16, seed=1, dtype=dtype)
        out, _ = run_backend("triton", case, "cuda")
        torch.testing.assert_close(out.float().cpu(), naive_attention(case), atol=3e-2, rtol=3e-2)


if __name__ == "__main__" and "--interpret-check" in sys.argv:
    _interpret_main()
