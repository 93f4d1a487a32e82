"""Native MTP proposer: the multi-token-prediction modules stored in the target's own checkpoint.

Module m (of `num_nextn_predict_layers`) turns a feature h (the target's hidden state for m = 0,
module m - 1's output otherwise) and the embedding e of the token after it into the next feature:

    DeepSeek-V3:  x = eh_proj(cat(enorm(e), hnorm(h)))            out = block(x)
                  logits = head(shared_head.norm(out))             # head: its own, or the target's
    MiMo:         x = input_proj(cat(hidden_layernorm(h), token_layernorm(e)))
                  out = final_layernorm(block(x))                  logits = target.lm_head(out)

where block is one decoder layer of the target's family (input norm, attention with its own paged
KV cache and RoPE at the element's position, MLP; out is its residual stream). The concatenation
orders are vLLM's (deepseek_mtp.py, mimo_mtp.py), and so are the features: DeepSeek-V3's MTP
reads the target's final-norm hidden state (what its model returns), MiMo's the last layer's
output before the final norm (vLLM's MiMo applies the norm in compute_logits); vLLM's zeroing of
the embedding at position 0 is not done (SGLang does not either). `FeatureLayerProposer` runs the
modules (one per depth, the last applied recursively for drafts beyond them; a one-module
checkpoint is applied recursively from the first draft on, as vLLM does).

Layouts, in the target's checkpoint (config `num_nextn_predict_layers`, `num_hidden_layers` = L):
- DeepSeek-V3: `model.layers.{L + m}.` + enorm, hnorm, eh_proj [H, 2H], the decoder layer's
  tensors, shared_head.norm, and optionally shared_head.head [V, H] and embed_tokens [V, H]
  (copies of the target's LM head and embedding in DeepSeek-V3; the target's are used when they
  are absent or equal, and vLLM's first-module embedding otherwise);
- MiMo (`MiMoForCausalLM`, Qwen2): `model.mtp_layers.{m}.` + token_layernorm, hidden_layernorm,
  input_proj [H, 2H], final_layernorm and the decoder layer's tensors; the target's embedding and
  LM head are shared.
The target's loader skips these tensors (`loader.mtp_weight_prefixes`).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import DrafterMismatchError
from engine.models.llama import DecoderLayer
from engine.models.loader import load_safetensors, mtp_weight_prefixes
from engine.spec_decode.proposers.base import DrafterIdentity, model_name, weights_digest
from engine.spec_decode.proposers.checkpoint import (
    check_tensors,
    load_decoder_layer,
    read_config,
    refuse_unused,
)
from engine.spec_decode.proposers.draft_vocab import DraftLMHead, resolve_draft_token_ids
from engine.spec_decode.proposers.feature_layer import FeatureLayerProposer

DEEPSEEK, MIMO = "deepseek", "mimo"
# published tensor names (under a module's prefix) of: token norm, feature norm, projection, and
# the norm before the LM head (DeepSeek) or after the block (MiMo)
TENSOR_NAMES = {
    DEEPSEEK: ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"),
    MIMO: (
        "token_layernorm.weight",
        "hidden_layernorm.weight",
        "input_proj.weight",
        "final_layernorm.weight",
    ),
}


class MTPModule(nn.Module):
    """One MTP module's own tensors around its decoder block."""

    def __init__(self, arch, layout: str) -> None:
        super().__init__()
        h = arch.hidden_size
        self.layout, self.eps = layout, arch.rms_norm_eps
        self.token_norm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.out_norm = nn.Parameter(torch.ones(h))  # DeepSeek: before its LM head; MiMo: after the block
        self.block = DecoderLayer(arch)

    def inputs(self, embeds: torch.Tensor, feats: torch.Tensor, packed: bool = False) -> torch.Tensor:
        """embeds, feats [T, H] -> the block's input [T, H]; `packed`: float32, the projection
        through the CPU row kernel's packed weight (`packed_proj`, set by the proposer)."""
        if packed:
            from kernels import cpu_kernels

            embeds, feats = embeds.float(), feats.float()
        e = F.rms_norm(embeds, embeds.shape[-1:], self.token_norm.to(embeds.dtype), self.eps)
        h = F.rms_norm(feats.to(embeds.dtype), embeds.shape[-1:], self.hidden_norm.to(embeds.dtype), self.eps)
        x = torch.cat([h, e] if self.layout == MIMO else [e, h], dim=-1)
        if packed:
            return cpu_kernels.packed_linear(x, self.packed_proj, self.proj.out_features, None)
        return self.proj(x)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], self.out_norm, self.eps)


