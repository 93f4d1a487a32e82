"""Medusa proposer: independent residual heads on the target's last final-norm hidden state.

Head i applies its residual blocks to h_t (x <- x + SiLU(W x + b), one or more per head) and its
LM head predicts token t+i+2. At propose time the request's last committed position is t = N-2
(token N-1 was just sampled from h_{N-2}), so head i drafts token N+i: k drafts in one pass, no KV
cache. Drafts of sampled requests come with their probabilities (exactness). Per request it keeps
one hidden row: the target's state at the last committed position.

Two layouts load:
- ours (`architectures: ["MedusaHeads"]`, `num_heads`): one block per head, `heads.{i}.linear.*`,
  and the target's own LM head (shared in memory, not copied; or its draft-vocabulary rows, see
  `draft_vocab.py`);
- the published Medusa-1 layout (FasterDecoding/Medusa, as TensorRT-LLM and vLLM's converter read
  it): config `medusa_num_heads`, `medusa_num_layers` (and the base model's `hidden_size`,
  `vocab_size` when present); tensors `{i}.{j}.linear.weight/bias` for block j of head i and
  `{i}.{medusa_num_layers}.weight` for head i's own LM head [V, H], optionally under a
  `medusa_head.` prefix (the whole model's state dict); in medusa_lm_head.safetensors,
  model.safetensors or the repo's medusa_lm_head.pt.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.errors import CheckpointError, DrafterMismatchError
from engine.request import Request
from engine.spec_decode.proposers.base import (
    Draft,
    DrafterIdentity,
    ProposeContext,
    Proposer,
    StepTimer,
    may_draft,
    model_name,
    penalized,
    sample_drafts,
    weights_digest,
)
from engine.spec_decode.proposers.checkpoint import (
    check_head_matches_target,
    check_tensors,
    load_tensors,
    read_config,
    refuse_unused,
)
from engine.spec_decode.proposers.draft_vocab import DraftLMHead, resolve_draft_token_ids
from engine.spec_decode.proposers.feature_buffers import HiddenRows, committed_hidden, import_hidden_rows

OUR_ARCHITECTURE = "MedusaHeads"
PUBLISHED_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class MedusaProposer(Proposer):
    method = "medusa"
    needs_hidden_states = True

    def __init__(self, model_dir: str, runner, draft_vocab_size: int | None = None) -> None:
        super().__init__()
        self.states: dict[str, HiddenRows] = {}  # one row: the last committed position's state
        self.device, self.dtype = runner.device, runner.dtype
        cfg = read_config(model_dir)
        h, vocab = runner.arch.hidden_size, runner.arch.vocab_size
        w = load_tensors(model_dir, PUBLISHED_FILES)
        draft_ids = resolve_draft_token_ids(draft_vocab_size, model_dir, vocab)
        if OUR_ARCHITECTURE in (cfg.get("architectures") or []):
            check_head_matches_target(
                model_dir, runner, cfg["hidden_size"], cfg["vocab_size"], cfg.get("target")
            )
            self.num_heads, num_blocks = int(cfg["num_heads"]), 1
            names = {(i, 0): f"heads.{i}.linear." for i in range(self.num_heads)}
            lm_heads: list[torch.Tensor | None] = [None] * self.num_heads
        elif "medusa_num_heads" in cfg:
            check_head_matches_target(
                model_dir, runner, cfg.get("hidden_size", h), cfg.get("vocab_size", vocab), None
            )
            self.num_heads, num_blocks = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
            prefix = "medusa_head." if any(k.startswith("medusa_head.") for k in w) else ""
            names = {
                (i, j): f"{prefix}{i}.{j}.linear." for i in range(self.num_heads) for j in range(num_blocks)
            }
            lm_heads = [f"{prefix}{i}.{num_blocks}.weight" for i in range(self.num_heads)]
        else:
            raise DrafterMismatchError(
                f"{model_dir!r} is not a Medusa checkpoint: neither architectures [{OUR_ARCHITECTURE!r}] nor the "
                f"published config's `medusa_num_heads` (architectures={cfg.get('architectures')})"
            )
        if self.num_heads < 1 or num_blocks < 0:
            raise CheckpointError(
                f"{model_dir!r}: Medusa needs at least one head, got {self.num_heads} heads of {num_blocks} blocks"
            )
        expected = {}
        for p in names.values():
            expected |= {p + "weight": (h, h), p + "bias": (h,)}
        expected |= {name: (vocab, h) for name in lm_heads if name is not None}
        check_tensors(w, expected, "Medusa", model_dir)
        refuse_unused(w, expected, "Medusa", model_dir)
        self.max_k = self.num_heads

        def stack(suffix: str) -> torch.Tensor:  # [heads, blocks, ...]
            return torch.stack(
                [
                    torch.stack([w[names[i, j] + suffix] for j in range(num_blocks)])
                    for i in range(self.num_heads)
                ]
            ).to(self.device, self.dtype)

        empty = dict(dtype=self.dtype, device=self.device)
        self.weight = (
            stack("weight") if num_blocks else torch.empty(self.num_heads, 0, h, h, **empty)
        )  # [heads, blocks, H, H]
        self.bias = (
            stack("bias") if num_blocks else torch.empty(self.num_heads, 0, h, **empty)
        )  # [heads, blocks, H]
        # the target's LM head in place (or a copy of its draft-vocabulary rows), else head i's own
        shared = self._shared_head = DraftLMHead(runner.model.lm_head.weight, draft_ids)
        self.heads = [
            shared if name is None else DraftLMHead(w[name].to(self.device, self.dtype), draft_ids)
            for name in lm_heads
        ]
        self.timer = StepTimer(2e-4)  # one pass of all heads
        named = [("weight", self.weight), ("bias", self.bias)] + [
            (f"lm_head.{i}", head.weight) for i, head in enumerate(self.heads) if head is not shared
        ]
        self._identity = DrafterIdentity(model_name(model_dir), weights_digest(named), shared.size)

    @property
    def head(self) -> DraftLMHead:
        """Head 0's LM head (every head's, in our layout)."""
        return self.heads[0]

    def identity(self) -> DrafterIdentity:
        return self._identity

    def export_state(self, request_id: str) -> HiddenRows | None:
        state = self.states.get(request_id)
        return None if state is None else state.to("cpu")

    def import_state(self, request_id: str, state, num_computed_tokens: int) -> None:
        """One row: the last committed position's hidden state. Every step replaces it, so a
        request imported without it drafts again after its first step here."""
        if state is None:
            return
        state = import_hidden_rows(
            "Medusa", state, self.weight.shape[-1], num_computed_tokens, self.device, self.dtype
        )
        if state.rows.shape[0] != 1:
            raise ValueError(f"Medusa state must hold one hidden row, got {state.rows.shape[0]}")
        self.states[request_id] = state

    @property
    def num_parameters(self) -> int:
        heads = {id(head): head for head in self.heads}.values()
        return (
            self.weight.numel()
            + self.bias.numel()
            + sum(head.num_parameters if head is self._shared_head else head.weight.numel() for head in heads)
        )

    def buffer_bytes(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        return max_num_seqs * self.weight.shape[-1] * self.weight.element_size()

    def step_cost(self, num_requests: int, k: int) -> float:
        return self.timer.seconds(num_requests)

    def observe_step(self, sched, runner_out) -> None:
        for r, start, rows in committed_hidden(sched, runner_out):
            if may_draft(r):
                self.states[r.request_id] = HiddenRows(start + rows.shape[0] - 1, rows[-1:].clone())

    def check_no_leaks(self, live_ids: set[str]) -> None:
        super().check_no_leaks(live_ids)
        over = {rid: st.rows.shape[0] for rid, st in self.states.items() if st.rows.shape[0] != 1}
        if over:
            raise AssertionError(f"Medusa keeps one hidden row per request, found {over}")

    def features(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """Heads 0..k-1 on rows h [B, H]: their blocks' outputs [B, k, H]."""
        x = h.unsqueeze(1).expand(-1, k, -1)
        for j in range(self.weight.shape[1]):  # x + silu(W_ij x + b_ij) for heads i < k
            x = x + F.silu(torch.einsum("bkh,koh->bko", x, self.weight[:k, j]) + self.bias[:k, j])
        return x

    def _sample(self, logits: torch.Tensor, rows: list[tuple[int, int]], owners: list[Request],
                context: ProposeContext) -> tuple[list[int], torch.Tensor | None]:
        """Each row's draft (`sample_drafts`): rows[i] = (request, head). Under penalties head i's
        row counts the request's drafts of heads < i as its history, as the target's row that
        verifies it counts them, so heads are sampled one after another; else all at once."""
        head = self.head
        generators = context.generators_for(owners)
        if not penalized(owners, context):
            return sample_drafts(logits, owners, head.token_ids, head.vocab_size, generators)
        picked: list[int] = [0] * len(rows)
        probs: torch.Tensor | None = None
        before: dict[int, list[int]] = {}  # request (its index in the batch) -> its drafts so far
        for i in range(max(hi for _, hi in rows) + 1):
            at = [j for j, (_, hi) in enumerate(rows) if hi == i]
            got, p = sample_drafts(logits[at], [owners[j] for j in at], head.token_ids, head.vocab_size,
                                   [generators[j] for j in at], context.penalties,
                                   [before.get(rows[j][0], []) for j in at])
            for j, t in zip(at, got, strict=True):
                picked[j] = t
                before.setdefault(rows[j][0], []).append(t)
            if p is not None:  # (None: every row of this head greedy, its probabilities unused)
                if probs is None:
                    probs = p.new_zeros(len(rows), p.shape[1])
                probs[at] = p
        return picked, probs

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        t0 = time.perf_counter()
        last = []
        for r in requests:
            state = self.states.get(r.request_id)
            if state is None or state.start != r.num_tokens - 2:
                raise RuntimeError(
                    f"Medusa: request {r.request_id!r} cannot draft: it needs the hidden state of position "
                    f"{r.num_tokens - 2}, it keeps {None if state is None else state.start}"
                )
            last.append(state.rows[0])
        k = max(num_tokens)
        feats = self.features(torch.stack(last), k)  # [B, k, H]
        rows = [(b, i) for b, kb in enumerate(num_tokens) for i in range(kb)]
        owners = [requests[b] for b, _ in rows]
        flat = feats[[b for b, _ in rows], [i for _, i in rows]]  # [sum k, H]
        head = self.head
        if all(h is head for h in self.heads[:k]):
            logits = head(flat)  # [sum k, N]
        else:  # each head its own LM head
            logits = torch.empty(len(rows), head.size, dtype=torch.float32, device=flat.device)
            for i in range(k):
                sel = torch.tensor([at for at, (_, hi) in enumerate(rows) if hi == i], device=flat.device)
                logits[sel] = self.heads[i](flat[sel])
        picked, probs = self._sample(logits, rows, owners, context)
        drafts, at = [], 0
        for r, kb in zip(requests, num_tokens, strict=True):
            p = probs[at : at + kb] if probs is not None and not r.sampling_params.is_greedy else None
            drafts.append(Draft(picked[at : at + kb], p))
            at += kb
        self.timer.add(len(requests), time.perf_counter() - t0)
        return drafts
