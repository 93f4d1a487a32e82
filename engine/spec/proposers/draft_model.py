"""Draft-model proposer: a small model with the target's tokenizer, co-located on the same device.

Its paged KV cache has the same block layout as the target's and is indexed by the same block
tables, so it needs no block manager of its own. Its state per request (`DraftModelState`) counts
the request's tokens whose draft KV is valid: only committed tokens. Each round first catches up over
the tokens committed since the last round (accepted drafts + bonus token) in the same forward
pass that makes the first draft, then makes k-1 more one token at a time. Draft tokens' own KV
lands in lookahead slots and is simply overwritten next round. The count advances only once every
forward of the round has succeeded (a failed round is redone from the same point).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.errors import DrafterMismatchError
from engine.model_runner import (
    EXACT_ROWS,
    SeqChunk,
    allocate_kv_cache,
    build_forward_batch,
    kv_bytes_per_token,
)
from engine.models.llama import ROW_KERNEL
from engine.models.loader import load_model
from engine.request import Request
from engine.spec.proposers.base import (
    Draft,
    DrafterIdentity,
    ProposeContext,
    Proposer,
    StepTimer,
    model_name,
    weights_digest,
)
from engine.spec.proposers.draft_vocab import DraftLMHead, resolve_draft_token_ids


@dataclass
class DraftModelState:
    num_computed: int = 0  # the request's first tokens whose draft KV is valid (committed tokens)


class DraftModelProposer(Proposer):
    method = "draft"

    def __init__(self, model_dir: str, runner, draft_vocab_size: int | None = None) -> None:
        super().__init__()
        self.states: dict[str, DraftModelState] = {}
        self.device, self.dtype = runner.device, runner.dtype
        self.model, _ = load_model(model_dir, self.dtype, self.device, runner.model.rope_cos.shape[0])
        self.backend = runner.backend
        target_vocab, draft_vocab = runner.arch.vocab_size, self.model.cfg.vocab_size
        if target_vocab != draft_vocab:
            raise DrafterMismatchError(
                f"drafter {model_dir!r} has vocab_size {draft_vocab} but the target "
                f"{runner.model_dir!r} has {target_vocab}; a draft model must share the target's tokenizer"
            )
        self.head = DraftLMHead(
            self.model.lm_head.weight, resolve_draft_token_ids(draft_vocab_size, model_dir, draft_vocab)
        )
        # Small draft steps through the fused CPU row path (kernels/cpu_rows.cpp) where the target's runs.
        self.row_kernel = runner.row_kernel
        if self.row_kernel:
            self.model.prepare_rows()
            self.head.use_row_kernel(self.model.packed_lm_head())
        self.block_size = 0
        self.timer = StepTimer(1e-3)  # one draft forward, averaged over a round
        self._identity = DrafterIdentity(
            model_name(model_dir), weights_digest(self.model.named_parameters()), self.head.size
        )

    def identity(self) -> DrafterIdentity:
        return self._identity

    def export_state(self, request_id: str) -> DraftModelState | None:
        state = self.states.get(request_id)
        return None if state is None else DraftModelState(state.num_computed)

    def import_state(self, request_id: str, state, num_computed_tokens: int) -> None:
        """The draft KV of the state's first `num_computed` tokens comes with the handoff's
        `drafter_kv`; without a state the next round catches up over the whole context."""
        if state is None:
            return
        if not isinstance(state, DraftModelState) or not 0 <= state.num_computed <= num_computed_tokens + 1:
            raise ValueError(
                f"draft model state must be a DraftModelState with 0 <= num_computed <= "
                f"{num_computed_tokens + 1}, got {state!r}"
            )
        self.states[request_id] = DraftModelState(state.num_computed)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters()) + self.head.num_parameters

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv_caches = allocate_kv_cache(self.model.cfg, num_blocks, block_size, self.dtype, self.device)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model.cfg, self.dtype)

    def step_cost(self, num_requests: int, k: int) -> float:
        return self.timer.seconds(num_requests) * k

    def _forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Final hidden state of each chunk's last token [B, H]."""
        fused = self.row_kernel and sum(len(c.token_ids) for c in chunks) <= EXACT_ROWS
        batch = build_forward_batch(chunks, self.block_size, self.backend, self.device,
                                    row_exact="kernel" if fused else None)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata, self.backend,
                            tile_rows=ROW_KERNEL if fused else 0)
        last = torch.tensor(batch.cu_query_lens[1:], device=self.device) - 1
        return hidden[last]  # [B, H]

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        generators = context.generators_for(requests)
        step = 0
        t_start = time.perf_counter()
        num_requests = len(active)
        catch_up = 0
        while active:
            chunks = []
            for i in active:
                r = requests[i]
                if step == 0:
                    state = self.states.get(r.request_id)
                    start = state.num_computed if state is not None else 0
                    chunk = [r.token_at(p) for p in range(start, r.num_tokens)]
                    chunks.append(SeqChunk(chunk, start, r.block_ids))
                    catch_up = max(catch_up, len(chunk))
                else:
                    chunks.append(SeqChunk([tokens[i][-1]], r.num_tokens + step - 1, r.block_ids))
            picked, p = self.head.sample(
                self._forward(chunks), [requests[i] for i in active], [generators[i] for i in active]
            )
            for j, i in enumerate(active):
                tokens[i].append(picked[j])
                if p is not None:
                    probs[i].append(p[j])
            step += 1
            active = [i for i in active if len(tokens[i]) < num_tokens[i]]
        # Every forward succeeded: the committed tokens' draft KV is valid now.
        for i, k in enumerate(num_tokens):
            if k > 0:
                self.states[requests[i].request_id] = DraftModelState(requests[i].num_tokens)
        # the round's time per forward (steady-state catch-up included)
        self.timer.add_round(num_requests, time.perf_counter() - t_start, step, catch_up, max(num_tokens, default=0))
        return [
            Draft(t, torch.stack(p) if p and not r.sampling_params.is_greedy else None)
            for t, p, r in zip(tokens, probs, requests, strict=True)
        ]
