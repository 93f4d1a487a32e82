"""EAGLE-3 for a target this project did not train (`python -m training eagle3 --target PATH`).

The data are the target's own chat responses (`python -m training chat-data`). The frozen target's
features are computed once over them (SpecForge's offline mode): per token the three auxiliary
layer boundaries (bf16), the final normed hidden state (bf16, from which the target's distribution
over the draft vocabulary is recomputed with its LM head's rows) and the argmax over the whole
vocabulary. Training then reads only the store, so an epoch costs the head's work alone and the
data can be seen several times.

The loss counts the positions whose next token is part of the response (the prompt is context,
as SpecForge's loss mask has it); sequences are cut at ``--seq-len`` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from . import pipeline
from .chat_data import OUT as CHAT_DIR
from .eagle3 import Eagle3Config, Eagle3Head, save_eagle3, scored_rows, target_features, ttt_loss
from .pipeline import log, train_config, write_stats


def load_published_target(path: str, dtype: str = "bfloat16"):
    """A frozen transformers model from a checkpoint folder or a GGUF file (dequantized by
    transformers' GGUF loader: the reference the engine's own GGUF reader is tested against)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": getattr(torch, dtype), "attn_implementation": "sdpa"}
    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class FeatureStore:
    """The frozen target's features of a list of sequences, concatenated, with offsets."""

    def __init__(self, data: dict) -> None:
        self.ids, self.aux, self.hnorm, self.argmax = data["ids"], data["aux"], data["hnorm"], data["argmax"]
        self.offsets, self.prompt_lens = data["offsets"], data["prompt_lens"]

    @classmethod
    def build(cls, target, seqs: list[dict], aux_ids: tuple[int, ...], seq_len: int, batch: int = 8) -> FeatureStore:
        features = target_features(target, aux_ids)
        lens = [min(len(s["ids"]), seq_len) for s in seqs]
        order = sorted(range(len(seqs)), key=lambda i: lens[i])
        chunks: dict[int, tuple[torch.Tensor, ...]] = {}
        hidden = {}
        target.model.norm.register_forward_hook(lambda mod, inp, out: hidden.__setitem__("norm", out))
        done = 0
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            width = max(lens[i] for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, :lens[i]] = torch.tensor(seqs[i]["ids"][:lens[i]])
            aux, logits = features(ids)  # right padding: causal attention keeps real positions exact
            for r, i in enumerate(idx):
                n = lens[i]
                chunks[i] = (ids[r, :n], aux[r, :n].bfloat16(), hidden["norm"][r, :n].bfloat16(),
                             logits[r, :n].argmax(-1).int())
            done += sum(lens[i] for i in idx)
            if (start // batch) % 25 == 0:
                log(f"eagle3 features: {start + len(idx)}/{len(seqs)} sequences, {done} tokens")
        parts = [chunks[i] for i in range(len(seqs))]
        offsets = torch.tensor([0] + lens).cumsum(0)
        return cls({"ids": torch.cat([p[0] for p in parts]), "aux": torch.cat([p[1] for p in parts]),
                    "hnorm": torch.cat([p[2] for p in parts]), "argmax": torch.cat([p[3] for p in parts]),
                    "offsets": offsets, "prompt_lens": torch.tensor([s["prompt_len"] for s in seqs])})

    def save(self, path: Path) -> None:
        torch.save({"ids": self.ids, "aux": self.aux, "hnorm": self.hnorm, "argmax": self.argmax,
                    "offsets": self.offsets, "prompt_lens": self.prompt_lens}, path)

    @classmethod
    def load(cls, path: Path) -> FeatureStore:
        return cls(torch.load(path))

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def response_tokens(self) -> torch.Tensor:
        """The token ids the target generated (every sequence's part after its prompt)."""
        return torch.cat([self.ids[self.offsets[i] + self.prompt_lens[i]:self.offsets[i + 1]]
                          for i in range(len(self))])

    def batch(self, index: list[int]) -> tuple[torch.Tensor, ...]:
        """Right-padded (ids, aux, hnorm, argmax, scored) of the sequences ``index``; ``scored``
        marks the positions whose next token is a response token."""
        lens = [int(self.offsets[i + 1] - self.offsets[i]) for i in index]
        width = max(lens)
        b = len(index)
        ids = torch.zeros(b, width, dtype=torch.long)
        aux = torch.zeros(b, width, self.aux.shape[1], dtype=self.aux.dtype)
        hnorm = torch.zeros(b, width, self.hnorm.shape[1], dtype=self.hnorm.dtype)
        argmax = torch.zeros(b, width, dtype=torch.long)
        scored = torch.zeros(b, width, dtype=torch.bool)
        for r, (i, n) in enumerate(zip(index, lens, strict=True)):
            lo = int(self.offsets[i])
            ids[r, :n] = self.ids[lo:lo + n]
            aux[r, :n] = self.aux[lo:lo + n]
            hnorm[r, :n] = self.hnorm[lo:lo + n]
            argmax[r, :n] = self.argmax[lo:lo + n].long()
            scored[r, max(int(self.prompt_lens[i]) - 1, 0):n - 1] = True
        return ids, aux, hnorm, argmax, scored


class StoreSampler:
    """Shuffled batches of sequence indices of a `FeatureStore`, by epoch, resumable (the
    `trainer.train_loop` sampler interface). Each epoch's shuffled order is cut into pools of
    ``pool`` batches; a pool is sorted by length before it is cut into batches, so that a batch
    pads little, and the batches are shuffled again."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, pool: int = 32) -> None:
        self.lengths, self.batch_size, self.seed, self.pool = lengths, batch_size, seed, pool
        self.epoch = self.pos = 0
        self._batches = self._make_batches()

    def _make_batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        usable = len(order) - len(order) % self.batch_size
        batches = []
        step = self.pool * self.batch_size
        for start in range(0, usable, step):
            pool = sorted(order[start:min(start + step, usable)], key=lambda i: self.lengths[i])
            batches += [pool[i:i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
        perm = torch.randperm(len(batches), generator=g).tolist()
        return [batches[i] for i in perm]

    def next_batch(self) -> list[int]:
        if self.pos >= len(self._batches):
            self.epoch, self.pos = self.epoch + 1, 0
            self._batches = self._make_batches()
        self.pos += 1
        return self._batches[self.pos - 1]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._batches = self._make_batches()


def store_loss_fn(head: Eagle3Head, store: FeatureStore, embed_weight: torch.Tensor, lm_rows: torch.Tensor,
                  token_ids: torch.Tensor, steps: int):
    """The TTT loss (`eagle3.ttt_loss`) of a batch of sequence indices of ``store``: the target's
    draft-vocabulary distribution is ``softmax(hnorm @ lm_rows.T)``, its LM head's rows."""
    in_draft = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    in_draft[token_ids] = True

    def fn(index: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        dtype = head.fc.weight.dtype
        ids, aux, hnorm, argmax, scored = store.batch(index)
        with torch.no_grad():
            row_of = scored_rows(argmax, in_draft, scored)
            t_probs = (hnorm[row_of >= 0].to(lm_rows.dtype) @ lm_rows.T).float().softmax(-1)
            embeds = embed_weight[ids].to(dtype)
        return ttt_loss(head, aux.to(dtype), embeds, t_probs, row_of, argmax, token_ids, steps)

    return fn


def ranked_tokens(tokens: torch.Tensor, vocab_size: int) -> list[int]:
    """Token ids by falling frequency in ``tokens`` (ties by id), every id of the vocabulary."""
    counts = torch.bincount(tokens, minlength=vocab_size)
    return sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))


