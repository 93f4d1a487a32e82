"""Bookkeeping shared by the proposers that read the target's hidden states (EAGLE, EAGLE-3,
native MTP, Medusa).

After every step, the hidden states of each scheduled request's newly committed positions
(prefill chunk rows, or the last token + accepted drafts of a verification) are sliced out of the
step's batch output. Each proposer keeps what it needs of them, bounded per request: Medusa the
last row, the layer drafters the rows their layers have not yet run over (see feature_layer.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.request import Request


@dataclass
class HiddenRows:
    """A request's buffered target hidden states: `rows[i]` is the state at position `start + i`."""

    start: int
    rows: torch.Tensor  # [num_rows, hidden]
    # A drafter with several chained modules (native MTP, feature_layer.py): module m's buffered input
    # features (module m - 1's outputs), m = 1.., each ending where the previous one starts.
    deeper: tuple[HiddenRows, ...] = ()
    # the tensor whose first rows `rows` are, with room for more (`append_rows`); None: none
    spare: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def end(self) -> int:
        """One past the last buffered position."""
        return self.start + self.rows.shape[0]

    def to(self, device, dtype=None) -> HiddenRows:
        """A copy with the rows on `device` (for a handoff: the CPU, then the importer's device)."""
        deeper = tuple(d.to(device, dtype) for d in self.deeper)
        return HiddenRows(self.start, self.rows.to(device=device, dtype=dtype, copy=True), deeper)


def import_hidden_rows(method: str, state, hidden_size: int, num_computed_tokens: int, device, dtype) -> HiddenRows:
    """Check a handed-over `HiddenRows` (its rows end at the request's computed tokens, as they do
    after every step) and put it on this proposer's device."""
    if (
        not isinstance(state, HiddenRows) or state.rows.dim() != 2 or state.rows.shape[1] != hidden_size
        or state.end != num_computed_tokens or state.start < 0
    ):
        got = state if not isinstance(state, HiddenRows) else (state.start, tuple(state.rows.shape))
        raise ValueError(
            f"{method} state must be HiddenRows of width {hidden_size} ending at position "
            f"{num_computed_tokens}, got {got!r}"
        )
    return state.to(device, dtype)


def committed_hidden(sched, runner_out, hidden: torch.Tensor | None = None) -> Iterator[tuple[Request, int, torch.Tensor]]:
    """(request, position of its first row, rows [m, H]) of each scheduled, unfinished request's
    newly committed positions, from `hidden` [num_tokens, H] (default: the step's final-norm
    `hidden_states`; a drafter that reads other rows passes them, as EAGLE-3 its fc's output).
    The rows are views of the step's output: clone what you keep.

    Example: a verification of 3 drafts with 2 accepted commits rows [c, c+1, c+2] (the last
    token and 2 drafts) of the request's 4 query rows; a partial prefill chunk commits all rows.
    """
    hidden = runner_out.hidden_states if hidden is None else hidden
    for r, start, lo, n in committed_ranges(sched, runner_out):
        yield r, start, hidden[lo : lo + n]


def committed_ranges(sched, runner_out) -> Iterator[tuple[Request, int, int, int]]:
    """`committed_hidden` as (request, position of its first row, first row in the step's
    tensors, rows)."""
    cu = runner_out.cu_query_lens
    for i, (s, tokens) in enumerate(zip(sched.scheduled, runner_out.sampled_token_ids, strict=True)):
        r: Request = s.request
        if r.is_finished:
            continue
        committed = s.num_new_tokens + (len(tokens) - 1 if tokens else 0)
        yield r, r.num_computed_tokens - committed, int(cu[i]), committed


