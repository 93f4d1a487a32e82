"""Load a Hugging Face-format checkpoint directory: config.json + (sharded) safetensors + tokenizer."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

from engine.errors import CheckpointError
from engine.models.llama import ArchConfig, CausalLM, rope_cos_sin


def load_hf_config(model_dir: str):
    from transformers import AutoConfig

    if not os.path.isdir(model_dir):
        raise CheckpointError(f"model directory {model_dir!r} does not exist")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise CheckpointError(f"model directory {model_dir!r} has no config.json")
    return AutoConfig.from_pretrained(model_dir)


def load_safetensors(model_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards named by `model.safetensors.index.json`."""
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        weights: dict[str, torch.Tensor] = {}
        for shard in shards:
            weights.update(load_file(os.path.join(model_dir, shard)))
        return weights
    raise CheckpointError(
        f"model directory {model_dir!r} has no weights: expected model.safetensors or "
        "model.safetensors.index.json"
    )


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, max_positions: int):
    """Build our decoder for the checkpoint and load its weights. Returns (model, hf_config)."""
    hf_config = load_hf_config(model_dir)
    arch = ArchConfig.from_hf(hf_config)
    weights = load_safetensors(model_dir)
    with torch.device("meta"):
        model = CausalLM(arch)
    model = model.to_empty(device=device).to(dtype)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_hf_weights(weights)
    model.set_rope(*rope_cos_sin(hf_config, max_positions, dtype, device),
                   *rope_cos_sin(hf_config, max_positions, torch.float32, device))
    model.eval().requires_grad_(False)
    return model, hf_config
