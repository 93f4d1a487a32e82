"""Token sampling over flat logits: temperature, top-k, top-p, and per-request seeded generators.

`probs_from_logits` is shared by the sampler and the rejection sampler, so target and draft
distributions are filtered identically.
"""

from __future__ import annotations

import torch


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


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row. Rows with a generator draw from it (reproducible per request).

    Exponential race: argmax(p / E) with E ~ Exp(1) samples from p, and needs one draw per row,
    which makes per-request generators cheap. probs [n, vocab] -> token ids [n] int64.
    """
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    else:
        for i, g in enumerate(generators):
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def uniform(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """n uniform draws in [0, 1) from the request's generator (or the global one)."""
    return torch.rand(n, generator=generator, device=device)
