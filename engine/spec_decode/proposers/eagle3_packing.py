"""How an EAGLE-3 head's matrices are stored for the fused CPU row kernels.

Each matrix (the midlayer's four, the LM head's, fc's) is packed in the head's dtype on 2 MiB
pages. `SpeculativeConfig.draft_weights` "int8" or "int4" adds a quantized copy of each, which
products of up to `HeadPacking.quant_max_rows` rows take (a drafting step's few rows); the rest
take the head's dtype. Quantized copies need the row kernels: on a CPU with AVX512-VNNI in the
int8 / int4 layouts (a scale per row / per group of 32 inputs), elsewhere (AVX2 with F16C) as
GGUF Q8_0 / Q4_1 blocks run by the GGUF products (a scale, and for Q4_1 a minimum, per group of
32 inputs), the kernels a GGUF target's own blocks take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Products of up to this many rows take a quantized head's int8 or int4 copies where the bfloat16
# ones run on AMX tiles: past a few rows the int8 products are bound by their multiply-adds, the
# bfloat16 ones on AMX tiles are not. Without AMX every product takes the quantized copies.
QUANT_MAX_ROWS = 8
# what draft_weights='auto' packs a bfloat16 head as where the CPU row kernels run it
AUTO_DRAFT_WEIGHTS = "int4"
# the midlayer's packed matrices, as `Eagle3Layer.row_weights` names them
LAYER_MATRICES = ("w_qkv", "w_o", "w_gate_up", "w_down")
INT4_GROUP = 32  # int4 products and GGUF blocks read a matrix's inputs in groups of this many (one scale each)
# the GGUF block type a quantized copy takes where the CPU has no AVX512-VNNI: Q4_1 rather than
# Q4_0 (its minimum fits a row's groups better; the packed records are the same size)
GGUF_BLOCKS = {"int8": "Q8_0", "int4": "Q4_1"}


def quant_layout(draft_weights: str) -> str:
    """The packing a resolved draft_weights takes on this CPU: "int8" / "int4" (AVX512-VNNI),
    "Q8_0" / "Q4_1" (GGUF blocks, elsewhere) or "model"."""
    from kernels import cpu_kernels

    if draft_weights in GGUF_BLOCKS and not cpu_kernels.int8_available():
        return GGUF_BLOCKS[draft_weights]
    return draft_weights


def resolve_draft_weights(draft_weights: str, row_kernel: bool, dtype: torch.dtype, widths: list[int]) -> str:
    """SpeculativeConfig.draft_weights -> "int4", "int8" or "model" for an EAGLE-3 head whose
    matrices are `widths` wide (their inputs). "auto" is AUTO_DRAFT_WEIGHTS for a bfloat16 head on
    the CPU row kernels where they run quantized copies (AVX512-VNNI, or GGUF blocks on AVX2 with
    F16C), else "model"; "int8" and "int4" run there only. int4, and int8 as GGUF blocks, need
    every matrix a multiple of INT4_GROUP wide: where one is not, "auto" takes int8 (VNNI) or
    "model", and an explicit choice that cannot be packed is refused."""
    from kernels import cpu_kernels

    vnni = cpu_kernels.int8_available()
    can = row_kernel and (vnni or cpu_kernels.gguf_available())
    if draft_weights in ("int8", "int4") and not can:
        raise ValueError(
            f"draft_weights={draft_weights!r} needs the CPU row kernels (the engine's row path) on a CPU with "
            "AVX512-VNNI, or AVX2 with F16C; use 'model' or 'auto' here"
        )
    resolved = draft_weights
    if draft_weights == "auto":
        resolved = AUTO_DRAFT_WEIGHTS if can and dtype == torch.bfloat16 else "model"
    blocks = resolved == "int4" or (resolved == "int8" and not vnni)
    if blocks and any(w % INT4_GROUP for w in widths):
        if draft_weights == "auto":
            return "int8" if vnni else "model"
        fits = "use 'int8'" if vnni else "use 'model'"
        raise ValueError(
            f"draft_weights={resolved!r} ({quant_layout(resolved)}) needs every matrix of the head to be a multiple "
            f"of {INT4_GROUP} wide, got {tuple(widths)}; {fits}"
        )
    return resolved


def pack_quantized(weight: torch.Tensor, draft_weights: str) -> torch.Tensor:
    """One matrix [N, K] of the head, quantized as `quant_layout(draft_weights)` and packed for the
    row kernels (uint8 for int4 and GGUF blocks, int8 for int8)."""
    from kernels import cpu_kernels

    layout = quant_layout(draft_weights)
    if layout == "int8":
        return cpu_kernels.pack_rows_int8(weight)
    if layout == "int4":
        return cpu_kernels.pack_rows_int4(weight)
    import gguf.quants

    raw = gguf.quants.quantize(weight.detach().float().cpu().numpy(), gguf.GGMLQuantizationType[layout])
    return cpu_kernels.pack_rows_gguf(torch.from_numpy(raw), layout, weight.shape[1])


def head_matrices(layer, head, fc_weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The head's matrices in `LAYER_MATRICES` order, then its LM head's and fc's."""
    return (layer.qkv_proj.weight, layer.o_proj.weight, layer.gate_up_proj.weight, layer.down_proj.weight,
            head.weight, fc_weight)


# (the midlayer's weights as `cpu_kernels.rows_layer` takes them, the LM head's, fc's)
Packed = tuple[dict, torch.Tensor, torch.Tensor]


@dataclass
class HeadPacking:
    """The head's packed matrices: in its dtype (`full`), and quantized (`quant`, None under
    draft_weights "model") for products of up to `quant_max_rows` rows."""

    full: Packed
    quant: Packed | None = None
    quant_max_rows: int = 0

    def for_rows(self, rows: int) -> Packed:
        """The matrices a product of `rows` rows takes."""
        if self.quant is not None and rows <= self.quant_max_rows:
            return self.quant
        return self.full


def pack_head(layer, head, fc_weight: torch.Tensor, draft_weights: str) -> HeadPacking:
    """Pack the head for the row kernels, as the target's matrices are (CausalLM.prepare_rows): the
    midlayer's in its `row_weights` (in place), the LM head's as `head.packed` and fc's, on 2 MiB
    pages; for draft_weights "int8" or "int4" (`resolve_draft_weights`) quantized copies too, the
    LM head's also as `head.packed_few` (the Python loop's logits)."""
    from kernels import cpu_kernels

    rw = layer.row_weights()
    head.use_row_kernel()
    packed_fc = cpu_kernels.pack_rows(fc_weight)
    *mats, head.packed, packed_fc = cpu_kernels.on_huge_pages(
        [rw[k] for k in LAYER_MATRICES] + [head.packed, packed_fc])
    rw.update(zip(LAYER_MATRICES, mats, strict=True))
    packing = HeadPacking((rw, head.packed, packed_fc))
    if draft_weights in ("int8", "int4"):
        quantized = [pack_quantized(w, draft_weights) for w in head_matrices(layer, head, fc_weight)]
        *mats, head_q, fc_q = cpu_kernels.on_huge_pages(quantized)
        packing.quant = ({**rw, **dict(zip(LAYER_MATRICES, mats, strict=True))}, head_q, fc_q)
        packing.quant_max_rows = QUANT_MAX_ROWS if cpu_kernels.amx_available() else 1 << 30
        head.packed_few = (packing.quant_max_rows, head_q)
    return packing
