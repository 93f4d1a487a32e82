"""Token sampling over flat logits: temperature, top-k, top-p, and per-request seeded generators.

`probs_from_logits` is shared by the sampler and the rejection sampler, so target and draft
distributions are filtered identically. `token_logprobs` reads the log-probabilities a request
asked for (`SamplingParams.logprobs`) off the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's log-probability under the target and its most likely alternatives
    ((token id, log-probability) pairs, most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """logits [n, vocab] (row j: the distribution token_ids[j] was drawn from) -> the tokens'
    log-softmax values and the num_top largest of each row, in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logp.device).unsqueeze(1))[:, 0].tolist()
    if num_top == 0:
        return [TokenLogprobs(t, v) for t, v in zip(token_ids, chosen, strict=True)]
    values, ids = logp.topk(num_top, dim=-1)
    return [TokenLogprobs(t, v, tuple(zip(i, w, strict=True)))
            for t, v, i, w in zip(token_ids, chosen, ids.tolist(), values.tolist(), strict=True)]


def probs_from_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Filtered sampling distribution per row.

    logits [n, vocab] float32; temperature/top_p [n] float32 (temperature > 0); top_k [n] int64
    (0 = off). Order as in transformers/vLLM: scale by temperature, keep the top_k largest, then
    the smallest set of tokens whose probability mass reaches top_p. Returns probs [n, vocab].
    """
    logits = logits / temperature.unsqueeze(1)
    use_top_k = bool((top_k > 0).any())
    use_top_p = bool((top_p < 1.0).any())
    if use_top_k or use_top_p:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if use_top_k:
            ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
            k = torch.where(top_k > 0, top_k, logits.shape[-1]).unsqueeze(1)
            mask |= ranks >= k
        if use_top_p:
            sorted_probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            mask |= mass_before >= top_p.unsqueeze(1)
            mask[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    return logits.softmax(dim=-1)


def draw_uniforms(counts: list[int], generators: list[torch.Generator | None],
                  device: torch.device | str) -> torch.Tensor:
    """U[0, 1) draws, counts[r] for request r, laid out request after request: [sum counts] float32.

    A request with a generator draws its own in one call (so its draws depend only on its seed
    and its own history, never on the batch); the rest share one call on the default generator.
    A count of 0 draws nothing (not even from a seeded generator). Example: counts [2, 0, 1],
    generators [g, None, None] -> [g, g, default]. No host sync.
    """
    if all(g is None for g in generators):
        return torch.rand(sum(counts), device=device)
    free = torch.rand(sum(c for c, g in zip(counts, generators, strict=True) if g is None), device=device)
    pieces, start = [], 0
    for c, g in zip(counts, generators, strict=True):
        if g is not None:
            pieces.append(torch.rand(c, generator=g, device=device) if c else free[:0])
        else:
            pieces.append(free[start : start + c])
            start += c
    return torch.cat(pieces)


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row: the first index whose cumulative mass exceeds u * total.

    Zero-probability tokens are never picked: their cumulative mass equals their predecessor's,
    and when u * total reaches the total (u rounds to 1) the pick is the first index whose
    cumulative mass reaches the total, the last token with nonzero probability. Example: probs
    [0.3, 0.7, 0, 0], u * total = 1.0 -> no index exceeds it -> token 1, not 3.
    probs [n, vocab] (need not be normalized), u [n] in [0, 1) -> token ids [n] int64.
    """
    cdf = probs.float().cumsum(dim=-1)  # [n, vocab], non-decreasing
    total = cdf[:, -1:].contiguous()  # [n, 1]
    picked = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)  # [n, 1]
    last_nonzero = torch.searchsorted(cdf, total, right=False)  # [n, 1]: first index with cdf >= total
    return torch.minimum(picked, last_nonzero).squeeze(1)


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row. Rows with a generator draw from it (reproducible per request).

    Inverse CDF (`inverse_cdf_sample`) with one uniform per row (`draw_uniforms`): it keeps
    per-request generators cheap (an exponential race needs a draw per vocabulary entry from
    each row's generator).
    probs [n, vocab] -> token ids [n] int64.
    """
    return inverse_cdf_sample(probs, draw_uniforms([1] * probs.shape[0], generators, probs.device))
