"""Draft heads that ride on the frozen target: an EAGLE-1 head and Medusa-style MTP heads.

Both consume the target's final hidden state *after* the final RMSNorm
(``target.model(ids).last_hidden_state``) and reuse the target's (tied) embedding and
``lm_head``; neither stores those shared weights.

EAGLE-1 head (checkpoint layout of the published EAGLE weights)::

    x_t   = fc(cat(embed(token_{t+1}), h_t))           # Linear(2H, H, bias=True), embedding FIRST
    f_t+1 = DecoderLayer(x)                            # no input_layernorm, causal self-attention, RoPE
    logits_{t+2} = target.lm_head(f_t+1)               # no final norm

The element built from ``(h_t, token_{t+1})`` sits at RoPE position ``t+1`` (the position of the
token it embeds).  Its output ``f`` approximates ``h_{t+1}`` and ``lm_head(f)`` predicts
``token_{t+2}``.

Medusa heads: head ``i`` maps ``h_t`` to ``h_t + SiLU(W_i h_t + b_i)`` and, through the target's
``lm_head``, predicts ``token_{t+i+2}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

EAGLE_KEYS = (
    "fc.weight",
    "fc.bias",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
)


@dataclass(frozen=True)
class EagleConfig:
    """Configuration of the EAGLE head's single decoder layer (matches the target's shapes)."""

    hidden_size: int = 512
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 1408
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    vocab_size: int = 8192
    hidden_act: str = "silu"
    target: str = "target"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_json_dict(self) -> dict:
        return {
            "architectures": ["EagleHead"],
            "model_type": "eagle",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "hidden_act": self.hidden_act,
            "num_hidden_layers": 1,
            "torch_dtype": "bfloat16",
            "eagle": {
                "target": self.target,
                "target_hidden_size": self.hidden_size,
                "target_vocab_size": self.vocab_size,
                "feature": "final_norm_hidden",
                "position_ids": "element (h_t, token_{t+1}) uses rope position t+1",
                "embedding_first": True,
                "final_norm": False,
            },
        }

    @classmethod
    def from_json_dict(cls, d: dict) -> EagleConfig:
        return cls(
            hidden_size=d["hidden_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d["num_key_value_heads"],
            intermediate_size=d["intermediate_size"],
            rms_norm_eps=d["rms_norm_eps"],
            rope_theta=d["rope_theta"],
            max_position_embeddings=d["max_position_embeddings"],
            vocab_size=d["vocab_size"],
            hidden_act=d["hidden_act"],
            target=d["eagle"]["target"],
        )

    def llama_config(self):
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            hidden_act=self.hidden_act,
        )
        cfg._attn_implementation = "sdpa"
        return cfg


class EagleHead(nn.Module):
    """EAGLE-1 draft head: ``fc`` + one Llama decoder layer without ``input_layernorm``."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.config = config
        lcfg = config.llama_config()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        layer = LlamaDecoderLayer(lcfg, layer_idx=0)
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = LlamaRotaryEmbedding(lcfg)

    def forward(
        self,
        token_embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict features.

        Args:
            token_embeds: ``[B, T, H]`` target embeddings of ``token_{t+1}``.
            hidden: ``[B, T, H]`` target final-norm hidden states ``h_t`` (or earlier predictions).
            position_ids: ``[B, T]`` RoPE positions (``t+1`` for the element built from ``h_t``).
            attention_mask: optional additive float mask ``[B, 1, T, T]``; ``None`` means causal.

        Returns:
            ``[B, T, H]`` predicted features ``f_{t+1}`` (apply the target's ``lm_head`` directly).
        """
        x = self.fc(torch.cat([token_embeds, hidden.to(token_embeds.dtype)], dim=-1))
        pos_emb = self.rotary_emb(x, position_ids)
        out = self.layers[0](
            x, attention_mask=attention_mask, position_ids=position_ids, position_embeddings=pos_emb
        )
        return out[0] if isinstance(out, tuple) else out


@dataclass(frozen=True)
class MedusaConfig:
    """Configuration of the Medusa / MTP heads."""

    num_heads: int = 8
    hidden_size: int = 512
    vocab_size: int = 8192
    target: str = "target"

    def to_json_dict(self) -> dict:
        return {
            "architectures": ["MedusaHeads"],
            "model_type": "medusa",
            "num_heads": self.num_heads,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "target": self.target,
            "num_layers_per_head": 1,
            "feature": "final_norm_hidden",
            "head_i_predicts": "token_{t+i+2} from h_t",
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def from_json_dict(cls, d: dict) -> MedusaConfig:
        return cls(
            num_heads=d["num_heads"],
            hidden_size=d["hidden_size"],
            vocab_size=d["vocab_size"],
            target=d["target"],
        )


class ResBlock(nn.Module):
    """``h + SiLU(W h + b)``."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """``num_heads`` residual blocks; head ``i`` output goes through the target ``lm_head``."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList([ResBlock(config.hidden_size) for _ in range(config.num_heads)])

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Return the per-head features ``[B, T, H]`` (apply the target's ``lm_head``)."""
        return [head(hidden) for head in self.heads]


def save_head(module: nn.Module, config_dict: dict, folder: Path) -> None:
    """Save a head's weights (bf16 safetensors) and ``config.json``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")


def load_eagle_head(folder: Path, dtype: torch.dtype = torch.float32) -> EagleHead:
    """Load an EAGLE head from ``folder`` with strict key matching."""
    from safetensors.torch import load_file

    cfg = EagleConfig.from_json_dict(json.loads((Path(folder) / "config.json").read_text()))
    head = EagleHead(cfg)
    head.load_state_dict(load_file(str(Path(folder) / "model.safetensors")), strict=True)
    return head.to(dtype).eval()


def load_medusa_heads(folder: Path, dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """Load MTP heads from ``folder`` with strict key matching."""
    from safetensors.torch import load_file

    cfg = MedusaConfig.from_json_dict(json.loads((Path(folder) / "config.json").read_text()))
    heads = MedusaHeads(cfg)
    heads.load_state_dict(load_file(str(Path(folder) / "model.safetensors")), strict=True)
    return heads.to(dtype).eval()
