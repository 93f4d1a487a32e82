"""Post-hoc training of a native MTP module (DeepSeek-V3 layout) on the frozen target, and saving
it into a copy of the target's checkpoint, where `method="mtp"` reads it.

The module (DeepSeek-V3's multi-token prediction, one depth; the engine applies it recursively for
every draft): for the element at position j, with the target's final-norm hidden state h_j and
the embedding e of token j + 1,

    x = eh_proj(cat(enorm(e), hnorm(h_j)))      f_j = block(x)      logits = lm_head(shared_head.norm(f_j))

predicting token j + 2, with block one decoder layer of the target's family (its own input norm)
and lm_head / embedding the target's (shared, not copied). Recursive use: the element at j + 1 of
the next depth pairs f_j with the token drafted from it.

Loss: sum over unroll steps s of decay^s * CE(target's distribution, module's), where step 0 is
teacher-forced (element j: h_j, token j + 1, position j, predicting the target's distribution at
j + 1 over token j + 2) and step s > 0 feeds the previous step's outputs back (element j: f_j of
step s - 1, token j + 1 + s, position j + s; predicting the target at j + 1 + s). Step s's
elements attend causally among themselves (as EAGLE-1's rollout in trainer.py; at inference an
element of depth s also sees the committed elements before it: an approximation). The target is
frozen and never changes ("post-hoc"; DeepSeek-V3 trains MTP jointly with the model).

Saved keys (`model.layers.{L}.`, L = the target's num_hidden_layers): enorm.weight,
hnorm.weight, eh_proj.weight, shared_head.norm.weight and the decoder layer's own tensors
(input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj),
with `num_nextn_predict_layers: 1` in config.json: the DeepSeek-V3 layout as vLLM's
deepseek_mtp.py reads it (engine/spec_decode/proposers/mtp.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from training import pipeline
from training.pipeline import fit, load_streams, log, train_config, write_stats
from training.trainer import LossFn, TargetOutputs, _outputs


class MTPModule(nn.Module):
    """One DeepSeek-V3 MTP module for a Llama-family target (`target_config`: its HF config)."""

    def __init__(self, target_config) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        h, eps = target_config.hidden_size, target_config.rms_norm_eps
        self.enorm = LlamaRMSNorm(h, eps)
        self.hnorm = LlamaRMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        cfg = type(target_config).from_dict(target_config.to_dict())
        cfg._attn_implementation = "sdpa"
        self.block = LlamaDecoderLayer(cfg, layer_idx=0)
        self.shared_head_norm = LlamaRMSNorm(h, eps)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """[B, T, H] embeddings of token j + 1 and features of position j (RoPE positions
        `position_ids`) -> [B, T, H] output features f_j (causal over the T elements)."""
        x = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden.to(token_embeds.dtype))], dim=-1))
        out = self.block(x, attention_mask=None, position_ids=position_ids,
                         position_embeddings=self.rotary_emb(x, position_ids))
        return out[0] if isinstance(out, tuple) else out

    def head_input(self, features: torch.Tensor) -> torch.Tensor:
        return self.shared_head_norm(features)

    def published_state_dict(self, layer_index: int) -> dict[str, torch.Tensor]:
        """The module's tensors under the DeepSeek-V3 names, prefix `model.layers.{layer_index}.`."""
        p = f"model.layers.{layer_index}."
        out = {p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight,
               p + "eh_proj.weight": self.eh_proj.weight, p + "shared_head.norm.weight": self.shared_head_norm.weight}
        out |= {p + k: v for k, v in self.block.state_dict().items()}
        return {k: v.detach().contiguous() for k, v in out.items()}

    def load_published(self, weights: dict[str, torch.Tensor], layer_index: int) -> None:
        """The inverse of `published_state_dict`: this module's tensors from a checkpoint's
        DeepSeek-V3 names (a warm start from an MTP trained on an earlier target)."""
        p = f"model.layers.{layer_index}."
        names = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                 "eh_proj.weight": "eh_proj.weight", "shared_head_norm.weight": "shared_head.norm.weight"}
        names |= {"block." + k: k for k in self.block.state_dict()}
        missing = [p + theirs for theirs in names.values() if p + theirs not in weights]
        if missing:
            raise KeyError(f"no MTP layer {layer_index} in the checkpoint: missing {missing[:3]}")
        self.load_state_dict({mine: weights[p + theirs].float() for mine, theirs in names.items()})


