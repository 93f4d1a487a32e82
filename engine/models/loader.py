"""Load a checkpoint: a Hugging Face-format directory (config.json + (sharded) safetensors +
tokenizer) or a GGUF file (engine/models/gguf_checkpoint.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from safetensors import safe_open

from engine.errors import CheckpointError
from engine.models.gguf_checkpoint import is_gguf, read_gguf
from engine.models.llama import ArchConfig, CausalLM, rope_cos_sin

# Model types that are one of our families under another name, with extra layers only a drafter
# reads: MiMo is Qwen2 plus its MTP layers (`model.mtp_layers.*`).
CONFIG_ALIASES = {"mimo": "qwen2"}


def load_hf_config(model_dir: str):
    from transformers import CONFIG_MAPPING, AutoConfig

    if is_gguf(model_dir):
        return read_gguf(model_dir).hf_config
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"model directory {model_dir!r} does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"model directory {model_dir!r} has no config.json")
    with open(path) as f:
        model_type = json.load(f).get("model_type")
    if model_type in CONFIG_ALIASES:
        family = CONFIG_ALIASES[model_type]
        config = CONFIG_MAPPING[family].from_pretrained(model_dir)
        config.model_type = family
        return config
    return AutoConfig.from_pretrained(model_dir)


def mtp_weight_prefixes(num_hidden_layers: int, num_mtp_layers: int) -> tuple[str, ...]:
    """Name prefixes of the native multi-token-prediction layers a checkpoint stores next to the
    model (`num_nextn_predict_layers` of them): DeepSeek-V3's `model.layers.{num_hidden_layers + i}.`
    and MiMo's `model.mtp_layers.{i}.`. The MTP drafter (engine/spec_decode/proposers/mtp.py) loads them,
    the target does not."""
    return tuple(f"model.layers.{num_hidden_layers + i}." for i in range(num_mtp_layers)) + tuple(
        f"model.mtp_layers.{i}." for i in range(num_mtp_layers)
    )


def load_safetensors(model_dir: str, select: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of `model.safetensors` or of the shards named by `model.safetensors.index.json`
    (only those whose name `select` accepts, when given; the others are not read)."""
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = [os.path.join(model_dir, shard) for shard in sorted(set(json.load(f)["weight_map"].values()))]
    else:
        raise CheckpointError(
            f"model directory {model_dir!r} has no weights: expected model.safetensors or "
            "model.safetensors.index.json"
        )
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            weights.update({name: f.get_tensor(name) for name in f.keys() if select is None or select(name)})
    return weights


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, max_positions: int,
               quantization: str = "none"):
    """Build our decoder for the checkpoint and load its weights. Returns (model, hf_config).
    `quantization` "gguf" (a GGUF file, the CPU row kernels): the row kernels also get the file's
    Q4_0/Q4_1/Q8_0 matrices as stored (`gguf_stored_matrices`); "gguf_a8": the same, the Q4 ones
    marked for int8 activations; "none": every weight dequantized."""
    hf_config = load_hf_config(model_dir)
    arch = ArchConfig.from_hf(hf_config)
    mtp = mtp_weight_prefixes(arch.num_layers, int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0))
    if is_gguf(model_dir):
        weights = read_gguf(model_dir).hf_weights(dtype)
    else:
        weights = load_safetensors(model_dir, select=lambda name: not name.startswith(mtp))  # MTP layers: the drafter's
    with torch.device("meta"):
        model = CausalLM(arch)
    model = model.to_empty(device=device).to(dtype)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_hf_weights(weights)
    model.set_rope(*rope_cos_sin(hf_config, max_positions, dtype, device),
                   *rope_cos_sin(hf_config, max_positions, torch.float32, device))
    model.eval().requires_grad_(False)
    if quantization in ("gguf", "gguf_a8"):
        model.use_stored_matrices(*gguf_stored_matrices(model_dir, arch, int8_activations=quantization == "gguf_a8"))
    return model, hf_config


def gguf_stored_matrices(path: str, arch: ArchConfig, int8_activations: bool = False
                         ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor | None]:
    """The GGUF file's matrices that it stores as Q4_0, Q4_1 or Q8_0, packed for the row kernels'
    GGUF products (`cpu_kernels.pack_rows_gguf`): per decoder layer {"w_qkv", "w_o", "w_gate_up",
    "w_down"} (each present where all of its parts are stored in one such type), and the LM head
    (the token embedding where tied) or None. `int8_activations`: the Q4 ones marked for int8
    activations (`cpu_kernels.gguf_int8_activations`)."""
    from kernels import cpu_kernels

    ckpt = read_gguf(path)
    types = tuple(cpu_kernels.GGUF_PACKED_TYPES)

    def packed(names: list[str], k: int) -> torch.Tensor | None:
        found = ckpt.stored_blocks(names, types)
        if found is None:
            return None
        blocks = cpu_kernels.pack_rows_gguf(found[1], found[0], k)
        return cpu_kernels.gguf_int8_activations(blocks) if int8_activations else blocks

    hidden, q_size = arch.hidden_size, arch.num_heads * arch.head_dim
    layers = []
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        matrices = {
            "w_qkv": packed([p + f"self_attn.{x}_proj.weight" for x in "qkv"], hidden),
            "w_o": packed([p + "self_attn.o_proj.weight"], q_size),
            "w_gate_up": packed([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], hidden),
            "w_down": packed([p + "mlp.down_proj.weight"], arch.intermediate_size),
        }
        layers.append({k: v for k, v in matrices.items() if v is not None})
    head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    return layers, packed([head], hidden)
