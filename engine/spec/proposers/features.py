"""Bookkeeping shared by the proposers that read the target's hidden states (EAGLE, MTP).

After every step, each request keeps the final-norm hidden states of its newly committed
positions (prefill chunk rows, or the last token + accepted drafts of a verification) until the
proposer consumes them. Only those rows are sliced out of the step's batch output.
"""

from __future__ import annotations

import torch

from engine.request import Request


def collect_committed_hidden(sched, runner_out) -> None:
    """Append each scheduled request's committed rows to `drafter_state["hidden"]`.

    Example: a verification of 3 drafts with 2 accepted commits rows [c, c+1, c+2] (the last
    token and 2 drafts) of the request's 4 query rows; a partial prefill chunk commits all rows.
    """
    hidden = runner_out.hidden_states
    cu = runner_out.cu_query_lens
    for i, (s, tokens) in enumerate(zip(sched.scheduled, runner_out.sampled_token_ids, strict=True)):
        r: Request = s.request
        if r.is_finished:
            continue
        committed = s.num_new_tokens + (len(tokens) - 1 if tokens else 0)
        rows = hidden[cu[i] : cu[i] + committed]
        state = r.drafter_state
        if "hidden" not in state:
            # first rows of this request (or after preemption): they start at position `start`
            state["hidden_start"] = r.num_computed_tokens - committed
            state["hidden"] = rows.clone()
        else:
            state["hidden"] = torch.cat([state["hidden"], rows])


def pop_hidden(request: Request, upto: int) -> tuple[int, torch.Tensor]:
    """Take the stored hidden states of positions [hidden_start, upto); keep the rest."""
    state = request.drafter_state
    start, rows = state["hidden_start"], state["hidden"]
    n = upto - start
    taken, state["hidden"] = rows[:n], rows[n:]
    state["hidden_start"] = upto
    return start, taken
