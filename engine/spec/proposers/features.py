"""Bookkeeping shared by the proposers that read the target's hidden states (EAGLE, EAGLE-3,
native MTP, Medusa).

After every step, the hidden states of each scheduled request's newly committed positions
(prefill chunk rows, or the last token + accepted drafts of a verification) are sliced out of the
step's batch output. Each proposer keeps what it needs of them, bounded per request: Medusa the
last row, the layer drafters the rows their layers have not yet run over (see chain.py).
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
    # A drafter with several chained modules (native MTP, chain.py): module m's buffered input
    # features (module m - 1's outputs), m = 1.., each ending where the previous one starts.
    deeper: tuple[HiddenRows, ...] = ()

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
    `hidden_states`; EAGLE-3 passes `aux_hidden_states`). The rows are views of the step's
    output: clone what you keep.

    Example: a verification of 3 drafts with 2 accepted commits rows [c, c+1, c+2] (the last
    token and 2 drafts) of the request's 4 query rows; a partial prefill chunk commits all rows.
    """
    hidden = runner_out.hidden_states if hidden is None else hidden
    cu = runner_out.cu_query_lens
    for i, (s, tokens) in enumerate(zip(sched.scheduled, runner_out.sampled_token_ids, strict=True)):
        r: Request = s.request
        if r.is_finished:
            continue
        committed = s.num_new_tokens + (len(tokens) - 1 if tokens else 0)
        yield r, r.num_computed_tokens - committed, hidden[cu[i] : cu[i] + committed]


def append_rows(states: dict[str, HiddenRows], committed: list[tuple[Request, int, torch.Tensor]],
                what: str) -> list[tuple[Request, HiddenRows]]:
    """Append each request's newly committed rows (rows the caller owns, not views of a step's
    tensor) to its buffer in `states`, starting a buffer for a request that has none; returns
    the updated (request, state) pairs. Raises RuntimeError if rows do not continue the buffer."""
    updated: list[tuple[Request, HiddenRows]] = []
    for r, start, rows in committed:
        state = states.get(r.request_id)
        if state is None:  # its first rows (or its first after a preemption)
            updated.append((r, HiddenRows(start, rows)))
        elif state.end != start:
            raise RuntimeError(
                f"{what}: request {r.request_id!r} buffers rows up to position {state.end}, "
                f"but its next committed row is at {start}"
            )
        else:
            updated.append((r, dataclasses.replace(state, rows=torch.cat([state.rows, rows]))))
    for r, state in updated:
        states[r.request_id] = state
    return updated


def buffer_rows(states: dict[str, HiddenRows], committed: list[tuple[Request, int, torch.Tensor]],
                max_rows: int, forward, what: str) -> None:
    """`append_rows`, then bound the buffers: for every request holding more than `max_rows`,
    run `forward(chunks, token_ids, features)` over the elements (row j, token j + 1) of all its
    rows but the last (in one call for all such requests) and keep the last row only. EAGLE-3's
    catch-up between drafting rounds (fc(aux) rows)."""
    from engine.model_runner import SeqChunk

    updated = append_rows(states, committed, what)
    full = [(r, st) for r, st in updated if st.rows.shape[0] > max_rows]
    if not full:
        return
    chunks = [SeqChunk([0] * (st.rows.shape[0] - 1), st.start, r.block_ids) for r, st in full]
    token_ids = [r.token_at(j + 1) for r, st in full for j in range(st.start, st.end - 1)]
    forward(chunks, token_ids, torch.cat([st.rows[:-1] for _, st in full]))
    for r, st in full:
        states[r.request_id] = HiddenRows(st.end - 1, st.rows[-1:].clone())
