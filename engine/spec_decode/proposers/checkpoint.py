"""Reading drafter checkpoints: config.json, tensors under their published names with every shape
checked, a Hugging Face decoder layer into our fused `DecoderLayer`, and whether a drafter fits
its target. Every refusal names the directory and the tensor or field at fault.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch

from engine.errors import CheckpointError, DrafterMismatchError
from engine.models.llama import DecoderLayer
from engine.models.loader import load_safetensors


def read_config(model_dir: str) -> dict:
    """A drafter directory's config.json as a dict."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"drafter directory {model_dir!r} has no config.json")
    with open(path) as f:
        return json.load(f)


def load_tensors(model_dir: str, other_files: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """model.safetensors (or its shards), else the first of `other_files` the directory holds:
    a .safetensors file as such, anything else (pytorch_model.bin, the Medusa repo's
    medusa_lm_head.pt) with torch.load(weights_only=True), which unpickles tensors only."""
    try:
        return load_safetensors(model_dir)
    except CheckpointError:
        for name in other_files:
            path = os.path.join(model_dir, name)
            if not os.path.isfile(path):
                continue
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(path)
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
                raise CheckpointError(f"{path} is not a state dict of tensors") from None
            return state
        raise


def check_tensors(
    weights: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], what: str, model_dir: str
) -> None:
    """Raise CheckpointError naming the first tensor of `expected` (name -> shape) that `weights`
    lacks or holds in another shape."""
    for key, shape in expected.items():
        if key not in weights:
            raise CheckpointError(f"{what} checkpoint {model_dir!r} lacks tensor {key!r}")
        if tuple(weights[key].shape) != tuple(shape):
            raise CheckpointError(
                f"{what} checkpoint {model_dir!r}: tensor {key!r} has shape {tuple(weights[key].shape)}, "
                f"expected {tuple(shape)}"
            )


def refuse_unused(weights: dict[str, torch.Tensor], used: Iterable[str], what: str, model_dir: str) -> None:
    """Raise CheckpointError naming the tensors this drafter would silently ignore."""
    unknown = sorted(set(weights) - set(used))
    if unknown:
        raise CheckpointError(
            f"{what} checkpoint {model_dir!r} has tensors this drafter does not use: {unknown[:5]}"
        )


def decoder_layer_shapes(layer: DecoderLayer, prefix: str) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names (under `prefix`, e.g. "model.layers.12.") and shapes of one
    decoder layer of `layer`'s family: norms, q/k/v/o (biases where the family has them), q/k
    norms (Qwen3), gate/up/down."""
    cfg = layer.cfg
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    if layer.input_norm:
        shapes["input_layernorm.weight"] = (h,)
    shapes["post_attention_layernorm.weight"] = (h,)
    for name, size in (("q", layer.q_size), ("k", layer.kv_size), ("v", layer.kv_size)):
        shapes[f"self_attn.{name}_proj.weight"] = (size, h)
        if cfg.qkv_bias:
            shapes[f"self_attn.{name}_proj.bias"] = (size,)
    shapes["self_attn.o_proj.weight"] = (h, layer.q_size)
    if cfg.o_bias:
        shapes["self_attn.o_proj.bias"] = (h,)
    if cfg.qk_norm:
        shapes["self_attn.q_norm.weight"] = shapes["self_attn.k_norm.weight"] = (cfg.head_dim,)
    for name, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
        shapes[f"mlp.{name}_proj.weight"] = shape
        if cfg.mlp_bias:
            shapes[f"mlp.{name}_proj.bias"] = shape[:1]
    return {prefix + k: v for k, v in shapes.items()}


def load_decoder_layer(
    layer: DecoderLayer, weights: dict[str, torch.Tensor], prefix: str, what: str, model_dir: str
) -> list[str]:
    """Check and copy one Hugging Face decoder layer (`decoder_layer_shapes`) into `layer`,
    fusing q/k/v and gate/up; returns the tensor names it used."""
    shapes = decoder_layer_shapes(layer, prefix)
    check_tensors(weights, shapes, what, model_dir)

    def w(name: str) -> torch.Tensor:
        return weights[prefix + name]

    def cat(names: list[str]) -> torch.Tensor:
        return torch.cat([w(n) for n in names])

    cfg = layer.cfg
    with torch.no_grad():
        if layer.input_norm:
            layer.input_layernorm.copy_(w("input_layernorm.weight"))
        layer.post_attention_layernorm.copy_(w("post_attention_layernorm.weight"))
        layer.qkv_proj.weight.copy_(cat([f"self_attn.{n}_proj.weight" for n in "qkv"]))
        if cfg.qkv_bias:
            layer.qkv_proj.bias.copy_(cat([f"self_attn.{n}_proj.bias" for n in "qkv"]))
        layer.o_proj.weight.copy_(w("self_attn.o_proj.weight"))
        if cfg.o_bias:
            layer.o_proj.bias.copy_(w("self_attn.o_proj.bias"))
        if cfg.qk_norm:
            layer.q_norm.copy_(w("self_attn.q_norm.weight"))
            layer.k_norm.copy_(w("self_attn.k_norm.weight"))
        layer.gate_up_proj.weight.copy_(cat(["mlp.gate_proj.weight", "mlp.up_proj.weight"]))
        if cfg.mlp_bias:
            layer.gate_up_proj.bias.copy_(cat(["mlp.gate_proj.bias", "mlp.up_proj.bias"]))
        layer.down_proj.weight.copy_(w("mlp.down_proj.weight"))
        if cfg.mlp_bias:
            layer.down_proj.bias.copy_(w("mlp.down_proj.bias"))
    return list(shapes)


def check_head_matches_target(
    model_dir: str, runner, hidden: int, vocab: int, target_name: str | None
) -> None:
    """Refuse a head whose hidden or vocabulary size differs from the target's, or which names
    another target (our layouts record the target folder's name)."""
    arch = runner.arch
    problems = []
    if hidden != arch.hidden_size:
        problems.append(f"hidden size {hidden} vs the target's {arch.hidden_size}")
    if vocab != arch.vocab_size:
        problems.append(f"vocab size {vocab} vs the target's {arch.vocab_size}")
    if target_name and os.path.basename(os.path.normpath(target_name)) != os.path.basename(
        os.path.normpath(runner.model_dir)
    ):
        problems.append(f"it was trained for target {target_name!r}, not {runner.model_dir!r}")
    if problems:
        raise DrafterMismatchError(
            f"drafter {model_dir!r} does not match target {runner.model_dir!r}: " + "; ".join(problems)
        )