def resolve_mtp_dir(model_dir: str | None, target_dir: str) -> str:
    """The MTP layers live in the target's checkpoint: `model` must be None or that directory."""
    if model_dir is not None and os.path.realpath(model_dir) != os.path.realpath(target_dir):
        raise DrafterMismatchError(
            f"speculative method 'mtp' reads the MTP layers stored in the target's own checkpoint "
            f"({target_dir!r}); leave `model` unset (or set it to the target's directory), got {model_dir!r}"
        )
    return target_dir


class MTPProposer(FeatureLayerProposer):
    method = "mtp"
    name = "MTP"

    def __init__(
        self,
        model_dir: str | None,
        runner,
        draft_vocab_size: int | None = None,
        num_speculative_tokens: int = 1,
        tree_width: int = 4,
    ) -> None:
        super().__init__(runner, num_speculative_tokens, tree_width)
        target_dir = resolve_mtp_dir(model_dir, runner.model_dir)
        cfg = read_config(target_dir)
        num_modules = cfg.get("num_nextn_predict_layers")
        if not isinstance(num_modules, int) or num_modules < 1:
            raise DrafterMismatchError(
                f"target {target_dir!r} has no MTP layers: its config.json has num_nextn_predict_layers="
                f"{num_modules!r}, not an integer >= 1 (DeepSeek-V3 and MiMo checkpoints count their MTP layers there)"
            )
        t = runner.arch
        prefixes = mtp_weight_prefixes(t.num_layers, num_modules)
        w = load_safetensors(target_dir, select=lambda name: name.startswith(prefixes))
        is_mimo = "MiMoForCausalLM" in (cfg.get("architectures") or []) or any(
            k.startswith("model.mtp_layers.") for k in w
        )
        self.layout = MIMO if is_mimo else DEEPSEEK
        self.arch = dataclasses.replace(t, num_layers=num_modules)
        self.feature_size = t.hidden_size
        h, vocab = t.hidden_size, t.vocab_size
        draft_ids = resolve_draft_token_ids(draft_vocab_size, target_dir, vocab)
        target_head = DraftLMHead(runner.model.lm_head.weight, draft_ids)
        self.mtp_modules: list[MTPModule] = []
        self.heads: list[DraftLMHead] = []
        self.embed_tokens = runner.model.embed_tokens
        used: list[str] = []
        for m in range(num_modules):
            p = f"model.mtp_layers.{m}." if self.layout == MIMO else f"model.layers.{t.num_layers + m}."
            module = MTPModule(t, self.layout)
            token_norm, hidden_norm, proj, out_norm = (p + n for n in TENSOR_NAMES[self.layout])
            shapes = {token_norm: (h,), hidden_norm: (h,), proj: (h, 2 * h), out_norm: (h,)}
            check_tensors(w, shapes, "MTP", target_dir)
            used += [*shapes, *load_decoder_layer(module.block, w, p, "MTP", target_dir)]
            with torch.no_grad():
                for dest, key in (
                    (module.token_norm, token_norm),
                    (module.hidden_norm, hidden_norm),
                    (module.proj.weight, proj),
                    (module.out_norm, out_norm),
                ):
                    dest.copy_(w[key])
            self.mtp_modules.append(module.to(self.device, self.dtype).eval().requires_grad_(False))
            head = target_head
            if self.layout == DEEPSEEK:
                own = self._own_copy(
                    w, p + "shared_head.head.weight", runner.model.lm_head.weight, target_dir, used
                )
                if own is not None:
                    head = DraftLMHead(own, draft_ids)
                embed = self._own_copy(
                    w, p + "embed_tokens.weight", runner.model.embed_tokens.weight, target_dir, used
                )
                if embed is not None and m == 0:  # the modules share one embedding (vLLM loads the first)
                    self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
            self.heads.append(head)
        refuse_unused(w, used, "MTP", target_dir)
        self._target_head = target_head
        self._own_embedding = self.embed_tokens is not runner.model.embed_tokens
        self.layers = [module.block for module in self.mtp_modules]
        if self.layout == MIMO:  # the last layer's output before the final norm (CausalLM.aux_layer_ids)
            self.needs_hidden_states = False
            self.aux_layer_ids = (t.num_layers,)
        self.rope_offset = 0
        self.rope_cos, self.rope_sin = runner.model.rope_cos, runner.model.rope_sin
        if self.row_kernel:
            from kernels import cpu_kernels

            for module in self.mtp_modules:
                module.packed_proj = cpu_kernels.pack_rows(module.proj.weight.to(self.device, self.dtype))
            self.rope_f32 = runner.model.rope_f32
            target_head.use_row_kernel(runner.model.packed_lm_head())
            for head in {id(hd): hd for hd in self.heads if hd is not target_head}.values():
                head.use_row_kernel()  # a module's own LM head (DeepSeek-V3's shared_head.head)
        named = [
            (f"mtp.{m}.{n}", param)
            for m, mod in enumerate(self.mtp_modules)
            for n, param in mod.named_parameters()
        ]
        named += [(f"head.{m}", hd.weight) for m, hd in enumerate(self.heads) if hd is not target_head]
        self._finish_init(DrafterIdentity(model_name(target_dir), weights_digest(named), target_head.size))

    def _own_copy(
        self, w: dict, key: str, target: torch.Tensor, model_dir: str, used: list[str]
    ) -> torch.Tensor | None:
        """The optional tensor `key` (shaped as the target's `target`) on this device, or None
        when absent or equal to the target's (then the target's is used in place)."""
        if key not in w:
            return None
        check_tensors(w, {key: tuple(target.shape)}, "MTP", model_dir)
        used.append(key)
        own = w[key].to(self.device, self.dtype)
        return None if torch.equal(own, target) else own

    @property
    def num_parameters(self) -> int:
        own_heads = {id(hd): hd for hd in self.heads if hd is not self._target_head}.values()
        embed = self.embed_tokens.weight.numel() if self._own_embedding else 0
        return (
            sum(p.numel() for mod in self.mtp_modules for p in mod.parameters())
            + embed
            + self._target_head.num_parameters
            + sum(hd.weight.numel() for hd in own_heads)
        )

    def modules(self):
        return [*self.mtp_modules] + ([self.embed_tokens] if self._own_embedding else [])

    def _tree_kernel_parts(self) -> dict:
        module = self.mtp_modules[0]
        return {"token_norm": module.token_norm, "hidden_norm": module.hidden_norm, "out_norm": module.out_norm,
                "proj": module.packed_proj, "proj_bias": None, "hidden_first": self.layout == MIMO,
                "norm_after": self.layout == MIMO}

    def _inputs(self, m: int, embeds: torch.Tensor, feats: torch.Tensor, fused: bool) -> torch.Tensor:
        if fused:  # (torch emulates bf16 products on CPUs without AMX: the packed projection)
            return self.mtp_modules[m].inputs(embeds, feats, packed=True)
        if self.layers[m].packed_matmuls:  # a catch-up over many rows where torch emulates bf16
            return self.mtp_modules[m].inputs(embeds, feats, packed=True).to(self.dtype)
        return self.mtp_modules[m].inputs(embeds, feats)

    def _output(self, m: int, out: torch.Tensor) -> torch.Tensor:
        return self.mtp_modules[m].norm(out) if self.layout == MIMO else out

    def _head_input(self, m: int, feats: torch.Tensor) -> torch.Tensor:
        return feats if self.layout == MIMO else self.mtp_modules[m].norm(feats)

    def _committed_rows(self, runner_out) -> torch.Tensor:
        return runner_out.aux_hidden_states if self.layout == MIMO else runner_out.hidden_states