def mtp_loss_fn(module: MTPModule, target: nn.Module | TargetOutputs, unroll: int = 3, decay: float = 0.8) -> LossFn:
    """The module docstring's loss over `unroll` steps; metrics: per step CE and top-1 agreement
    with the target's argmax."""
    outputs = _outputs(target)
    embed = outputs.target.get_input_embeddings()
    lm_head = outputs.target.get_output_embeddings()

    def fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        bsz, seq = batch.shape
        h = outputs.hidden(batch)  # [B, T, H]
        t_logp = outputs.log_probs(batch)  # [B, T, V]: the target's distribution of token t + 1
        with torch.no_grad():
            emb = embed(batch)
        feats, total, metrics = h[:, :-1], torch.zeros(()), {}
        for s in range(unroll):
            n = seq - 2 - s  # elements j = 0..n-1 predict token j + 2 + s (target row j + 1 + s)
            if n <= 0:
                break
            pos = torch.arange(s, s + n, device=batch.device).unsqueeze(0).expand(bsz, -1)
            f = module(emb[:, 1 + s : 1 + s + n], feats[:, :n], pos)
            logits = lm_head(module.head_input(f)).float()
            p = t_logp[:, 1 + s : 1 + s + n].exp()
            ce = -(p * F.log_softmax(logits, dim=-1)).sum(-1).mean()
            total = total + decay**s * ce
            with torch.no_grad():
                agree = (logits.argmax(-1) == p.argmax(-1)).float().mean()
            metrics |= {f"ce{s}": float(ce.detach()), f"acc{s}": float(agree)}
            feats = f  # step s + 1's element j pairs f_j with token j + 2 + s
        return total, metrics

    return fn


def save_mtp(module: MTPModule, target_dir: Path, out_dir: Path) -> Path:
    """A copy of the target folder with the module added (DeepSeek-V3 layout, bf16) and
    `num_nextn_predict_layers: 1` in its config."""
    from safetensors.torch import load_file, save_file

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.resolve() != target_dir.resolve():
        shutil.copytree(target_dir, out_dir, dirs_exist_ok=True)
    cfg = json.loads((target_dir / "config.json").read_text())
    weights = load_file(str(target_dir / "model.safetensors"))
    dtype = next(iter(weights.values())).dtype
    weights |= {k: v.to(dtype) for k, v in module.published_state_dict(cfg["num_hidden_layers"]).items()}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


def train_mtp(args: argparse.Namespace) -> None:
    """`mtp`: train the module on the frozen target (`--init-from`, default models/target) and save
    it with a copy of that target in `--out` (default runs/target-mtp): copy model.safetensors and
    config.json over the target's to ship."""
    from transformers import LlamaForCausalLM

    cfg = train_config(args, "mtp")
    train, _ = load_streams(cfg.seq_len, args.corpus)
    src = Path(args.init_from) if args.init_from else pipeline.MODELS / "target"
    target = LlamaForCausalLM.from_pretrained(str(src), dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    target.eval().requires_grad_(False)
    torch.manual_seed(cfg.seed)
    module = MTPModule(target.config)
    if args.warm_start:  # an MTP stored with an earlier target (DeepSeek-V3 names)
        from safetensors.torch import load_file

        layer = json.loads((Path(args.warm_start) / "config.json").read_text())["num_hidden_layers"]
        module.load_published(load_file(str(Path(args.warm_start) / "model.safetensors")), layer)
        log(f"mtp: initialized from {args.warm_start}")
    n_params = sum(p.numel() for p in module.parameters())
    log(f"mtp: {n_params / 1e6:.2f}M params, unroll {args.ttt_steps}, target {src}, config {asdict(cfg)}")
    loss_fn = mtp_loss_fn(module, target, unroll=args.ttt_steps)
    out = fit(args, cfg, module, loss_fn, train, 6, "mtp.pt")
    if out is None:
        return
    folder = save_mtp(module.float(), src, Path(args.out))
    # the drafters' frequency-ranked draft vocabulary (`draft-vocab`), which the MTP proposer
    # reads from its target's folder: the module's LM head then costs a quarter at 2048 of 8192
    ranking = next((pipeline.MODELS / n / "draft_vocab.json" for n in pipeline.DRAFT_FOLDERS
                    if (pipeline.MODELS / n / "draft_vocab.json").exists()), None)
    if ranking is not None:
        shutil.copy(ranking, folder / "draft_vocab.json")
    out.update(params=n_params, target=str(src), folder=str(folder), config=asdict(cfg))
    write_stats("mtp", out)
