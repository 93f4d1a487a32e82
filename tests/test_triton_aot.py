"""Triton kernels compile ahead of time for sm_80 and sm_90 on this machine, no GPU needed.

The interpreter tests (test_kernels.py) check what the kernels compute; this checks that the
launches the engine makes get through triton's whole pipeline and the bundled ptxas for both
targets, within 255 registers per thread and the target's shared memory per block, and without
register spills, except where they are known (below). A representative subset runs here (the
shipped target model's shape in its dtype, decode and prefill, with and without a tree mask, the
row-exact kernel of the exact modes, plus the
biggest tiles: head_dim 128 prefill in fp16 and fp32, and with a tree mask in fp16, ~30 s); the full
set (384 configs, ~7 min) is ``python -m kernels.triton_aot``.

Known spills (ptxas 13.4, triton 3.9): fp32 inputs take the "ieee" dot, which is FMA code rather
than tensor-core MMA, and at the 64-row prefill tile it does not fit in registers: ~1.3 KB of spill
traffic per thread at head_dim 64 and, at head_dim 128, ptxas settles for 32 registers with ~7 KB of
stack (37 KB spill traffic) on sm_80. Every 16-bit config and every 16-row (decode) tile is
spill-free. Measured fixes at head_dim 128: BLOCK_M 32 (201 registers, no spills on sm_80, 32 B on
sm_90) or num_warps 8 (no spills on sm_90, 128 B on sm_80).
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_aot  # noqa: E402

TARGETS = (80, 90)


def _missing_ptxas() -> str | None:
    for arch in TARGETS:
        try:
            triton_aot.get_ptxas(arch)
        except RuntimeError as e:
            return f"triton's ptxas for sm_{arch} is missing: {e}"
    return None


def _subset() -> list[triton_aot.AotConfig]:
    target_model = [s for s in triton_aot.shipped_shapes() if s.source == "models/target"]
    big = [triton_aot.Shape(32, 8, 128, "llama")]
    configs = triton_aot.launch_configs(TARGETS, shapes=target_model, dtypes=(torch.bfloat16,))
    configs += [
        c
        for c in triton_aot.launch_configs(
            TARGETS, shapes=big, dtypes=(torch.float16, torch.float32), max_query_lens=(2048,)
        )
        if c.name == "_paged_attn_kernel" and not (c.dtype == torch.float32 and c.named_constexprs()["HAS_TREE"])
    ]
    return configs


SUBSET = _subset()


def _id(c: triton_aot.AotConfig) -> str:
    k = c.named_constexprs()
    tile = f"M{k['BLOCK_M']}-D{k['BLOCK_D']}" if "BLOCK_M" in k else f"H{k['BLOCK_H']}-D{k['BLOCK_D']}"
    return f"sm_{c.target.arch}-{c.name.strip('_')}-{triton_aot._TORCH_DTYPE_NAMES[c.dtype]}-{tile}"


def _spills_known(c: triton_aot.AotConfig) -> bool:
    """fp32 (FMA dot) at the 64-row prefill tile: see the module docstring."""
    return c.dtype == torch.float32 and c.named_constexprs().get("BLOCK_M") == 64


@pytest.mark.skipif(_missing_ptxas() is not None, reason=_missing_ptxas() or "")
@pytest.mark.parametrize("config", SUBSET, ids=_id)
@pytest.mark.slow  # make test-fast skips it
def test_compiles_within_limits(config: triton_aot.AotConfig) -> None:
    r = triton_aot.compile_config(config)
    assert r.ok, r.error
    assert r.registers is not None and 0 < r.registers <= triton_aot.MAX_REGISTERS, r
    if not _spills_known(config):
        assert not r.spills, f"{r.spill_store_bytes} B spill stores, {r.spill_load_bytes} B spill loads: {r}"
    assert r.smem_bytes is not None and 0 <= r.smem_bytes <= r.smem_limit_bytes, r


def test_subset_covers_both_targets_and_kernels() -> None:
    assert {(c.target.arch, c.name) for c in SUBSET} == {
        (arch, name) for arch in TARGETS for name in ("_write_kv_kernel", "_paged_attn_kernel", "_rows_attn_kernel")
    }
    # decode (16-row tiles) and prefill (64-row tiles) of the shipped model, both targets
    rows = {(c.target.arch, c.named_constexprs().get("BLOCK_M")) for c in SUBSET}
    assert {(arch, m) for arch in TARGETS for m in (16, 64)} <= rows
    # and the tree-mask variant of the kernel (speculative tree verification)
    assert {c.target.arch for c in SUBSET if c.named_constexprs().get("HAS_TREE")} == set(TARGETS)


def test_enumeration_covers_the_engine_and_test_shapes() -> None:
    from helpers import TINY
    from test_kernels import CASES

    from engine.config import CacheConfig

    default_bs = inspect.signature(triton_aot.launch_configs).parameters["block_sizes"].default
    assert default_bs == (CacheConfig().block_size,)
    h, hkv = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    tiny = (h, hkv, TINY["hidden_size"] // h)
    case_shapes = {(h, hkv, d) for _, _, h, hkv, d, _ in CASES.values()}
    assert case_shapes | {tiny} <= set(triton_aot.TEST_SHAPES)
    shipped = {s.source for s in triton_aot.shipped_shapes()}
    assert "models/target" in shipped


def test_parse_ptxas_log() -> None:
    log = (
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function '_paged_attn_kernel' for 'sm_80'\n"
        "ptxas info    : Function properties for _paged_attn_kernel\n"
        "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 96 registers, used 1 barriers, 16 bytes smem, 400 bytes cmem[0]\n"
    )
    assert triton_aot._parse_ptxas_log(log) == dict(
        registers=96, stack_bytes=8, spill_store_bytes=4, spill_load_bytes=12, static_smem_bytes=16
    )
    with pytest.raises(ValueError, match="no register"):
        triton_aot._parse_ptxas_log("ptxas info    : 0 bytes gmem\n")
