"""Drafters that run decoder layers of their own over (feature, token) elements: EAGLE-1 (one
layer over the target's hidden states), EAGLE-3 (one layer over a projection of three of the
target's layers) and native MTP (one module per depth, stored in the target's checkpoint).
Subclasses say how a module turns an element into its output (`_run_module`; by default
`_inputs` into a decoder layer, then `_output`) and what its LM head reads (`_head_input`); this
class runs the layers, keeps their paged KV caches and the per-request feature buffers, and drafts.

Module m (of L) works at depth m: its element at position j pairs a feature x_j^m with token
t_{j+1+m}, where x^0 is the target's hidden state and x^m (m >= 1) module m - 1's output at the
same position, and its output at j predicts t_{j+2+m} (DeepSeek-V3's MTP depths). Each module has
its own paged KV cache (the target's block tables; slot j holds its element at position j), and
keeps in it, like the target, only elements whose token is committed: with n tokens known, module
m's element j is final for j <= n - 2 - m. Worked example, L = 2, n = 10 (t_0..t_9 known, t_9 just
sampled from the target's h_8): module 0 finalizes j <= 8 (tokens up to t_9); its output at 8
drafts d_0 = t_10. Module 1 finalizes j <= 7 (tokens up to t_9); its element at 8 pairs module 0's
output at 8 with d_0, and its output there drafts d_1 = t_11.

A round of drafting (`propose`) first catches every module up over its final elements (module m
after module m - 1, which produces m's features), drafts d_0 from module 0's last output, then for
m = 1..L-1 runs module m over its non-final elements (positions n - 1 - m .. n - 2, tokens from
earlier drafts) and drafts d_m from its last output. Drafts beyond L apply the last module
recursively, as EAGLE-1 applies its one layer and vLLM its one MTP layer: its output and the
token it drafted form the element at the next position (n - 1, n, ...). Elements of drafts land
in slots that later rounds overwrite with final ones.

Between rounds a request buffers, per module, the features of the positions that module has not
run over (`HiddenRows`: the target's rows for module 0, `deeper` for the others; each buffer ends
where the previous module's starts). A request that does not draft (speculation off, or a prompt
still in chunked prefill) buffers every target row it commits: once it holds more than
`max_buffered_rows` (the lazy bound of feature_buffers.LAZY_BUFFER_ROWS; max(16, k + 1) for a request
handed over after its prefill), the modules catch up over all its rows but the last (no
drafting); a request that finishes before drafting again never runs them over its last rows.
A request with `speculative=False` never drafts, so none of its rows are kept. Sampled drafts
come with their probabilities (exactness). With prefix caching, a cached block serves a drafting
request only if the modules ran over all its positions for the request that wrote it
(feature_buffers.DrafterKVCoverage); the rest of the prefix is recomputed.
"""

from __future__ import annotations

import functools
import time

import torch

from engine.model_runner import EXACT_ROWS, SeqChunk, build_forward_batch
from engine.request import Request
from engine.spec_decode.proposers.base import (
    Draft,
    DrafterIdentity,
    ProposeContext,
    Proposer,
    StepTimer,
    may_draft,
    penalized,
)
from engine.spec_decode.proposers.draft_vocab import DraftLMHead
from engine.spec_decode.proposers.feature_buffers import (
    HiddenRows,
    append_rows,
    committed_hidden,
    import_hidden_rows,
    lazy_buffer_rows,
)
from engine.spec_decode.tree import DraftTree

BUFFER_ROWS = 16  # the steady bound of a request's buffered target rows (k + 1 if larger)