def append_rows(states: dict[str, HiddenRows], committed: list[tuple[Request, int, torch.Tensor]],
                what: str, reserve: int = 0) -> list[tuple[Request, HiddenRows]]:
    """Append (copy) each request's newly committed rows (views of a step's tensor are fine) to
    its buffer in `states`, starting a buffer for a request that has none; returns the updated
    (request, state) pairs. Raises RuntimeError if rows do not continue the buffer.

    A buffer's rows are the front of a larger tensor (`HiddenRows.spare`, up to `reserve` rows,
    or twice what it holds): a step appends by copying its own rows, not the whole buffer (which
    grows to hundreds of rows while speculation is off, LAZY_BUFFER_ROWS)."""
    updated: list[tuple[Request, HiddenRows]] = []
    for r, start, rows in committed:
        state = states.get(r.request_id)
        if state is not None and state.end != start:
            raise RuntimeError(
                f"{what}: request {r.request_id!r} buffers rows up to position {state.end}, "
                f"but its next committed row is at {start}"
            )
        n, m = (0 if state is None else state.rows.shape[0]), rows.shape[0]
        spare = None if state is None else state.spare
        if spare is None or n + m > spare.shape[0] or state.rows.data_ptr() != spare.data_ptr():
            spare = rows.new_empty(max(n + m, min(max(2 * (n + m), 32), reserve)), rows.shape[1])
            if n:
                spare[:n].copy_(state.rows)
        spare[n : n + m].copy_(rows)
        if state is None:  # its first rows (or its first after a preemption)
            updated.append((r, HiddenRows(start, spare[: n + m], (), spare)))
        else:
            updated.append((r, HiddenRows(state.start, spare[: n + m], state.deeper, spare)))
    for r, state in updated:
        states[r.request_id] = state
    return updated


# A request that is not drafting (the adaptive policy has speculation off, or its prompt is still
# in chunked prefill) buffers the rows its drafter has not run over. The drafter catches up over
# them only when the request drafts again, or when they reach the bound: up to LAZY_BUFFER_ROWS a
# request, while all requests' rows together stay within LAZY_BUFFER_BYTES. A request that
# finishes while speculation is off never runs the drafter over them at all, and one that keeps
# speculation off pays no drafter forward per step to stay caught up. A request that is prefilled to be handed over keeps the steady
# bound: its prefill replica does the catch-up, not the decode replica.
LAZY_BUFFER_ROWS = 256
LAZY_BUFFER_BYTES = 32 << 20


def lazy_buffer_rows(steady: int, max_num_seqs: int, row_bytes: int, max_model_len: int) -> int:
    """The bound of a request's buffered rows (see LAZY_BUFFER_ROWS), at least `steady`."""
    lazy = min(LAZY_BUFFER_ROWS, max_model_len, LAZY_BUFFER_BYTES // max(1, max_num_seqs * row_bytes))
    return max(steady, lazy)


class DrafterKVCoverage:
    """Which blocks of the shared pool hold a feature drafter's own KV for their tokens.

    A prefix-cache hit skips the target's forward over the cached blocks, so a feature drafter
    (EAGLE, EAGLE-3, MTP), which runs only over the target's rows, never fills its KV there: it
    must find it already written. It is not when the request that wrote the blocks did not run the
    drafter over them: it did not speculate (speculative=False), or it finished while its rows
    waited (LAZY_BUFFER_ROWS). A later request drafting over such blocks would attend to stale KV and
    have far fewer drafts accepted (outputs stay exact). So
    a block counts as covered once its writer's drafter holds the final elements of all its
    positions, and a fresh block (any other content gone) as not; a request that may draft reuses
    only the leading covered blocks of its cached prefix (`prefix`) and recomputes the rest;
    once its own blocks are covered, the prefix cache points at them instead
    (`KVBlockManager.replace_cached`)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.valid = bytearray(num_blocks)
        self.block_size = block_size
        self.marked: dict[str, int] = {}  # request id -> its leading blocks already marked
        self.block_manager = None  # the engine's KVBlockManager (set by the engine)

    def on_allocate(self, block: int) -> None:
        self.valid[block] = 0

    def mark(self, request: Request, done: int) -> None:
        """The drafter holds request's final elements for positions < done."""
        first, upto = self.marked.get(request.request_id, 0), min(done // self.block_size, len(request.block_ids))
        bm, bs = self.block_manager, self.block_size
        for i in range(first, upto):
            block = request.block_ids[i]
            self.valid[block] = 1
            if bm is not None and i < len(request.block_hashes):  # a full block, in the prefix cache or not
                cached = bm.cached_blocks.get(request.block_hashes[i])
                if cached != block and (cached is None or not self.valid[cached]):
                    bm.replace_cached(request.block_hashes[i], block, tuple(request.all_token_ids[i * bs : (i + 1) * bs]))
        if upto > first:
            self.marked[request.request_id] = upto

    def forget(self, request_id: str) -> None:
        self.marked.pop(request_id, None)

    def prefix(self, block_ids: list[int]) -> list[int]:
        """The leading blocks of a cached prefix that hold the drafter's KV."""
        n = 0
        while n < len(block_ids) and self.valid[block_ids[n]]:
            n += 1
        return block_ids[:n]
