"""Frozen dataclass configurations for the model family and the training runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .data import BOS_ID, EOS_ID


@dataclass(frozen=True)
class LlamaSpec:
    """Architecture of a ``LlamaForCausalLM`` in this family."""

    vocab_size: int = 8192
    hidden_size: int = 512
    num_hidden_layers: int = 16
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 1408
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    def to_hf(self):
        """Build the matching ``transformers.LlamaConfig``."""
        from transformers import LlamaConfig

        kw = asdict(self)
        rope_theta = kw.pop("rope_theta")
        return LlamaConfig(
            **kw,
            head_dim=self.hidden_size // self.num_attention_heads,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            hidden_act="silu",
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=EOS_ID,
            attention_bias=False,
            mlp_bias=False,
            initializer_range=0.02,
        )


TARGET_SPEC = LlamaSpec()
DRAFTER_SPEC = LlamaSpec(
    hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512
)


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one (time-budgeted) training run."""

    name: str
    seq_len: int = 512
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    planned_tokens: int = 10_000_000
    max_minutes: float = 60.0
    time_aware_lr: bool = True
    checkpoint_minutes: float = 5.0
    seed: int = 0
    # bfloat16: bf16 weights/activations with fp32 AdamW masters (fast where the CPU has AMX or
    # AVX512-BF16); float32 where torch only emulates bf16 products (e.g. AVX2-only hosts).
    dtype: str = "bfloat16"

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size * self.grad_accum

    @property
    def planned_steps(self) -> int:
        return max(1, self.planned_tokens // self.tokens_per_step)
