"""EAGLE-3 head training (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"), post-hoc on the frozen shipped target, saved in the
published layout the engine's `eagle3` proposer (and vLLM / SGLang) load.

The head, for element j (a committed target position):

    g_j   = fc(cat(a_j^low, a_j^mid, a_j^high))             # the target's residual stream at three
                                                            # layer boundaries, 3H -> H, no bias
    x     = cat(input_layernorm(embed(token_{j+1})), hidden_norm(g_j))   # [2H]
    r     = g_j + o_proj(attention(q/k/v(x)))               # RoPE position j
    out_j = r + mlp(post_attention_layernorm(r))
    logits_j = lm_head(norm(out_j))                         # over the draft vocabulary, predicts
                                                            # token_{j+2}

**Training-time test.** At inference the head drafts autoregressively: after drafting from element
j it forms element j+1 from its OWN output feature out_j and the drafted token, at position j+1,
attending to the committed elements 0..j (their keys were computed from the target's features)
and to its own earlier drafted elements. Training unrolls exactly that for `ttt_steps` steps: at
step s index j holds (out^{s-1}_j, embed(token_{j+s+1})) at RoPE position j+s; its query attends
to the step-0 keys of indices 0..j (causal) and to the keys of steps 1..s at index j (the
diagonal: its own chain), as in the paper and SpecForge. Step s at index j is scored against the
target's distribution at position j+s+1, i.e. for token j+s+2. Gradients flow through the unrolled
features (not detached). Loss: sum over steps of 0.8^s * the cross-entropy between the target's
softmax restricted to the draft vocabulary and the head's softmax, over positions whose target
argmax lies in the draft vocabulary (SpecForge's loss).

The draft vocabulary is the `--draft-vocab-size` most frequent training tokens (the same ranking
as the other drafters' draft_vocab.json), sorted by id; `d2t[i] = token_ids[i] - i` and `t2d` is
the membership mask, as published heads store them. The head uses the target's embedding (no
`embed_tokens.weight` is saved); its `lm_head` and `norm` start as the target's (the draft
vocabulary's rows of the target's LM head, the target's final norm) and are trained.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from . import pipeline
from .pipeline import fit, load_streams, load_target, log, train_config, write_stats

TTT_DECAY = 0.8


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def to_json_dict(self, target: str = "target") -> dict:
        """config.json in the published EAGLE-3 layout (SpecForge's LlamaForCausalLMEagle3)."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
            "target": target,
        }


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        h2 = 2 * c.hidden_size
        self.q_proj = nn.Linear(h2, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(h2, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(h2, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = _MLP(c)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, n, d]; cos/sin [n, d] (HF's rotate_half convention)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Eagle3Head(nn.Module):
    """The trainable head; parameter names are the published checkpoint's keys."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _qkv(self, embeds: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor):
        c, m = self.config, self.midlayer
        b, n, _ = feats.shape
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(feats)], dim=-1)
        q = m.self_attn.q_proj(x).view(b, n, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = m.self_attn.k_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = m.self_attn.v_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self._cos_sin(positions, feats.dtype)
        group = c.num_attention_heads // c.num_key_value_heads
        k = _rope(k, cos, sin).repeat_interleave(group, dim=1)
        return _rope(q, cos, sin), k, v.repeat_interleave(group, dim=1)

    def _finish(self, feats: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        m = self.midlayer
        b, _, n, _ = attn.shape
        r = feats + m.self_attn.o_proj(attn.transpose(1, 2).reshape(b, n, -1))
        return r + m.mlp(m.post_attention_layernorm(r))

    def unroll(self, aux: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over a batch: aux [B, T, 3H] (target features at positions 0..T-1),
        embeds [B, T, H] (embeddings of tokens 0..T-1). Uses indices j < n = T - steps; returns
        the draft-vocabulary logits [B, n, N] of steps 0..steps-1 (step s index j predicts token
        j + s + 2)."""
        return [self.lm_head(self.norm(f)) for f in self.unroll_features(aux, embeds, steps)]

    def unroll_features(self, aux: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """`unroll`'s output features [B, n, H] per step, before the final norm and LM head (the
        loss projects only the positions it scores)."""
        c = self.config
        n = aux.shape[1] - steps
        scale = c.head_dim**-0.5
        feats = self.fc(aux[:, :n])
        causal = torch.ones(n, n, dtype=torch.bool, device=aux.device).tril()
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        out: list[torch.Tensor] = []
        base = torch.arange(n, device=aux.device)
        for s in range(steps):
            q, k, v = self._qkv(embeds[:, s + 1 : s + 1 + n], feats, base + s)
            if s == 0:
                k0, v0 = k, v
                scores = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
                attn = scores.softmax(-1) @ v0
            else:
                keys.append((k, v))
                s0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
                diag = torch.stack([(q * kr).sum(-1) * scale for kr, _ in keys], dim=-1)  # [B, h, n, s]
                w = torch.cat([s0, diag], dim=-1).softmax(-1)
                attn = w[..., :n] @ v0
                for r, (_, vr) in enumerate(keys):
                    attn = attn + w[..., n + r, None] * vr
            feats = self._finish(feats, attn)
            out.append(feats)
        return out


def draft_vocabulary(ranked_token_ids: list[int], size: int) -> torch.Tensor:
    """The `size` most frequent token ids, sorted by id (the order d2t offsets assume)."""
    return torch.tensor(sorted(ranked_token_ids[:size]), dtype=torch.long)


def target_features(target: nn.Module, aux_ids: tuple[int, ...]):
    """A function batch [B, T] -> (aux [B, T, len(aux_ids) * H], logits [B, T, V] float32) of the
    frozen target (HF LlamaForCausalLM): the head's auxiliary features and the target's logits.
    Boundary b is the input of decoder layer b (HF's hidden_states[b]); b = L, the last layer's
    output, is taken before the final norm (HF's hidden_states[L] is after it), as the engine does."""
    num_layers = len(target.model.layers)
    last: dict[str, torch.Tensor] = {}
    if num_layers in aux_ids:
        target.model.layers[-1].register_forward_hook(
            lambda mod, inp, out: last.__setitem__("out", out[0] if isinstance(out, tuple) else out))

    @torch.no_grad()
    def fn(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = target.model(input_ids=batch, output_hidden_states=True)
        aux = torch.cat([last["out"] if i == num_layers else out.hidden_states[i] for i in aux_ids], dim=-1)
        return aux, target.lm_head(out.last_hidden_state).float()

    return fn


def load_eagle3_head(folder: Path) -> tuple[Eagle3Head, torch.Tensor]:
    """A saved head (`save_eagle3`'s layout) in float32 and its draft vocabulary's token ids."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(folder) / "config.json").read_text())
    c = Eagle3Config(
        hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        draft_vocab_size=cfg["draft_vocab_size"],
        aux_layer_ids=tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"],
        max_position_embeddings=cfg["max_position_embeddings"],
    )
    state = load_file(str(Path(folder) / "model.safetensors"))
    head = Eagle3Head(c)
    head.load_state_dict({k: v.float() for k, v in state.items() if k not in ("d2t", "t2d")})
    token_ids = state["d2t"].long() + torch.arange(c.draft_vocab_size)
    return head.eval(), token_ids


def scored_rows(t_argmax: torch.Tensor, in_draft: torch.Tensor, scored: torch.Tensor | None) -> torch.Tensor:
    """row_of [B, T]: for each position the loss counts (its target argmax in the draft vocabulary
    and, if given, ``scored`` set), its row in the flattened list of such positions; -1 elsewhere."""
    valid = in_draft[t_argmax]
    if scored is not None:
        valid = valid & scored
    row_of = valid.flatten().long().cumsum(0).view_as(valid) - 1
    return row_of.masked_fill(~valid, -1)


def ttt_loss(head: Eagle3Head, aux: torch.Tensor, embeds: torch.Tensor, t_probs: torch.Tensor,
             row_of: torch.Tensor, t_argmax: torch.Tensor, token_ids: torch.Tensor,
             steps: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The training-time-test loss of one batch. aux [B, T, 3H] and embeds [B, T, H] are the head's
    inputs; t_argmax [B, T] the target's argmax over the whole vocabulary; row_of [B, T]
    (`scored_rows`) the positions that count, as rows of t_probs [M, N]: the target's distribution
    there restricted to the draft vocabulary (``token_ids``). The head's LM head runs only on the
    rows that count."""
    n = aux.shape[1] - steps
    total = torch.zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    for s, feats in enumerate(head.unroll_features(aux, embeds, steps)):
        # step s index j <-> the target's distribution at position j + s + 1
        rows = row_of[:, s + 1 : s + 1 + n]
        m = rows >= 0
        lg = head.lm_head(head.norm(feats[m]))
        p = t_probs[rows[m]]
        logq = F.log_softmax(lg.float(), dim=-1)
        ce = -(p * logq).sum(-1).mean() if p.shape[0] else logq.sum() * 0.0
        total = total + TTT_DECAY**s * ce
        with torch.no_grad():
            agree = token_ids[lg.argmax(-1)] == t_argmax[:, s + 1 : s + 1 + n][m]
            metrics[f"acc{s}"] = float(agree.float().mean()) if agree.numel() else 0.0
        metrics[f"ce{s}"] = float(ce.detach())
    return total, metrics


def eagle3_loss_fn(head: Eagle3Head, target: nn.Module, token_ids: torch.Tensor, steps: int):
    """TTT loss on a [B, T] token batch; the frozen target (HF LlamaForCausalLM) supplies the
    auxiliary features (`target_features`) and the distributions."""
    in_draft = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    in_draft[token_ids] = True
    embed = target.get_input_embeddings()
    features = target_features(target, head.config.aux_layer_ids)

    def fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        dtype = head.fc.weight.dtype
        with torch.no_grad():
            aux, logits = features(batch)
            embeds = embed(batch).to(dtype)
        t_argmax = logits.argmax(-1)
        row_of = scored_rows(t_argmax, in_draft, None)
        t_probs = logits[row_of >= 0][:, token_ids].softmax(-1)
        return ttt_loss(head, aux.to(dtype), embeds, t_probs, row_of, t_argmax, token_ids, steps)

    return fn


def save_eagle3(head: Eagle3Head, token_ids: torch.Tensor, folder: Path, dtype=torch.bfloat16) -> None:
    """Write config.json and model.safetensors (fc, midlayer.*, norm, lm_head, d2t, t2d)."""
    folder.mkdir(parents=True, exist_ok=True)
    c = head.config
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()}
    tensors["d2t"] = token_ids - torch.arange(token_ids.numel())
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[token_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(c.to_json_dict(), indent=2) + "\n")



def train_eagle3(args: argparse.Namespace) -> None:
    """`eagle3`: train models/eagle3-head on the frozen shipped target, over the drafter's draft
    vocabulary (its draft_vocab.json ranking)."""
    cfg = train_config(args, "eagle3")
    train, _ = load_streams(cfg.seq_len, args.corpus)
    target = load_target(dtype=args.dtype)
    t = target.config
    ranked = json.loads((pipeline.MODELS / "drafter" / "draft_vocab.json").read_text())["ranked_token_ids"]
    token_ids = draft_vocabulary(ranked, args.draft_vocab_size)
    layers = t.num_hidden_layers
    c = Eagle3Config(
        hidden_size=t.hidden_size, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.hidden_size // t.num_attention_heads,
        intermediate_size=args.head_intermediate_size or t.intermediate_size, vocab_size=t.vocab_size,
        draft_vocab_size=token_ids.numel(),
        aux_layer_ids=tuple(int(i) for i in args.aux_layers.split(",")) if args.aux_layers else (2, layers // 2, layers - 3),
        rms_norm_eps=t.rms_norm_eps, rope_theta=float(t.rope_parameters["rope_theta"]),
        max_position_embeddings=t.max_position_embeddings,
    )
    torch.manual_seed(cfg.seed + 5)
    head = Eagle3Head(c)
    with torch.no_grad():  # start the head's LM head and norm at the target's (rows of the draft vocabulary)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[token_ids])
        head.norm.weight.copy_(target.model.norm.weight)
    if args.init_from:  # warm start: every tensor of an earlier head (e.g. trained on other aux layers)
        from safetensors.torch import load_file

        state = load_file(str(Path(args.init_from) / "model.safetensors"))
        head.load_state_dict({k: v.float() for k, v in state.items() if k not in ("d2t", "t2d")})
        log(f"eagle3: initialized from {args.init_from}")
    n_params = sum(p.numel() for p in head.parameters())
    log(f"eagle3: {n_params / 1e6:.2f}M params, ttt_steps {args.ttt_steps}, {c}, config {asdict(cfg)}")
    loss_fn = eagle3_loss_fn(head, target, token_ids, args.ttt_steps)
    out = fit(args, cfg, head, loss_fn, train, 5, "eagle3.pt")
    if out is None:
        return
    folder = pipeline.MODELS / "eagle3-head"
    save_eagle3(head, token_ids, folder)  # no tokenizer copy: the head reads the target's token ids
    out.update(params=n_params, ttt_steps=args.ttt_steps, head=asdict(c), config=asdict(cfg))
    write_stats("eagle3", out)
