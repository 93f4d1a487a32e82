"""Draft-model proposer: a small model with the target's tokenizer, co-located on the same device.

Its paged KV cache has the same block layout as the target's and is indexed by the same block
tables, so it needs no block manager of its own. Its state per request (`DraftModelState`) counts
the request's tokens whose draft KV is valid: only committed tokens. Each round first catches up over
the tokens committed since the last round (accepted drafts + bonus token) in the same forward
pass that makes the first draft, then makes k-1 more one token at a time. Draft tokens' own KV
lands in lookahead slots and is simply overwritten next round. The count advances only once every
forward of the round has succeeded (a failed round is redone from the same point).

Trees (`propose_trees`, EAGLE-2's dynamic tree, `tree_drafting.grow_trees`): the same catch-up
forward gives the root's children; each level then runs only its expanded nodes, as a partial
tree after the root and the nodes expanded before them, in scratch slots. Like a chain's drafts,
the tree's KV is scratch: the next round's catch-up recomputes the accepted path's KV (it is the
committed tokens since the last round), so nothing is moved.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from engine.errors import DrafterMismatchError
from engine.model_runner import (
    EXACT_ROWS,
    SeqChunk,
    build_forward_batch,
    last_rows,
)
from engine.models.llama import ROW_KERNEL
from engine.models.loader import load_model
from engine.request import Request
from engine.spec_decode.proposers.base import (
    Draft,
    DrafterIdentity,
    ProposeContext,
    Proposer,
    StepTimer,
    model_name,
    penalized,
    weights_digest,
)
from engine.spec_decode.proposers.draft_vocab import DraftLMHead, resolve_draft_token_ids
from engine.spec_decode.proposers.tree_drafting import (
    grow_trees,
    kernel_tree_args,
    kernel_tree_drafts,
    scratch_depths,
    tree_widths,
)
from engine.spec_decode.tree import DraftTree


@dataclass
class DraftModelState:
    num_computed: int = 0  # the request's first tokens whose draft KV is valid (committed tokens)


class DraftModelProposer(Proposer):
    method = "draft"
    supports_tree = True

    def __init__(self, model_dir: str, runner, draft_vocab_size: int | None = None, tree_width: int = 4) -> None:
        super().__init__()
        self.tree_width = tree_width  # children per expanded node, and nodes expanded per level
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
        # Small draft steps through the fused CPU row path (kernels/csrc/) where the target's runs.
        self.row_kernel = runner.row_kernel
        if self.row_kernel:
            self.model.prepare_rows()
            self.head.use_row_kernel(self.model.packed_lm_head())
        self.block_size = 0
        self.timer = StepTimer(1e-3)  # one draft forward, averaged over a round
        self.step_graph = None  # `capture_step_graph`
        self.tree_kernel = self.row_kernel  # trees through cpu_kernels.stack_tree (else the level loop)
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

    @property
    def kv_arch(self):
        return self.model.cfg

    def step_cost(self, num_requests: int, k: int) -> float:
        return self.timer.round_seconds(num_requests, k)

    def capture_step_graph(self, max_positions: int, capture: bool = True) -> bool:
        """The draft model's forwards of up to 16 tokens (each draft, a short catch-up, each tree
        level) as one CUDA graph (engine/step_graph.py), where they take the Triton backend."""
        from engine.step_graph import can_capture, make_step_graph

        if not can_capture(self.row_kernel, self.backend, self.device, capture):
            return False
        model = self.model

        def forward(g) -> torch.Tensor:
            return model(g.input_ids, g.positions, self.kv_caches, g.metadata, self.backend)

        self.step_graph = make_step_graph("the draft model's forwards", forward, self.backend, self.block_size,
                                          max_positions, self.device, capture)
        return self.step_graph is not None

    def _forward(self, chunks: list[SeqChunk], num_last: int | list[int] = 1) -> torch.Tensor:
        """Final hidden states of each chunk's last `num_last` (or num_last[b]) tokens [sum, H],
        chunk after chunk."""
        fused = self.row_kernel and sum(len(c.token_ids) for c in chunks) <= EXACT_ROWS
        if not fused and self.step_graph is not None and self.step_graph.fits(chunks):
            batch, (hidden,) = self.step_graph.run(chunks, build_forward_batch)
            return hidden[torch.tensor(last_rows(batch.cu_query_lens, num_last), device=self.device)]
        batch = build_forward_batch(chunks, self.block_size, self.backend, self.device,
                                    row_exact="kernel" if fused else None)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata, self.backend,
                            tile_rows=ROW_KERNEL if fused else 0)
        return hidden[torch.tensor(last_rows(batch.cu_query_lens, num_last), device=self.device)]

    @torch.inference_mode()
    def propose_trees(self, requests: list[Request], num_nodes: list[int], max_depths: list[int],
                      context: ProposeContext, widths: list[int] | None = None) -> list[Draft]:
        """Dynamic trees (`tree_drafting.grow_trees`): the catch-up forward gives the root's
        children; each level runs its expanded nodes only, as a partial tree after the root
        (sequence index T - 1, T = the request's tokens) and the nodes expanded before them,
        rewriting scratch KV. Example, width 2, depth 3: forwards over the catch-up chunk, then
        2 depth-1 nodes (slots T, T + 1), then 2 depth-2 nodes (T + 2, T + 3). A request drafts
        no deeper than its blocks hold scratch for."""
        t_start = time.perf_counter()
        widths = tree_widths(widths, len(requests), self.tree_width)
        depths = scratch_depths(requests, max_depths, widths, self.block_size)
        chunks, catch_up = [], 0
        for r in requests:
            state = self.states.get(r.request_id)
            start = state.num_computed if state is not None else 0
            chunks.append(SeqChunk([r.token_at(p) for p in range(start, r.num_tokens)], start, r.block_ids))
            catch_up = max(catch_up, r.num_tokens - start)
        if (self.row_kernel and self.tree_kernel and self.head.packed is not None and self.head.packed_few is None
                and sum(len(c.token_ids) for c in chunks) <= EXACT_ROWS and not penalized(requests, context)):
            drafts = self._propose_tree_kernel(requests, num_nodes, depths, widths, chunks, context)
            self.timer.add_round(len(requests), time.perf_counter() - t_start, max(depths), catch_up, max(depths),
                                 chain=False)
            return drafts

        def run_level(active: list[int], trees: list[DraftTree], counts: list[int]) -> torch.Tensor:
            return self._forward([SeqChunk(list(t.token_ids[-f:]), requests[i].num_tokens - 1 + t.num_nodes - f,
                                           requests[i].block_ids, t)
                                  for i, t, f in zip(active, trees, counts, strict=True)], counts)

        drafts, num_forwards = grow_trees(requests, num_nodes, depths, widths, self.head, self._forward(chunks),
                                          context.generators_for(requests), run_level,
                                          self.tree_temperature, context.tree_min_logprob, context.penalties)
        # Every forward succeeded: the committed tokens' draft KV is valid now.
        for r in requests:
            self.states[r.request_id] = DraftModelState(r.num_tokens)
        self.timer.add_round(len(requests), time.perf_counter() - t_start, num_forwards + 1, catch_up, max(depths), chain=False)
        return drafts

    def _propose_tree_kernel(self, requests: list[Request], num_nodes: list[int], depths: list[int],
                             widths: list[int], chunks: list[SeqChunk], context: ProposeContext) -> list[Draft]:
        """`propose_trees` on the fused CPU path: the catch-up forward and every level in one
        kernel call (`cpu_kernels.stack_tree`: the model's `rows_stack`, its packed LM head, the
        level loop's slots, positions, attention, ranking and draws), without a Python round trip
        per level; the same trees as the loop (tested), greedy and sampled."""
        from kernels import cpu_kernels

        tokens = [t for c in chunks for t in c.token_ids]
        positions = [c.start + i for c in chunks for i in range(len(c.token_ids))]
        owner = [b for b, c in enumerate(chunks) for _ in c.token_ids]
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64)
        tables, depths_t, widths_t, nodes_t, sampling, uniforms = kernel_tree_args(
            requests, depths, widths, num_nodes, context.generators_for(requests))
        out = cpu_kernels.stack_tree(
            self.model.rows_stack(self.kv_caches), as_tensor(tokens), as_tensor(positions), as_tensor(owner), tables,
            depths_t, widths_t, nodes_t, self.tree_temperature, context.tree_min_logprob, self.head.packed,
            self.head.size, self.head.token_ids, sampling, uniforms,
        )
        for r in requests:  # the call succeeded: the committed tokens' draft KV is valid now
            self.states[r.request_id] = DraftModelState(r.num_tokens)
        return kernel_tree_drafts(requests, self.head, out)

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
                self._forward(chunks), [requests[i] for i in active], [generators[i] for i in active],
                context.penalties, [tokens[i] for i in active],
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
