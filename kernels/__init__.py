"""Paged attention kernels: one interface, the backend chosen once per engine.

The contract (the per-step metadata, the ``AttentionBackend`` protocol) is
:mod:`kernels.attention_api`; the backends are ``"torch"`` (the CPU path and the oracle,
:mod:`kernels.torch_attn`) and ``"triton"`` (GPU, :mod:`kernels.triton_attn`).
``get_attention_backend(device, "auto")`` picks triton on CUDA when triton is importable, else
torch. The CPU's row-invariant kernels are :mod:`kernels.cpu_kernels`.
"""

from __future__ import annotations

import importlib.util

import torch

from kernels.attention_api import (
    MAX_TREE_TOKENS,
    AttentionBackend,
    AttentionMetadata,
    build_common_metadata,
    pack_tree_masks,
    validate_step_inputs,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "build_common_metadata",
    "pack_tree_masks",
    "MAX_TREE_TOKENS",
    "get_attention_backend",
    "validate_step_inputs",
]


def triton_available() -> bool:
    """True when the triton package can be imported (does not import it)."""
    return importlib.util.find_spec("triton") is not None


def get_attention_backend(device: torch.device | str, name: str = "auto") -> AttentionBackend:
    """Return the attention backend to use on ``device``.

    ``name``: ``"auto"`` (triton on CUDA when triton is importable, else torch),
    ``"torch"`` or ``"triton"`` (explicit; triton raises ValueError when not importable).
    """
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "torch":
        from kernels.torch_attn import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        if not triton_available():
            raise ValueError("attention backend 'triton' requested but triton is not importable")
        from kernels.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'torch' or 'triton'")