@torch.no_grad()
def heldout_agreement(head: Eagle3Head, store: FeatureStore, embed_weight, lm_rows, token_ids, steps: int) -> dict:
    """Per TTT step, how often the head's top token equals the target's on the held-out responses
    (teacher-forced along the target's own continuation, the step's own earlier drafts fed back)."""
    head.eval()
    hits = torch.zeros(steps)
    count = torch.zeros(steps)
    in_draft = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    in_draft[token_ids] = True
    for start in range(0, len(store), 8):
        ids, aux, hnorm, argmax, scored = store.batch(list(range(start, min(start + 8, len(store)))))
        n = ids.shape[1] - steps
        outs = head.unroll(aux.to(head.fc.weight.dtype), embed_weight[ids].to(head.fc.weight.dtype), steps)
        for s, lg in enumerate(outs):
            m = scored[:, s + 1:s + 1 + n]
            hits[s] += ((token_ids[lg.argmax(-1)] == argmax[:, s + 1:s + 1 + n]) & m).sum()
            count[s] += m.sum()
    head.train()
    return {"agreement_per_step": [round(float(h / max(c, 1)), 4) for h, c in zip(hits, count, strict=True)],
            "positions": int(count[0])}


def train_published(args: argparse.Namespace) -> None:
    """`eagle3 --target PATH`: features of the chat data (``--data``, default runs/chat; cached there
    as features_*.pt), then the head, saved in ``--out``."""
    cfg = train_config(args, "eagle3-published")
    target = load_published_target(args.target, args.dtype)
    t = target.config
    layers = t.num_hidden_layers
    aux_ids = tuple(int(i) for i in args.aux_layers.split(",")) if args.aux_layers else (2, layers // 2, layers - 3)
    data = Path(args.data) if args.data else CHAT_DIR
    stores = {}
    for split in ("train", "heldout"):
        path = data / f"features_{split}_{'-'.join(map(str, aux_ids))}_{args.seq_len}.pt"
        if not path.exists():
            seqs = torch.load(data / f"{split}.pt")
            log(f"eagle3: computing the target's features of {len(seqs)} {split} sequences -> {path}")
            FeatureStore.build(target, seqs, aux_ids, args.seq_len).save(path)
        stores[split] = FeatureStore.load(path)
    train, held = stores["train"], stores["heldout"]
    responses = train.response_tokens()
    init_state = None
    if args.init_from:  # its draft vocabulary, which its LM head's rows are for
        from safetensors.torch import load_file

        init_state = load_file(str(Path(args.init_from) / "model.safetensors"))
        token_ids = init_state["t2d"].nonzero().flatten().long()
    else:
        token_ids = torch.tensor(sorted(ranked_tokens(responses, t.vocab_size)[:args.draft_vocab_size]),
                                 dtype=torch.long)
    in_draft = torch.zeros(t.vocab_size, dtype=torch.bool)
    in_draft[token_ids] = True
    coverage = float(in_draft[responses].float().mean())
    log(f"eagle3: {len(train)} training sequences ({train.ids.numel()} tokens, {responses.numel()} in responses); "
        f"the draft vocabulary ({token_ids.numel()}) covers {coverage:.4f} of the response tokens")
    c = Eagle3Config(
        hidden_size=t.hidden_size, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        intermediate_size=args.head_intermediate_size or t.intermediate_size, vocab_size=t.vocab_size,
        draft_vocab_size=token_ids.numel(), aux_layer_ids=aux_ids, rms_norm_eps=t.rms_norm_eps,
        rope_theta=float((getattr(t, "rope_parameters", None) or {}).get("rope_theta", getattr(t, "rope_theta", 1e4))),
        max_position_embeddings=t.max_position_embeddings,
    )
    torch.manual_seed(cfg.seed + 5)
    head = Eagle3Head(c)
    lm_rows = target.get_output_embeddings().weight[token_ids].detach()
    embed_weight = target.get_input_embeddings().weight.detach()
    with torch.no_grad():  # the head's LM head and norm start as the target's (the draft vocabulary's rows)
        head.lm_head.weight.copy_(lm_rows)
        head.norm.weight.copy_(target.model.norm.weight)
    if init_state is not None:
        head.load_state_dict({k: v.float() for k, v in init_state.items() if k not in ("d2t", "t2d")})
        log(f"eagle3: initialized from {args.init_from} (its draft vocabulary of {token_ids.numel()})")
    del target
    n_params = sum(p.numel() for p in head.parameters())
    log(f"eagle3: {n_params / 1e6:.2f}M params, ttt_steps {args.ttt_steps}, {c}, config {asdict(cfg)}")
    loss_fn = store_loss_fn(head, train, embed_weight, lm_rows, token_ids, args.ttt_steps)
    sampler = StoreSampler(train.lengths(), cfg.batch_size, cfg.seed + 5)
    from .trainer import train_loop

    if args.measure_steps:
        from dataclasses import replace

        tcfg = replace(cfg, planned_tokens=cfg.tokens_per_step * args.measure_steps, warmup_steps=1, max_minutes=60)
        out = train_loop(tcfg, head, loss_fn, sampler, None, log=log, progress=False)
        log(f"measure: {args.measure_steps} steps, {out['elapsed_s'] / args.measure_steps:.2f} s/step")
        return
    out = train_loop(cfg, head, loss_fn, sampler, pipeline.CKPTS / "eagle3-published.pt", resume=args.resume,
                     log=log, max_threads=args.threads)
    agreement = heldout_agreement(head.float(), held, embed_weight.float(), lm_rows.float(), token_ids, args.ttt_steps)
    log(f"eagle3: held-out agreement {agreement}")
    folder = Path(args.out)
    save_eagle3(head, token_ids, folder)
    cfg_json = json.loads((folder / "config.json").read_text())
    cfg_json["target"] = Path(args.target).name
    (folder / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    out.update(params=n_params, ttt_steps=args.ttt_steps, head=asdict(c), config=asdict(cfg),
               target=Path(args.target).name, draft_vocab_coverage=coverage,
               train_sequences=len(train), train_tokens=int(train.ids.numel()),
               response_tokens=int(responses.numel()),
               epochs=round(sampler.epoch + sampler.pos / max(len(sampler._batches), 1), 3),
               heldout=agreement)
    write_stats("eagle3-published", out)

