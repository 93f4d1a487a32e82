"""MTP proposer: Medusa-style residual heads on the target's last hidden state.

Head i maps h_t to h_t + SiLU(W_i h_t + b_i) and, through the target's own LM head (shared in
memory, not copied; or its draft-vocabulary rows, see `draft_vocab.py`), predicts token t+i+2. At propose time the request's last committed position
is t = N-2 (token N-1 was just sampled from h_{N-2}), so head i drafts token N+i: k drafts in one
pass, no KV cache. Drafts of sampled requests come with their probabilities (exactness).
Per request it keeps one hidden row: the target's state at the last committed position.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

from engine.errors import CheckpointError, DrafterMismatchError
from engine.models.loader import load_safetensors
from engine.request import Request
from engine.spec.proposers.base import (
    Draft,
    DrafterIdentity,
    ProposeContext,
    Proposer,
    StepTimer,
    may_draft,
    model_name,
    weights_digest,
)
from engine.spec.proposers.draft_vocab import DraftLMHead, resolve_draft_token_ids
from engine.spec.proposers.features import HiddenRows, committed_hidden, import_hidden_rows


def read_head_config(model_dir: str, expected_arch: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"drafter directory {model_dir!r} has no config.json")
    with open(path) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    if expected_arch not in archs:
        raise DrafterMismatchError(f"{model_dir!r} is not an {expected_arch} checkpoint (architectures={archs})")
    return cfg


def check_head_matches_target(model_dir: str, runner, hidden: int, vocab: int, target_name: str | None) -> None:
    arch = runner.arch
    problems = []
    if hidden != arch.hidden_size:
        problems.append(f"hidden size {hidden} vs the target's {arch.hidden_size}")
    if vocab != arch.vocab_size:
        problems.append(f"vocab size {vocab} vs the target's {arch.vocab_size}")
    if target_name and os.path.basename(os.path.normpath(target_name)) != os.path.basename(
        os.path.normpath(runner.model_dir)
    ):
        problems.append(f"it was trained for target {target_name!r}, not {runner.model_dir!r}")
    if problems:
        raise DrafterMismatchError(
            f"drafter {model_dir!r} does not match target {runner.model_dir!r}: " + "; ".join(problems)
        )


class MTPProposer(Proposer):
    method = "mtp"
    needs_hidden_states = True

    def __init__(self, model_dir: str, runner, draft_vocab_size: int | None = None) -> None:
        super().__init__()
        self.states: dict[str, HiddenRows] = {}  # one row: the last committed position's state
        cfg = read_head_config(model_dir, "MedusaHeads")
        check_head_matches_target(model_dir, runner, cfg["hidden_size"], cfg["vocab_size"], cfg.get("target"))
        self.num_heads = int(cfg["num_heads"])
        self.max_k = self.num_heads
        self.device, self.dtype = runner.device, runner.dtype
        weights = load_safetensors(model_dir)
        self.weight = torch.stack([weights[f"heads.{i}.linear.weight"] for i in range(self.num_heads)]).to(
            self.device, self.dtype
        )  # [heads, H, H]
        self.bias = torch.stack([weights[f"heads.{i}.linear.bias"] for i in range(self.num_heads)]).to(
            self.device, self.dtype
        )  # [heads, H]
        # the target's LM head, in place, or a copy of its draft-vocabulary rows
        self.head = DraftLMHead(
            runner.model.lm_head.weight,
            resolve_draft_token_ids(draft_vocab_size, model_dir, runner.arch.vocab_size),
        )
        self.timer = StepTimer(2e-4)  # one pass of all heads
        self._identity = DrafterIdentity(
            model_name(model_dir), weights_digest([("weight", self.weight), ("bias", self.bias)]), self.head.size
        )

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
        state = import_hidden_rows("MTP", state, self.weight.shape[-1], num_computed_tokens, self.device, self.dtype)
        if state.rows.shape[0] != 1:
            raise ValueError(f"MTP state must hold one hidden row, got {state.rows.shape[0]}")
        self.states[request_id] = state

    @property
    def num_parameters(self) -> int:
        return self.weight.numel() + self.bias.numel() + self.head.num_parameters

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
            raise AssertionError(f"MTP keeps one hidden row per request, found {over}")

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        t0 = time.perf_counter()
        last = []
        for r in requests:
            state = self.states.get(r.request_id)
            if state is None or state.start != r.num_tokens - 2:
                raise RuntimeError(
                    f"MTP: request {r.request_id!r} cannot draft: it needs the hidden state of position "
                    f"{r.num_tokens - 2}, it keeps {None if state is None else state.start}"
                )
            last.append(state.rows[0])
        h = torch.stack(last)  # [B, H]
        k = max(num_tokens)
        # [B, k, H]: h + silu(W_i h + b_i) for heads 0..k-1
        z = torch.einsum("bh,koh->bko", h, self.weight[:k]) + self.bias[:k]
        feats = h.unsqueeze(1) + F.silu(z)  # [B, k, H]
        rows = [(b, i) for b, kb in enumerate(num_tokens) for i in range(kb)]
        owners = [requests[b] for b, _ in rows]
        flat = feats[[b for b, _ in rows], [i for _, i in rows]]  # [sum k, H]
        picked, probs = self.head.sample(flat, owners, context.generators_for(owners))
        drafts, at = [], 0
        for r, kb in zip(requests, num_tokens, strict=True):
            p = probs[at : at + kb] if probs is not None and not r.sampling_params.is_greedy else None
            drafts.append(Draft(picked[at : at + kb], p))
            at += kb
        self.timer.add(len(requests), time.perf_counter() - t0)
        return drafts