class FeatureLayerProposer(Proposer):
    """Subclasses set, before `_finish_init`: `arch` (ArchConfig of the layers; num_layers = L),
    `layers` (L `DecoderLayer`s, or layers `_run_module` runs), `heads` (L `DraftLMHead`s),
    `embed_tokens`, `feature_size` (width of the rows it buffers), `rope_offset` (RoPE position =
    slot + offset) and the RoPE tables `rope_cos`, `rope_sin` (and `rope_f32` for the fused CPU
    row path)."""

    needs_hidden_states = True
    name = ""  # in messages: "EAGLE", "EAGLE-3", "MTP"
    feature_kv = True
    fused_max_rows = EXACT_ROWS  # forwards of up to this many elements take the fused CPU row path

    def __init__(self, runner, num_speculative_tokens: int, tree_width: int = 4) -> None:
        super().__init__()
        self.tree_width = tree_width  # children per expanded node, and nodes expanded per level
        self._states: dict[str, HiddenRows] = {}  # (`states` reads them, deferred rows appended)
        # rows a request may buffer: steady_rows while it is handed over after its prefill, the
        # lazy bound (`configure_buffers`) otherwise
        self.steady_rows = self.max_buffered_rows = max(BUFFER_ROWS, num_speculative_tokens + 1)
        self.device, self.dtype = runner.device, runner.dtype
        self.backend = runner.backend
        # Small steps through the fused CPU row path (kernels/csrc/) where the target's runs.
        self.row_kernel = runner.row_kernel
        self.block_size = 0
        self.timer = StepTimer(5e-4)  # one autoregressive step of a layer
        self._identity = DrafterIdentity()
        self.step_graphs: list = []  # per module (`capture_step_graph`; None: eager)
        self.tree_kernel = self.row_kernel  # one-module trees through cpu_kernels.feature_tree (else the level loop)
        self._module_stack = None  # (cache key, the one-layer cpu_kernels.RowsStack of feature_tree)

    # --- what a subclass defines --------------------------------------------------------------
    def _inputs(self, m: int, embeds: torch.Tensor, feats: torch.Tensor, fused: bool) -> torch.Tensor:
        """Module m's layer input [T, H] for token embeddings and features [T, *]; float32 when
        `fused` (the CPU row kernel runs the layer). Read by the default `_run_module` only."""
        raise NotImplementedError

    def _run_module(self, m: int, embeds: torch.Tensor, feats: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    attn_metadata, fused: bool) -> torch.Tensor:
        """Module m's output features [T, H] for token embeddings and features [T, *], writing the
        elements' KV; cos/sin [T, 1, head_dim], or float32 [T, head_dim] when `fused` (the CPU row
        kernel runs the layer). Here: `_inputs` into a `DecoderLayer`, its residual stream through
        `_output`."""
        x = self._inputs(m, embeds, feats, fused)
        k_cache, v_cache = self.kv_caches[m]
        layer = self.layers[m]
        if fused:  # float32 activations through the layer, one call
            out, residual = layer.forward_rows(x, None, cos, sin, k_cache, v_cache, attn_metadata)
            return self._output(m, (residual + out).to(self.dtype))
        out, residual = layer(x, None, cos, sin, k_cache, v_cache, attn_metadata, self.backend)
        return self._output(m, residual + out)

    def _output(self, m: int, out: torch.Tensor) -> torch.Tensor:
        """Module m's output feature from its layer's output (the residual stream) [T, H]."""
        return out

    def _head_input(self, m: int, feats: torch.Tensor) -> torch.Tensor:
        """What module m's LM head reads, from its output features [B, H]."""
        return feats

    def _committed_rows(self, runner_out) -> torch.Tensor:
        """The step's target rows this drafter reads (default: the final-norm hidden states)."""
        return runner_out.hidden_states

    def _tree_kernel_parts(self) -> dict | None:
        """Module 0's input and output as `cpu_kernels.feature_tree` takes them (its `parts`), or
        None where the tree kernel cannot run it."""
        return None

    def _flush_deferred(self, only: set[str] | None = None) -> None:
        """Append to their buffers the committed rows the drafter holds back, of the requests in
        `only` (None: all), before those buffers are read (`states`, `export_state`, a step's
        new rows, a round of drafting). Here none are held back; EAGLE-3 defers decode steps'."""

    def _states_to_draft(self, requests: list[Request], k_max: int, t_start: float
                         ) -> tuple[list[HiddenRows], float]:
        """The requests' buffered rows for a round of up to k_max drafts (`_check_states`) and
        the time the round's cost counts from (`t_start`; EAGLE-3 moves it past a long catch-up
        it runs on its own)."""
        return self._check_states(requests), t_start

    def _add_round(self, requests: list[Request], seconds: float, forwards: int, catch_up: int, rows: int,
                   k_max: int) -> None:
        """Record a round of chains (`StepTimer.add_round`) of `forwards` forwards, whose first
        caught up over `rows` buffered rows, at most `catch_up` of one request."""
        self.timer.add_round(len(requests), seconds, forwards, catch_up, k_max)

    # --- set-up ---------------------------------------------------------------------------------
    def _finish_init(self, identity: DrafterIdentity) -> None:
        """Put the layers on the device in eval mode, with the packed weights of the fused CPU
        row path where the target uses it."""
        from kernels import cpu_kernels

        self.layers = [
            layer.to(self.device, self.dtype).eval().requires_grad_(False) for layer in self.layers
        ]
        if self.row_kernel:
            for layer in self.layers:
                layer.row_weights()
                if self.dtype == torch.bfloat16 and cpu_kernels.emulated_bf16():
                    layer.use_packed_matmuls()  # catch-up forwards too (torch emulates bf16 here)
        self._identity = identity

    @property
    def head(self) -> DraftLMHead:
        """Module 0's LM head."""
        return self.heads[0]

    def identity(self) -> DrafterIdentity:
        return self._identity

    @property
    def states(self) -> dict[str, HiddenRows]:
        """Each request's buffered rows, every deferred row appended first (`_flush_deferred`)."""
        self._flush_deferred()
        return self._states

    @states.setter
    def states(self, value: dict[str, HiddenRows]) -> None:
        self._states = value

    def _state(self, request_id: str) -> HiddenRows | None:
        return self._states.get(request_id)

    def free_request(self, request_id: str) -> None:
        """Forget a request (reading no other request's buffer)."""
        self._states.pop(request_id, None)
        if self.kv_coverage is not None:
            self.kv_coverage.forget(request_id)

    @property
    def kv_arch(self):
        return self.arch

    def buffer_bytes(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """Buffered target rows between steps and as many per deeper module (they hold one row
        between rounds, more while a catch-up runs), plus one step's committed rows before they
        are bounded."""
        size = torch.empty((), dtype=self.dtype).element_size()
        rows = (max_num_seqs * self.max_buffered_rows + max_num_batched_tokens) * self.feature_size
        deeper = max_num_seqs * (len(self.layers) - 1) * self.max_buffered_rows * self.arch.hidden_size
        return (rows + deeper) * size

    def configure_buffers(self, max_num_seqs: int, max_model_len: int) -> None:
        size = torch.empty((), dtype=self.dtype).element_size()
        self.max_buffered_rows = lazy_buffer_rows(self.steady_rows, max_num_seqs, self.feature_size * size, max_model_len)

    def step_cost(self, num_requests: int, k: int) -> float:
        return self.timer.round_seconds(num_requests, k)

    # --- handoff --------------------------------------------------------------------------------
    def export_state(self, request_id: str) -> HiddenRows | None:
        """The buffered rows (on the CPU) of the positions the modules have not run over yet; the
        modules' KV of the others travels as the handoff's `drafter_kv`."""
        self._flush_deferred({request_id})
        state = self._states.get(request_id)
        return None if state is None else state.to("cpu")

    def import_state(self, request_id: str, state, num_computed_tokens: int) -> None:
        """Without a state (nothing handed over) the request's first committed rows on this engine
        start a new buffer: the modules never see the earlier positions' rows, so drafts are worse
        (outputs stay exact)."""
        if state is None:
            return
        own = import_hidden_rows(
            self.name, state, self.feature_size, num_computed_tokens, self.device, self.dtype
        )
        end = own.start
        for m, d in enumerate(own.deeper, start=1):
            if d.rows.dim() != 2 or d.rows.shape[1] != self.arch.hidden_size or d.end != end or d.start < 0:
                raise ValueError(
                    f"{self.name} state: module {m}'s rows must be {self.arch.hidden_size} wide and end at "
                    f"position {end}, got {(d.start, tuple(d.rows.shape))}"
                )
            end = d.start
        if own.deeper and len(own.deeper) != len(self.layers) - 1:
            raise ValueError(
                f"{self.name} state has rows for {len(own.deeper) + 1} modules, this drafter has {len(self.layers)}"
            )
        self._states[request_id] = own

    # --- per step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def observe_step(self, sched, runner_out) -> None:
        """Buffer each drafting-capable request's newly committed target rows, then bound the
        buffers: the modules catch up over the rows of every request holding more than its bound
        (`max_buffered_rows`, or `steady_rows` when it is handed over after its prefill), all but
        the last."""
        committed = [c for c in committed_hidden(sched, runner_out, self._committed_rows(runner_out)) if may_draft(c[0])]
        self._flush_deferred({r.request_id for r, _, _ in committed})  # (their earlier rows first)
        self._buffer(committed)

    def _buffer(self, committed: list[tuple[Request, int, torch.Tensor]]) -> None:
        """Append each (request, position of its first row, rows) to the request's buffer, then
        bound the buffers as `observe_step` says."""
        updated = append_rows(self._states, committed, self.name, self.max_buffered_rows + 1)
        full = [(r, st) for r, st in updated
                if st.rows.shape[0] > (self.steady_rows if r.export_after_prefill else self.max_buffered_rows)]
        if full:
            self._catch_up_all_but_last([r for r, _ in full], [st for _, st in full])
        self._cover(r for r, _, _ in committed)

    def _catch_up_all_but_last(self, requests: list[Request], states: list[HiddenRows]) -> None:
        """Run the modules over all of each request's buffered rows but the last, and keep that."""
        new, _, _ = self._catch_up(requests, states, [st.end for st in states])
        for r, st in zip(requests, new, strict=True):
            self._states[r.request_id] = st

    def _kv_done(self, state: HiddenRows) -> int:
        return min([state.start] + [d.start for d in state.deeper])

    def check_no_leaks(self, live_ids: set[str]) -> None:
        super().check_no_leaks(live_ids)
        over = {
            rid: [st.rows.shape[0]] + [d.rows.shape[0] for d in st.deeper]
            for rid, st in self.states.items()
            if max([st.rows.shape[0]] + [d.rows.shape[0] for d in st.deeper]) > self.max_buffered_rows
        }
        if over:
            raise AssertionError(f"{self.name} buffers more than {self.max_buffered_rows} rows: {over}")

    # --- the layers -----------------------------------------------------------------------------
    def capture_step_graph(self, max_positions: int, capture: bool = True) -> bool:
        """Each module's forwards of up to 16 elements as one CUDA graph (engine/step_graph.py)
        where they take the Triton backend; module m's features are feature_size wide for m = 0
        and hidden_size after (a forward of other widths runs eagerly)."""
        from engine.step_graph import can_capture, make_step_graph

        if not can_capture(self.row_kernel, self.backend, self.device, capture):
            return False

        def forward_of(m: int):
            def forward(g) -> torch.Tensor:
                rope_pos = g.positions + self.rope_offset
                cos, sin = self.rope_cos[rope_pos].unsqueeze(1), self.rope_sin[rope_pos].unsqueeze(1)
                return self._run_module(m, self.embed_tokens(g.input_ids), g.floats["features"], cos, sin,
                                        g.metadata, False)
            return forward

        self.step_graphs = [
            make_step_graph(f"{self.name} module {m}'s forwards", forward_of(m), self.backend, self.block_size,
                            max_positions, self.device, capture,
                            {"features": (self.feature_size if m == 0 else self.arch.hidden_size, self.dtype)})
            for m in range(len(self.layers))
        ]
        return any(g is not None for g in self.step_graphs)

    def _forward(
        self, m: int, chunks: list[SeqChunk], token_ids: list[int], features: torch.Tensor
    ) -> torch.Tensor:
        """Run module m on elements (features[i], token_ids[i]) at the cache positions of
        `chunks`; returns every element's output feature [T, H]."""
        fused = self.row_kernel and len(token_ids) <= self.fused_max_rows
        graph = self.step_graphs[m] if m < len(self.step_graphs) else None
        if (not fused and graph is not None and graph.fits(chunks)
                and features.shape[1] == graph.floats["features"].shape[1]):
            _, (out,) = graph.run(chunks, build_forward_batch, token_ids, {"features": features.to(self.dtype)})
            return out
        batch = build_forward_batch(
            chunks, self.block_size, self.backend, self.device, row_exact="kernel" if fused else None
        )
        embeds = self.embed_tokens(torch.tensor(token_ids, device=self.device))
        rope_pos = batch.positions + self.rope_offset
        if fused:
            cos, sin = self.rope_f32[0][rope_pos], self.rope_f32[1][rope_pos]
        else:
            cos, sin = self.rope_cos[rope_pos].unsqueeze(1), self.rope_sin[rope_pos].unsqueeze(1)
        return self._run_module(m, embeds, features, cos, sin, batch.attn_metadata, fused)

    def _catch_up(self, requests: list[Request], states: list[HiddenRows], num_known: list[int]):
        """Run every module over its final elements, given the first num_known[i] tokens of
        requests[i] (module m: the buffered positions j < num_known - 1 - m), module 0 first.
        Returns the requests' new states (changing none in place), each request's module-0
        output at its last position run ([B, H]; a request with none gets a zero row), and the
        number of forwards run."""
        num_modules = len(self.layers)
        bufs = [
            [
                st,
                *(
                    st.deeper
                    or [
                        HiddenRows(st.start, st.rows.new_empty(0, self.arch.hidden_size))
                        for _ in range(num_modules - 1)
                    ]
                ),
            ]
            for st in states
        ]
        last0 = torch.zeros(len(requests), self.arch.hidden_size, dtype=self.dtype, device=self.device)
        num_forwards = 0
        for m in range(num_modules):
            todo = [
                (i, min(b[m].end, n - 1 - m) - b[m].start)
                for i, (b, n) in enumerate(zip(bufs, num_known, strict=True))
            ]
            todo = [(i, c) for i, c in todo if c > 0]
            if not todo:
                continue
            chunks = [SeqChunk([0] * c, bufs[i][m].start, requests[i].block_ids) for i, c in todo]
            token_ids = [
                requests[i].token_at(j + 1 + m)
                for i, c in todo
                for j in range(bufs[i][m].start, bufs[i][m].start + c)
            ]
            out = self._forward(m, chunks, token_ids, torch.cat([bufs[i][m].rows[:c] for i, c in todo]))
            num_forwards += 1
            for (i, c), o in zip(todo, out.split([c for _, c in todo]), strict=True):
                b = bufs[i][m]
                bufs[i][m] = HiddenRows(b.start + c, b.rows[c:])
                if m + 1 < num_modules:  # module m's outputs are module m + 1's features
                    nxt = bufs[i][m + 1]
                    bufs[i][m + 1] = HiddenRows(nxt.start, torch.cat([nxt.rows, o]))
                if m == 0:
                    last0[i] = o[-1]
        new = [
            HiddenRows(
                b[0].start, b[0].rows.clone(), tuple(HiddenRows(d.start, d.rows.clone()) for d in b[1:])
            )
            for b in bufs
        ]
        return new, last0, num_forwards

    def _sample(self, m: int, feats: torch.Tensor, requests: list[Request], generators, penalties=None,
                drafted: list[list[int]] | None = None):
        return self.heads[m].sample(self._head_input(m, feats), requests, generators, penalties, drafted)

    @property
    def supports_tree(self) -> bool:
        """Every chain drafter grows trees (`propose_trees`): one module applied recursively
        (EAGLE-1, EAGLE-3, a one-layer MTP checkpoint) or one module per depth (MTP with several layers)."""
        return True

    def _check_states(self, requests: list[Request]) -> list[HiddenRows]:
        states = []
        for r in requests:
            n = r.num_tokens
            state = self._states.get(r.request_id)
            if state is None or state.end != n - 1 or state.start == state.end:
                raise RuntimeError(
                    f"{self.name}: request {r.request_id!r} cannot draft: it needs the hidden rows up to position "
                    f"{n - 2}, it buffers {None if state is None else (state.start, state.end)}"
                )
            states.append(state)
        return states

    @torch.inference_mode()
    def propose_trees(self, requests: list[Request], num_nodes: list[int], max_depths: list[int],
                      context: ProposeContext, widths: list[int] | None = None) -> list[Draft]:
        """Dynamic trees (`tree_drafting.grow_trees`). Each tree path is drafted exactly as a chain
        of those tokens would be: the children of a depth-d node come from module min(d, L - 1).

        Module m keeps its own copy of the tree's top levels: its element for a node u at depth
        i (1 <= i) sits at slot n - 2 - m + (u's index in the expanded tree), RoPE position
        n - 2 - m + i, and pairs module m - 1's output for u's parent with u's token (i <= m), or
        module m's own output for u's parent (i > m: the last module applied recursively); its
        root is its final element at n - 2 - m (n = the request's tokens). Worked example, L = 1
        (EAGLE-1, one MTP layer): the catch-up's last output (n - 2) gives the root's children;
        each level runs only its new nodes, as a partial tree whose root is the committed element
        at n - 2. With L = 2: module 0's catch-up output gives the depth-1 candidates; at depth 1,
        module 1 runs over the expanded depth-1 nodes (slots n - 3 + index, features: module 0's
        output at n - 2, its buffered row) and gives depth 2; from depth 2 on module 1 runs only
        each level's new nodes (features: its own outputs for their parents). A module's first
        level (depth m < L) runs every node expanded so far (it has no tree copy yet); later
        levels run new nodes only. Like a chain's, the elements of drafts are scratch: the next
        round's catch-up runs over the accepted path's target rows (the runner moves them into
        place)."""
        from engine.spec_decode.proposers.tree_drafting import scratch_depths, tree_widths

        self._flush_deferred({r.request_id for r in requests})  # (their rows first; not timed as drafting)
        t_start = time.perf_counter()
        widths = tree_widths(widths, len(requests), self.tree_width)
        depths = scratch_depths(requests, max_depths, widths, self.block_size, root_offset=2)
        states, t_start = self._states_to_draft(requests, max(depths), t_start)
        return self._grow_trees(requests, states, num_nodes, depths, widths, t_start, context)

    def _grow_trees(self, requests: list[Request], states: list[HiddenRows], num_nodes: list[int],
                    depths: list[int], widths: list[int], t_start: float, context: ProposeContext) -> list[Draft]:
        """`propose_trees` from the requests' buffered rows `states` (`_states_to_draft`): the
        catch-up, then the levels (`grow_trees`'s loop, or one `feature_tree` call)."""
        from engine.spec_decode.proposers.tree_drafting import grow_trees

        num_modules = len(self.layers)
        catch_up = max(r.num_tokens - 1 - st.start for r, st in zip(requests, states, strict=True))
        new, last, num_forwards = self._catch_up(requests, states, [r.num_tokens for r in requests])
        # outputs[m][i]: module m's output for each node of request i's expanded tree, in index
        # order (row 0, the root: module m's final output at n - 2 - m, where a deeper module reads it)
        outputs: list[list[torch.Tensor]] = [list(last.unsqueeze(1))]
        for m in range(1, num_modules):
            outputs.append([st.deeper[m].rows[-1:] if m + 1 < num_modules else last.new_zeros(1, last.shape[1])
                            for st in new])
        for st, r in zip(new, requests, strict=True):  # module m's buffer ends at its depth-1 element (n - 1 - m)
            bad = [(m, d.start, d.end) for m, d in enumerate(st.deeper, start=1) if d.end != r.num_tokens - m or not d.rows.numel()]
            if bad:
                raise RuntimeError(f"{self.name}: request {r.request_id!r} (n = {r.num_tokens}) has module buffers "
                                   f"(module, start, end) {bad}; each must end at n - module")

        parts = (self._tree_kernel_parts() if self.row_kernel and self.tree_kernel and num_modules == 1
                 and not penalized(requests, context) else None)
        if parts is not None and self.head.packed is not None and self.head.packed_few is None:
            drafts = self._propose_tree_kernel(requests, num_nodes, depths, widths, last, parts, context)
            for r, st in zip(requests, new, strict=True):  # the call succeeded: the module's KV holds the final elements
                self._states[r.request_id] = st
            self._cover(requests)
            self.timer.add_round(len(requests), time.perf_counter() - t_start, num_forwards + max(depths) - 1,
                                 catch_up, max(depths), chain=False)
            return drafts

        def run_level(active: list[int], trees: list[DraftTree], counts: list[int]) -> torch.Tensor:
            depth = trees[0].depths[-1]  # the new nodes' depth (one level at a time)
            m = min(depth, num_modules - 1)
            first = 1 <= depth == m  # module m's first level: every expanded node, not the new ones only
            chunks, tokens, feats = [], [], []
            for i, t, f in zip(active, trees, counts, strict=True):
                r = requests[i]
                run = t.num_nodes - 1 if first else f
                chunks.append(SeqChunk([0] * run, r.num_tokens - 2 - m + t.num_nodes - run, r.block_ids, t))
                tokens.extend(t.token_ids[-run:])
                # parents' features: module m - 1's outputs (first level), else module m's own
                parents = outputs[m - 1][i] if first else outputs[m][i]
                feats.append(parents[list(t.parents[-run:])])
            out = self._forward(m, chunks, tokens, torch.cat(feats))
            rows = [t.num_nodes - 1 if first else f for t, f in zip(trees, counts, strict=True)]
            picked = []
            for i, o, f in zip(active, out.split(rows), counts, strict=True):
                outputs[m][i] = torch.cat([outputs[m][i][:1] if first else outputs[m][i], o])
                picked.append(o[-f:])
            return self._head_input(m, torch.cat(picked))

        drafts, level_forwards = grow_trees(requests, num_nodes, depths, widths, list(self.heads),
                                            self._head_input(0, last), context.generators_for(requests), run_level,
                                            self.tree_temperature, context.tree_min_logprob, context.penalties)
        # Every forward succeeded: the module's KV holds the final elements now.
        for r, st in zip(requests, new, strict=True):
            self._states[r.request_id] = st
        self._cover(requests)
        self.timer.add_round(len(requests), time.perf_counter() - t_start, num_forwards + level_forwards,
                             catch_up, max(depths), chain=False)
        return drafts

    def _propose_tree_kernel(self, requests: list[Request], num_nodes: list[int], depths: list[int],
                             widths: list[int], last: torch.Tensor, parts: dict,
                             context: ProposeContext) -> list[Draft]:
        """`propose_trees` of a one-module drafter on the fused CPU path: after the catch-up (in
        Python, as the loop's), every level in one kernel call (`cpu_kernels.feature_tree`: the
        module's layer as a one-layer `RowsStack`, its packed projection and the head's packed
        LM head; the loop's slots, positions, attention, ranking and draws) instead of a Python
        round trip per level; the same trees as the loop (tested), greedy and sampled."""
        from engine.spec_decode.proposers.tree_drafting import kernel_tree_args, kernel_tree_drafts
        from kernels import cpu_kernels

        tables, depths_t, widths_t, nodes_t, sampling, uniforms = kernel_tree_args(
            requests, depths, widths, num_nodes, context.generators_for(requests))
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64)
        out = cpu_kernels.feature_tree(
            self._one_layer_stack(), last.float().contiguous(), as_tensor([r.last_token_id for r in requests]),
            as_tensor([r.num_tokens - 2 for r in requests]), tables, depths_t, widths_t, nodes_t, self.tree_temperature,
            context.tree_min_logprob, self.embed_tokens.weight.detach(), parts, self.head.packed, self.head.size,
            self.head.token_ids, self.rope_f32, self.rope_offset, self.dtype == torch.bfloat16, sampling, uniforms,
        )
        return kernel_tree_drafts(requests, self.head, out)

    def _one_layer_stack(self):
        """Module 0's layer and KV cache as a C++ `RowsStack` (remade when the cache changes)."""
        from kernels import cpu_kernels

        k_cache, v_cache = self.kv_caches[0]
        weights = self.layers[0].row_weights()
        key = (k_cache.data_ptr(), v_cache.data_ptr(), tuple(k_cache.shape), weights["w_qkv"].data_ptr())
        if self._module_stack is None or self._module_stack[0] != key:
            a = self.arch
            stack = cpu_kernels.rows_stack([weights], [(k_cache, v_cache)], a.num_heads,
                                           a.num_kv_heads, a.intermediate_size, a.rms_norm_eps, a.head_dim**-0.5, [])
            self._module_stack = (key, stack)
        return self._module_stack[1]

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]:
        self._flush_deferred({r.request_id for r in requests})  # (their rows first; not timed as drafting)
        t_start = time.perf_counter()
        states, t_start = self._states_to_draft(requests, max(num_tokens), t_start)
        return self._draft_chains(requests, states, num_tokens, t_start, context)

    def _draft_chains(self, requests: list[Request], states: list[HiddenRows], num_tokens: list[int],
                      t_start: float, context: ProposeContext) -> list[Draft]:
        """`propose` from the requests' buffered rows `states` (`_states_to_draft`): the catch-up,
        then a forward per draft."""
        num_modules = len(self.layers)
        pending = [r.num_tokens - 1 - st.start for r, st in zip(requests, states, strict=True)]
        new, feats, num_forwards = self._catch_up(requests, states, [r.num_tokens for r in requests])
        generators = context.generators_for(requests)
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # outputs of the last step run, per request: positions [n - 1 - len, n - 1)
        prev: list[torch.Tensor] = list(feats.unsqueeze(1))
        active = list(range(len(requests)))
        step = 0
        while True:
            m = min(step, num_modules - 1)
            picked, p = self._sample(
                m,
                torch.stack([prev[i][-1] for i in active]),
                [requests[i] for i in active],
                [generators[i] for i in active],
                context.penalties,
                [tokens[i] for i in active],
            )
            for j, i in enumerate(active):
                tokens[i].append(picked[j])
                if p is not None:
                    probs[i].append(p[j])
            active = [i for i in active if len(tokens[i]) < num_tokens[i]]
            if not active:
                break
            step += 1
            m = min(step, num_modules - 1)
            chunks, elem_tokens, elem_feats = [], [], []
            for i in active:
                r, n = requests[i], requests[i].num_tokens
                if step < num_modules:  # module `step` at its depth: positions [buffer start, n - 1)
                    buf = new[i].deeper[step - 1]
                    fresh = (
                        prev[i][prev[i].shape[0] - (n - 1 - buf.end) :] if n - 1 > buf.end else prev[i][:0]
                    )
                    chunks.append(SeqChunk([0] * (n - 1 - buf.start), buf.start, r.block_ids))
                    elem_feats += [buf.rows, fresh]
                    elem_tokens += [
                        r.token_at(t) if t < n else tokens[i][t - n]
                        for t in range(buf.start + 1 + step, n + step)
                    ]
                else:  # the last module again, one position further (its output, its draft)
                    chunks.append(SeqChunk([0], n - 1 + step - num_modules, r.block_ids))
                    elem_feats.append(prev[i][-1:])
                    elem_tokens.append(tokens[i][-1])
            out = self._forward(m, chunks, elem_tokens, torch.cat(elem_feats))
            num_forwards += 1
            for i, o in zip(active, out.split([len(c.token_ids) for c in chunks]), strict=True):
                prev[i] = o
        # Every forward succeeded: the modules' KV holds the final elements now.
        for r, st in zip(requests, new, strict=True):
            self._states[r.request_id] = st
        self._cover(requests)
        self._add_round(requests, time.perf_counter() - t_start, num_forwards, max(pending), sum(pending),
                        max(num_tokens))
        return [
            Draft(t, torch.stack(pr) if pr and not r.sampling_params.is_greedy else None)
            for t, pr, r in zip(tokens, probs, requests, strict=True)
        ]
