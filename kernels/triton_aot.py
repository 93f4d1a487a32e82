"""Ahead-of-time compilation of the Triton kernels for sm_80 and sm_90, without a GPU.

Each launch the engine can make (dtype x model shape x step kind) is built by the same helpers
``write_kv_cache`` / ``paged_attention`` / ``rows_attention`` launch with (``_write_kv_launch``,
``_paged_attn_launch``, steps of more than one query token also with a tree mask, ``HAS_TREE``;
``_rows_attn_launch``, the exact modes' row-exact attention),
on meta tensors laid out as the model produces them, then specialized by Triton's own JIT binder
(integer ``== 1`` -> constexpr, ``% 16 == 0`` and 16-byte aligned pointers -> divisibility hints),
so each compile here is the compile a real launch triggers. ``triton.compile`` runs the whole
pipeline down to a cubin with the ptxas that ships with triton.

Registers and spills come from ptxas's own ``-v`` report of that compile (triton's
``TRITON_DUMP_PTXAS_LOG`` knob; ``CompiledKernel.n_regs``/``n_spills`` are only filled by the CUDA
driver when the cubin is loaded, which needs a GPU). The register count is the cubin's REG
attribute the driver's ``n_regs`` reads (same numbers as ``cuobjdump -res-usage``); the driver's
``n_spills`` (local bytes / 4) would read 0 for a kernel whose spills live in its stack frame, so
spills are ptxas's spill store/load bytes. Shared memory is the dynamic shared memory triton
requests at launch (``metadata.shared``) plus ptxas's static ``smem``, checked against the opt-in
maximum per block (which already excludes the 1 KB sm_90 reserves per block).

CLI: ``python -m kernels.triton_aot [--targets 80,90] [--json OUT]`` prints one row per config.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import itertools
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, MockTensor, create_function_from_signature

from kernels import triton_attn

ROOT = Path(__file__).resolve().parents[1]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Typical Llama-family shapes: head_dim x GQA group size G = num_heads / num_kv_heads.
LLAMA_HEAD_DIMS = (64, 128)
LLAMA_GROUP_SIZES = (1, 2, 4, 8)
LLAMA_NUM_KV_HEADS = 8
# (num_heads, num_kv_heads, head_dim) of the tiny models the tests run (tests/helpers.py TINY,
# tests/test_kernels.py CASES); tests/test_triton_aot.py checks this still covers them.
TEST_SHAPES = ((4, 2, 16), (8, 2, 32), (8, 2, 16), (4, 4, 16), (6, 2, 24), (8, 4, 16), (4, 1, 32))
# A decode-like step (max_query_len 1: 16-row tiles), a verify step (16 query tokens: 16-row tiles
# when G == 1, else the prefill tile) and a prefill chunk (64-row tiles). Steps of more than one
# query token are also compiled with a tree mask (HAS_TREE).
MAX_QUERY_LENS = (1, 16, 2048)
# Block-table width (the kernel's stride_bt): the JIT specializes 1 (constexpr) and multiples of
# 16 separately from other widths; 7 is the general case, the other two only change index math.
BLOCK_TABLE_WIDTHS = (7,)
# Max shared memory per block (opt-in), bytes, and registers per thread.
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
MAX_REGISTERS = 255

_TORCH_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    source: str

    @property
    def label(self) -> str:
        return f"{self.num_heads}/{self.num_kv_heads}/{self.head_dim}"


def shipped_shapes(models_dir: Path = ROOT / "models") -> list[Shape]:
    """Attention shapes of the shipped models (every models/*/config.json with attention heads)."""
    shapes = []
    for path in sorted(models_dir.glob("*/config.json")):
        cfg = json.loads(path.read_text())
        if "num_attention_heads" not in cfg:
            continue  # e.g. MTP/Medusa heads: no attention
        h = cfg["num_attention_heads"]
        hkv = cfg.get("num_key_value_heads", h)
        d = cfg.get("head_dim") or cfg["hidden_size"] // h
        shapes.append(Shape(h, hkv, d, f"models/{path.parent.name}"))
    return shapes


def default_shapes() -> list[Shape]:
    """Shipped models, typical Llama shapes (head_dim 64/128, G 1/2/4/8) and the test models."""
    llama = [
        Shape(g * LLAMA_NUM_KV_HEADS, LLAMA_NUM_KV_HEADS, d, "llama")
        for d in LLAMA_HEAD_DIMS
        for g in LLAMA_GROUP_SIZES
    ]
    tests = [Shape(h, hkv, d, "tests") for h, hkv, d in TEST_SHAPES]
    return shipped_shapes() + llama + tests


class _PointerArg(MockTensor):
    """What the JIT's specialization sees of a tensor argument: its dtype and its address modulo
    16 (``storage_offset`` bytes past an allocation, which torch aligns to far more than 16)."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__(t.dtype, list(t.shape))
        self._address = t.storage_offset() * t.element_size()

    def data_ptr(self) -> int:  # type: ignore[override]
        return self._address


@dataclass(frozen=True)
class Launch:
    """One engine launch: kernel, runtime args (tensors as ``_PointerArg``) and constexprs."""

    kernel: JITFunction
    dtype: torch.dtype
    args: tuple
    constexprs: dict
    shape: str  # "H/Hkv/D (source)", plus the step kind for attention


def _engine_launches(
    shape: Shape, dtype: torch.dtype, block_size: int, max_query_len: int, block_table_width: int
) -> list[Launch]:
    """The write-KV and attention launches of one layer's step, on meta tensors laid out as
    ``engine/models/llama.py`` makes them: q and k fresh after RoPE, v a view of the fused qkv."""
    h, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    num_reqs, num_tokens, num_blocks = 2, 2 * max_query_len, 64
    meta = dict(dtype=dtype, device="meta")
    qkv = torch.empty(num_tokens, (h + 2 * hkv) * d, **meta)
    v = qkv[:, (h + hkv) * d :].view(num_tokens, hkv, d)  # [num_tokens, Hkv, D]
    q = torch.empty(num_tokens, h, d, **meta)
    k = torch.empty(num_tokens, hkv, d, **meta)
    k_cache = torch.empty(num_blocks, block_size, hkv, d, **meta)
    v_cache = torch.empty(num_blocks, block_size, hkv, d, **meta)
    out = torch.empty(num_tokens, h, d, **meta)
    slot_mapping = torch.empty(num_tokens, dtype=torch.int64, device="meta")
    query_start_loc = torch.empty(num_reqs + 1, dtype=torch.int32, device="meta")
    seq_lens = torch.empty(num_reqs, dtype=torch.int32, device="meta")
    block_tables = torch.empty(num_reqs, block_table_width, dtype=torch.int32, device="meta")
    # tree masks as kernels.pack_tree_masks makes them: lengths, row offsets, one int64 of bits a row
    tree = (
        torch.empty(num_reqs, dtype=torch.int32, device="meta"),
        torch.empty(num_reqs, dtype=torch.int32, device="meta"),
        torch.empty(num_tokens, dtype=torch.int64, device="meta"),
    )

    def wrap(args: tuple) -> tuple:
        return tuple(_PointerArg(a) if isinstance(a, torch.Tensor) else a for a in args)

    label = f"{shape.label} ({shape.source})"
    _, w_args, w_const = triton_attn._write_kv_launch(k, v, k_cache, v_cache, slot_mapping)
    step = "decode" if max_query_len == 1 else "verify" if max_query_len <= 64 else "prefill"
    launches = [Launch(triton_attn._write_kv_kernel, dtype, wrap(w_args), w_const, label)]
    for with_tree in (False, True) if max_query_len > 1 else (False,):
        _, a_args, a_const = triton_attn._paged_attn_launch(
            q,
            k_cache,
            v_cache,
            out,
            query_start_loc,
            seq_lens,
            block_tables,
            max_query_len,
            d**-0.5,
            is_compiled=True,
            tree=tree if with_tree else None,
        )
        kind = f"{step}+tree" if with_tree else step
        launches.append(Launch(triton_attn._paged_attn_kernel, dtype, wrap(a_args), a_const, f"{label} {kind}"))
    if max_query_len <= 64:  # the exact modes' steps (<= EXACT_ROWS tokens) through the row-exact kernel
        rows = (
            *(torch.empty(num_tokens, dtype=torch.int32, device="meta") for _ in range(3)),
            torch.empty(num_tokens, triton_attn.MAX_TREE_KEYS, dtype=torch.int64, device="meta"),
        )
        _, r_args, r_const = triton_attn._rows_attn_launch(q, k_cache, v_cache, out, block_tables, rows, d**-0.5,
                                                           is_compiled=True)
        launches.append(Launch(triton_attn._rows_attn_kernel, dtype, wrap(r_args), r_const, f"{label} {step} rows"))
    return launches


@dataclass
class AotConfig:
    """One distinct compile for one target: what ``triton.compile`` gets."""

    kernel: JITFunction
    target: GPUTarget
    dtype: torch.dtype
    signature: dict
    constexprs: dict  # {(arg index,): value}
    attrs: dict
    options: object  # the backend's options dataclass (CUDAOptions)
    shapes: list[str] = field(default_factory=list)  # the launches that compile to this

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def named_constexprs(self) -> dict:
        return {self.kernel.arg_names[i]: v for (i,), v in self.constexprs.items()}


@functools.cache
def _binder(kernel: JITFunction, target: GPUTarget) -> tuple:
    backend = make_backend(target)
    return backend, create_function_from_signature(kernel.signature, kernel.params, backend)


def _specialize(launch: Launch, target: GPUTarget) -> AotConfig:
    """Bind a launch's arguments the way ``JITFunction.run`` does for ``target``."""
    kernel = launch.kernel
    backend, binder = _binder(kernel, target)
    kwargs = dict(
        launch.constexprs,
        debug=kernel.debug or triton.knobs.runtime.debug,
        instrumentation_mode=triton.knobs.compilation.instrumentation_mode,
        fpsan_homomorphic_casts=triton.knobs.compilation.fpsan_homomorphic_casts,
    )
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    return AotConfig(kernel, target, launch.dtype, signature, constexprs, attrs, options)


def launch_configs(
    targets: tuple[int, ...] = (80, 90),
    shapes: list[Shape] | None = None,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    block_sizes: tuple[int, ...] = (16,),
    max_query_lens: tuple[int, ...] = MAX_QUERY_LENS,
    block_table_widths: tuple[int, ...] = BLOCK_TABLE_WIDTHS,
) -> list[AotConfig]:
    """Distinct compiles per target (launches that specialize identically share one config).
    ``block_sizes`` defaults to the engine's default ``CacheConfig.block_size``."""
    configs: dict[tuple, AotConfig] = {}
    shapes = default_shapes() if shapes is None else shapes
    axes = itertools.product(shapes, dtypes, block_sizes, max_query_lens, block_table_widths, targets)
    for shape, dtype, block_size, max_query_len, width, cap in axes:
        for launch in _engine_launches(shape, dtype, block_size, max_query_len, width):
            cfg = _specialize(launch, GPUTarget("cuda", cap, 32))
            key = tuple(
                repr(x) for x in (cfg.name, cap, cfg.signature, cfg.constexprs, cfg.attrs, cfg.options)
            )
            cfg = configs.setdefault(key, cfg)
            if launch.shape not in cfg.shapes:
                cfg.shapes.append(launch.shape)
    return sorted(configs.values(), key=lambda c: (c.target.arch, c.name))


@dataclass
class AotResult:
    kernel: str
    target: str  # "sm_80"
    dtype: str
    constexprs: dict
    num_warps: int
    num_stages: int
    ok: bool  # the whole pipeline, ptxas included, produced a cubin
    error: str | None
    registers: int | None  # per thread, ptxas -v
    spill_store_bytes: int | None  # ptxas -v
    spill_load_bytes: int | None  # ptxas -v
    stack_bytes: int | None  # ptxas -v stack frame
    shared_bytes: int | None  # dynamic shared memory triton requests at launch
    static_smem_bytes: int | None  # ptxas -v smem
    smem_limit_bytes: int
    compile_s: float
    shapes: list[str]
    ptxas: str = ""  # path and CUDA release of the ptxas that ran
    register_source: str = "ptxas -v (triton's compile, TRITON_DUMP_PTXAS_LOG)"

    @property
    def smem_bytes(self) -> int | None:
        if self.shared_bytes is None:
            return None
        return self.shared_bytes + (self.static_smem_bytes or 0)

    @property
    def spills(self) -> bool:
        return bool(self.spill_store_bytes or self.spill_load_bytes)


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _parse_ptxas_log(log: str) -> dict:
    """Numbers from ptxas -v (one entry function). Example line pair:
    ``0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads`` and
    ``ptxas info    : Used 96 registers, used 1 barriers, 16 bytes smem, 400 bytes cmem[0]``."""
    regs, frame, smem = _PTXAS_REGS.search(log), _PTXAS_FRAME.search(log), _PTXAS_SMEM.search(log)
    if regs is None or frame is None:
        raise ValueError(f"no register/stack report in the ptxas log:\n{log}")
    return dict(
        registers=int(regs.group(1)),
        stack_bytes=int(frame.group(1)),
        spill_store_bytes=int(frame.group(2)),
        spill_load_bytes=int(frame.group(3)),
        static_smem_bytes=int(smem.group(1)) if smem else 0,
    )


def compile_config(cfg: AotConfig) -> AotResult:
    """Compile one config to a cubin (ptxas always runs: the cache is bypassed) and report."""
    tool = get_ptxas(cfg.target.arch)  # triton's bundled ptxas for this arch; RuntimeError if missing
    src = ASTSource(cfg.kernel, cfg.signature, cfg.constexprs, cfg.attrs)
    log = io.StringIO()
    numbers: dict = {}
    error = None
    shared = None
    start = time.perf_counter()
    with triton.knobs.compilation.scope(), triton.knobs.nvidia.scope():
        triton.knobs.compilation.always_compile = True
        triton.knobs.nvidia.dump_ptxas_log = True
        try:
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(src, target=cfg.target, options=cfg.options.__dict__)
            shared = compiled.metadata.shared
            numbers = _parse_ptxas_log(log.getvalue())
        except Exception as e:  # a failed compile is a result to report, not a crash
            error = f"{type(e).__name__}: {e}"
    elapsed = time.perf_counter() - start
    return AotResult(
        kernel=cfg.name,
        target=f"sm_{cfg.target.arch}",
        dtype=_TORCH_DTYPE_NAMES[cfg.dtype],
        constexprs=cfg.named_constexprs(),
        num_warps=cfg.options.num_warps,
        num_stages=cfg.options.num_stages,
        ok=error is None,
        error=error,
        registers=numbers.get("registers"),
        spill_store_bytes=numbers.get("spill_store_bytes"),
        spill_load_bytes=numbers.get("spill_load_bytes"),
        stack_bytes=numbers.get("stack_bytes"),
        shared_bytes=shared,
        static_smem_bytes=numbers.get("static_smem_bytes"),
        smem_limit_bytes=SMEM_LIMIT[cfg.target.arch],
        compile_s=elapsed,
        shapes=list(cfg.shapes),
        ptxas=f"{tool.path} ({tool.version})",
    )


def _short_constexprs(r: AotResult) -> str:
    skip = {"UPCAST"}
    abbrev = {
        "BLOCK_SIZE": "BS",
        "BLOCK_Q": "BQ",
        "BLOCK_M": "BM",
        "BLOCK_N": "BN",
        "BLOCK_D": "BD",
        "BLOCK_H": "BH",
        "DOT_PRECISION": "prec",
        "num_kv_heads": "Hkv",
    }
    return " ".join(f"{abbrev.get(k, k)}={v}" for k, v in r.constexprs.items() if k not in skip)


def format_table(results: list[AotResult]) -> str:
    head = (
        f"{'kernel':<18} {'target':<6} {'dtype':<5} {'constexprs':<58} {'w/s':<4} {'regs':>4} "
        f"{'spill':>5} {'smem':>6} {'s':>5}  shapes"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        status = "" if r.ok else f"  FAILED: {r.error.splitlines()[0] if r.error else ''}"
        spill = "-" if r.spill_store_bytes is None else f"{r.spill_store_bytes + r.spill_load_bytes}"
        lines.append(
            f"{r.kernel:<18} {r.target:<6} {r.dtype:<5} {_short_constexprs(r):<58} "
            f"{r.num_warps}/{r.num_stages:<2} {r.registers if r.registers is not None else '-':>4} "
            f"{spill:>5} {r.smem_bytes if r.smem_bytes is not None else '-':>6} {r.compile_s:>5.1f}  "
            f"{'; '.join(r.shapes)}{status}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", default="80,90", help="compute capabilities, e.g. 80,90")
    parser.add_argument("--block-sizes", default="16", help="KV-cache block sizes (engine default 16)")
    parser.add_argument(
        "--block-table-widths",
        default=",".join(map(str, BLOCK_TABLE_WIDTHS)),
        help="block-table widths; 1 and multiples of 16 are separate JIT specializations",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    def ints(s: str) -> tuple[int, ...]:
        return tuple(int(x) for x in s.split(","))

    targets = ints(args.targets)
    unknown = [t for t in targets if t not in SMEM_LIMIT]
    if unknown:
        parser.error(f"--targets: unsupported {unknown}; known: {sorted(SMEM_LIMIT)}")
    start = time.perf_counter()
    configs = launch_configs(
        targets, block_sizes=ints(args.block_sizes), block_table_widths=ints(args.block_table_widths)
    )
    results = []
    for i, cfg in enumerate(configs):
        results.append(compile_config(cfg))
        print(
            f"[{i + 1}/{len(configs)}] {cfg.name} sm_{cfg.target.arch} {results[-1].compile_s:.1f}s",
            file=sys.stderr,
        )
    total = time.perf_counter() - start
    print(format_table(results))
    failed = [r for r in results if not r.ok]
    over = [
        r
        for r in results
        if r.ok and (r.registers > MAX_REGISTERS or r.spills or r.smem_bytes > r.smem_limit_bytes)
    ]
    print(
        f"\n{len(results)} configs, {len(failed)} failed, {len(over)} with spills or over a limit, "
        f"{total:.0f} s. Registers and spills: ptxas -v; smem: triton's launch request + static."
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"total_s": total, "results": [asdict(r) | {"smem_bytes": r.smem_bytes} for r in results]},
                indent=1,
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
