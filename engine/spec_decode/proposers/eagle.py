"""EAGLE proposer: one decoder layer over (token embedding, target hidden state) pairs.

Element j pairs the target's final-norm hidden state h_j with token j+1: x = fc(cat(embed(t_{j+1}),
h_j)), one Llama decoder layer without input norm, and lm_head(output) predicts token j+2. The
element sits at RoPE position j+1 (a constant shift: attention scores only see relative
positions) and in the head's own paged KV cache at position j (same block tables as the target;
one layer, so its KV costs 1/L of the target's). Drafting runs the layer autoregressively: the
predicted feature and the drafted token form the next element. The head's KV, like the target's,
only keeps committed elements; buffering and drafting are `FeatureLayerProposer`'s with one module.

Two layouts load: ours (`architectures: ["EagleHead"]`, the target's name and sizes under
`eagle`), and the published EAGLE-1 layout as the EAGLE repo saves it and vLLM reads it (a Llama
config, `fc.weight` [H, 2H] and `fc.bias` [H] if trained with one, `layers.0.*` without
`input_layernorm`; an `embed_tokens.weight` copy of the target's embedding is ignored, as vLLM
ignores it). Weights in model.safetensors or the repo's pytorch_model.bin.

The target's embedding and LM head are used in place (no copy); with a draft vocabulary
(`draft_vocab.py`) the head's logits cover its N rows only, which it keeps as an N x H copy.
"""

from __future__ import annotations

import torch

from engine.errors import DrafterMismatchError
from engine.models.llama import ArchConfig, DecoderLayer, rope_cos_sin
from engine.spec_decode.proposers.base import DrafterIdentity, model_name, weights_digest
from engine.spec_decode.proposers.checkpoint import (
    check_head_matches_target,
    check_tensors,
    load_decoder_layer,
    load_tensors,
    read_config,
    refuse_unused,
)
from engine.spec_decode.proposers.draft_vocab import DraftLMHead, resolve_draft_token_ids
from engine.spec_decode.proposers.feature_layer import FeatureLayerProposer

OUR_ARCHITECTURE = "EagleHead"


class EagleProposer(FeatureLayerProposer):
    method = "eagle"
    name = "EAGLE"

    def __init__(
        self, model_dir: str, runner, draft_vocab_size: int | None = None, num_speculative_tokens: int = 1,
        tree_width: int = 4,
    ) -> None:
        super().__init__(runner, num_speculative_tokens, tree_width)
        cfg = read_config(model_dir)
        w = load_tensors(model_dir, ("pytorch_model.bin",))
        t = runner.arch
        if OUR_ARCHITECTURE in (cfg.get("architectures") or []):
            eagle = cfg.get("eagle", {})
            check_head_matches_target(
                model_dir,
                runner,
                eagle.get("target_hidden_size", cfg["hidden_size"]),
                eagle.get("target_vocab_size", cfg["vocab_size"]),
                eagle.get("target"),
            )
        elif "fc.weight" not in w or cfg.get("num_hidden_layers", 1) != 1:
            raise DrafterMismatchError(
                f"{model_dir!r} is not an EAGLE-1 head: neither architectures [{OUR_ARCHITECTURE!r}] nor the "
                f"published layout (one layer, tensor 'fc.weight'); architectures={cfg.get('architectures')}"
            )
        else:
            check_head_matches_target(model_dir, runner, cfg["hidden_size"], cfg["vocab_size"], None)
        self.feature_size = t.hidden_size
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.arch = ArchConfig(
            model_type="eagle",
            vocab_size=t.vocab_size,
            hidden_size=hidden,
            num_layers=1,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=True,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            sliding_window=None,
        )
        layer = DecoderLayer(self.arch, input_norm=False)
        fc_shapes = {"fc.weight": (hidden, 2 * t.hidden_size)}
        if "fc.bias" in w:
            fc_shapes["fc.bias"] = (hidden,)
        check_tensors(w, fc_shapes, "EAGLE", model_dir)
        used = [*fc_shapes, *load_decoder_layer(layer, w, "layers.0.", "EAGLE", model_dir)]
        if "embed_tokens.weight" in w:  # the target's embedding, saved with the head: not used
            check_tensors(w, {"embed_tokens.weight": (t.vocab_size, t.hidden_size)}, "EAGLE", model_dir)
            used.append("embed_tokens.weight")
        refuse_unused(w, used, "EAGLE", model_dir)
        self.fc = torch.nn.Linear(2 * t.hidden_size, hidden, bias="fc.bias" in w)
        with torch.no_grad():
            self.fc.weight.copy_(w["fc.weight"])
            if "fc.bias" in w:
                self.fc.bias.copy_(w["fc.bias"])
        self.fc = self.fc.to(self.device, self.dtype).eval().requires_grad_(False)
        self.layers = [layer]
        # Shared with the target, in place.
        self.embed_tokens = runner.model.embed_tokens
        self.heads = [
            DraftLMHead(
                runner.model.lm_head.weight,
                resolve_draft_token_ids(draft_vocab_size, model_dir, t.vocab_size),
            )
        ]
        from transformers import LlamaConfig

        hf = LlamaConfig(
            hidden_size=heads * self.arch.head_dim,
            num_attention_heads=heads,
            head_dim=self.arch.head_dim,
            rope_theta=cfg.get("rope_theta", 10000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=self.arch.max_position_embeddings,
        )
        max_pos = runner.model.rope_cos.shape[0] + 1
        self.rope_offset = 1
        self.rope_cos, self.rope_sin = rope_cos_sin(hf, max_pos, self.dtype, self.device)
        if self.row_kernel:
            from kernels import cpu_kernels

            self.rope_f32 = rope_cos_sin(hf, max_pos, torch.float32, self.device)
            self.packed_fc = cpu_kernels.pack_rows(self.fc.weight)
            self.head.use_row_kernel(runner.model.packed_lm_head())
        named = [(f"fc.{n}", p) for n, p in self.fc.named_parameters()]
        named += [(f"layer.{n}", p) for n, p in layer.named_parameters()]
        self._finish_init(DrafterIdentity(model_name(model_dir), weights_digest(named), self.head.size))

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for m in self.modules() for p in m.parameters()) + self.head.num_parameters

    def modules(self):
        return [self.fc, *self.layers]

    def _tree_kernel_parts(self) -> dict:
        return {"token_norm": None, "hidden_norm": None, "out_norm": None, "proj": self.packed_fc,
                "proj_bias": self.fc.bias, "hidden_first": False, "norm_after": False}

    def _inputs(self, m: int, embeds: torch.Tensor, feats: torch.Tensor, fused: bool) -> torch.Tensor:
        inputs = torch.cat([embeds, feats.to(embeds.dtype)], dim=-1)
        if fused or self.layers[0].packed_matmuls:
            from kernels import cpu_kernels

            return cpu_kernels.packed_linear(
                inputs.float() if fused else inputs, self.packed_fc, self.arch.hidden_size, self.fc.bias
            )
        return self.fc(inputs)
