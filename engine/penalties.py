"""Penalties and biases on the target's logits, per request and batched (OpenAI and vLLM
semantics), applied in this order before temperature, top-k and top-p:

- min_tokens: the end-of-sequence tokens and the request's stop_token_ids are -inf while fewer
  than min_tokens tokens have been generated;
- logit_bias: added to the named tokens' logits;
- repetition_penalty r (transformers, vLLM): every token seen in the prompt or the output has its
  logit divided by r where positive, multiplied by r where negative;
- frequency_penalty f and presence_penalty p (OpenAI): minus f x the token's count in the output,
  minus p if it occurs there at all.

Exactness under speculation: a request's rows in a step are its last regular token's, then one per
draft. Row j is where the (j+1)-th new token is chosen, after drafts 1..j would have been accepted,
so it counts the committed output plus drafts 1..j: the logits a one-token step would have at that
position. In a token tree, row u (node u's) counts the committed output plus the nodes on the
path from the root to u, and min_tokens holds at u while the output plus u's depth is short. Greedy takes the penalized argmax, rejection sampling runs on the penalized target, so
the output is the penalized target's with any drafter. (Drafts are proposed from the drafter's own
distribution; rejection sampling is exact for any proposal it was drawn from.)

The drafter's logits get the same processors (`apply_to_drafts`, from `sample_drafts`): a chain's
j-th draft is chosen after the committed output and drafts 1..j-1, exactly the history the target's
row j is penalized with, so a drafter that matches the target keeps matching it under penalties
(a greedy draft is the penalized argmax the target will take). The draft's distribution q is the
penalized one it was drawn from, so rejection sampling stays exact. The drafter pool drafts under
them too (the calls carry them: engine/spec_decode/remote.py `DraftPenalties`), and so does a token
tree, each node's children after the node's path (`tree_drafting.tree_children`).

Each request's output counts are kept per request and extended by the tokens committed since its
last step, so a step costs its new tokens and its drafts, not the whole output.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.request import Request


@dataclass
class _Counts:
    output: torch.Tensor  # [vocab] float32: each token's count in the committed output
    prompt: torch.Tensor  # [vocab] bool: tokens of the prompt (repetition penalty)
    num_counted: int  # output tokens counted so far


class Penalties:
    """The output counts of each live request that has logit processors (by request id)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts: dict[str, _Counts] = {}

    def _counts(self, request: Request) -> _Counts:
        c = self.counts.get(request.request_id)
        if c is None:
            prompt = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            prompt[torch.tensor(request.prompt_token_ids, device=self.device)] = True
            c = self.counts[request.request_id] = _Counts(
                torch.zeros(self.vocab_size, device=self.device), prompt, 0)
        new = request.output_token_ids[c.num_counted:]
        if new:
            c.output.index_add_(0, torch.tensor(new, device=self.device), torch.ones(len(new), device=self.device))
            c.num_counted += len(new)
        return c

    def apply(self, sampling, logits: torch.Tensor) -> None:
        """Penalize and bias, in place, the logits rows [R, vocab] of the requests of `sampling`
        (ScheduledRequests; each has len(spec_token_ids) + 1 rows, in order) that ask for it."""
        starts = list(itertools.accumulate((len(s.spec_token_ids) + 1 for s in sampling), initial=0))
        chosen = [(i, s) for i, s in enumerate(sampling) if s.request.sampling_params.has_logit_processors]
        if not chosen:
            return
        device = logits.device
        counted = [self._counts(s.request) for _, s in chosen]
        num_rows = [len(s.spec_token_ids) + 1 for _, s in chosen]
        rows = torch.tensor([starts[i] + j for (i, _), n in zip(chosen, num_rows, strict=True) for j in range(n)],
                            device=device)
        reps = torch.tensor(num_rows, device=device)
        out = torch.stack([c.output for c in counted]).repeat_interleave(reps, dim=0)  # [P, vocab]
        prompt = torch.stack([c.prompt for c in counted]).repeat_interleave(reps, dim=0)
        # row j of a request also counts its drafts 1..j (a tree's node j: the nodes on its path)
        base = list(itertools.accumulate(num_rows, initial=0))
        draft_rows, draft_tokens = [], []
        for b, (_, s) in zip(base, chosen, strict=False):
            for j in range(1, len(s.spec_token_ids) + 1):
                path = _path_tokens(s, j)
                draft_rows.extend([b + j] * len(path))
                draft_tokens.extend(path)
        if draft_rows:
            out.index_put_((torch.tensor(draft_rows, device=device), torch.tensor(draft_tokens, device=device)),
                           torch.ones(len(draft_rows), device=device), accumulate=True)
        params = [s.request.sampling_params for _, s in chosen]
        view = logits[rows]
        self._min_tokens(view, chosen, num_rows)
        self._bias(view, params, num_rows)

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, device=device).repeat_interleave(reps).unsqueeze(1)

        logits[rows] = _penalize(view, out, prompt, *(per_row([getattr(p, name) for p in params]) for name in PENALTIES))

    def apply_to_drafts(self, logits: torch.Tensor, requests: list[Request], drafted: list[list[int]] | None,
                        token_ids: torch.Tensor | None = None) -> None:
        """Penalize and bias, in place, a drafter's logits [n, V'] (row i: requests[i]'s next
        draft, after its committed output and the drafts `drafted[i]` it made before it in this
        chain), over the target's vocabulary or, with `token_ids` [V'], a draft vocabulary (column
        c is target token token_ids[c]); tokens outside it are not drafted and need nothing."""
        chosen = [i for i, r in enumerate(requests) if r.sampling_params.has_logit_processors]
        if not chosen:
            return
        device = logits.device
        counted = [self._counts(requests[i]) for i in chosen]
        out = torch.stack([c.output for c in counted])  # [C, vocab]
        prompt = torch.stack([c.prompt for c in counted])
        before = [list(drafted[i]) if drafted is not None else [] for i in chosen]
        pairs = [(row, t) for row, tokens in enumerate(before) for t in tokens]
        if pairs:
            rows_t, tokens_t = (torch.tensor(x, device=device) for x in zip(*pairs, strict=True))
            out.index_put_((rows_t, tokens_t), torch.ones(len(pairs), device=device), accumulate=True)
        column = None  # target token -> its column in the draft vocabulary, -1 where none
        if token_ids is not None:
            out, prompt = out[:, token_ids], prompt[:, token_ids]
            column = torch.full((self.vocab_size,), -1, dtype=torch.long, device=device)
            column[token_ids] = torch.arange(token_ids.numel(), device=device)
        rows = torch.tensor(chosen, device=device)
        view = logits[rows].float()
        params = [requests[i].sampling_params for i in chosen]
        fixes: list[tuple[int, int, float, bool]] = []  # (row, target token, value, replace: -inf)
        for row, (i, p) in enumerate(zip(chosen, params, strict=True)):
            r = requests[i]
            if r.num_output_tokens + len(before[row]) < p.min_tokens:
                fixes += [(row, t, float("-inf"), True)
                          for t in (*(() if p.ignore_eos else r.eos_token_ids), *p.stop_token_ids)]
            fixes += [(row, t, v, False) for t, v in (p.logit_bias or {}).items()]
        for set_inf in (True, False):
            picked = [(row, t, v) for row, t, v, inf in fixes if inf == set_inf]
            if not picked:
                continue
            r_t = torch.tensor([x[0] for x in picked], device=device)
            c_t = torch.tensor([x[1] for x in picked], device=device)
            v_t = torch.tensor([x[2] for x in picked], device=device)
            if column is not None:
                c_t = column[c_t]
                keep = c_t >= 0
                r_t, c_t, v_t = r_t[keep], c_t[keep], v_t[keep]
            if set_inf:
                view[r_t, c_t] = v_t
            else:
                view.index_put_((r_t, c_t), v_t, accumulate=True)

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, device=device).unsqueeze(1)

        view = _penalize(view, out, prompt, *(per_row([getattr(p, name) for p in params]) for name in PENALTIES))
        logits[rows] = view.to(logits.dtype)

    @staticmethod
    def _min_tokens(view: torch.Tensor, chosen, num_rows: list[int]) -> None:
        """-inf for the end of sequence and stop tokens on rows before min_tokens outputs."""
        rows, tokens = [], []
        base = 0
        for (_, s), n in zip(chosen, num_rows, strict=True):
            r, p = s.request, s.request.sampling_params
            stops = [*(() if p.ignore_eos else r.eos_token_ids), *p.stop_token_ids]
            short = max(0, p.min_tokens - r.num_output_tokens)  # rows at depths below it hold them off
            depths = s.spec_tree.depths if s.spec_tree is not None else range(n)
            for j in range(n):
                if depths[j] < short:
                    rows.extend([base + j] * len(stops))
                    tokens.extend(stops)
            base += n
        if rows:
            view[torch.tensor(rows, device=view.device), torch.tensor(tokens, device=view.device)] = float("-inf")

    @staticmethod
    def _bias(view: torch.Tensor, params, num_rows: list[int]) -> None:
        rows, tokens, values = [], [], []
        base = 0
        for p, n in zip(params, num_rows, strict=True):
            for token, value in (p.logit_bias or {}).items():
                rows.extend(range(base, base + n))
                tokens.extend([token] * n)
                values.extend([value] * n)
            base += n
        if rows:
            device = view.device
            view.index_put_((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                            torch.tensor(values, device=device, dtype=view.dtype), accumulate=True)

    def free(self, request_id: str) -> None:
        self.counts.pop(request_id, None)

    def check_no_leaks(self, live: list[Request]) -> None:
        stray = sorted(set(self.counts) - {r.request_id for r in live})
        assert not stray, f"penalty counts of requests that are not live: {stray[:5]}"


PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")  # `_penalize`'s order


def _penalize(view: torch.Tensor, out: torch.Tensor, prompt: torch.Tensor, repetition: torch.Tensor,
              frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Rows of logits after the repetition, frequency and presence penalties (per row [P, 1]),
    given each row's output counts `out` and prompt tokens `prompt` (both [P, columns])."""
    seen = (out > 0) | prompt
    view = torch.where(seen, torch.where(view > 0, view / repetition, view * repetition), view)
    return view - frequency * out - presence * (out > 0)


def _path_tokens(scheduled, j: int) -> list[int]:
    """The draft tokens row j of a scheduled request counts: drafts 1..j of a chain, or the
    tokens on the path from its tree's root to node j."""
    tree = scheduled.spec_tree
    if tree is None:
        return list(scheduled.spec_token_ids[:j])
    return [tree.token_ids[u] for u in tree.path_to(j)]
