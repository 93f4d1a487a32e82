"""Rejection sampling for speculative decoding: a pure function over flat tensors.

Greedy requests accept draft tokens while they equal the target's argmax. Sampled requests follow
Leviathan et al. / Chen et al.: draft token d at position i is accepted with probability
min(1, p_i(d) / q_i(d)); on the first rejection a token is drawn from normalize(max(0, p_i - q_i))
and the rest are discarded; if all k drafts are accepted, a bonus token is drawn from p_k. The
result is distributed exactly as the target's own samples.

Layout: request r owns k_r draft rows (in `draft_token_ids`/`draft_probs`) and k_r + 1 target rows
(in `target_probs`/`target_argmax`), laid out request after request. Example: k = [2, 0, 3] ->
target rows [0,1,2 | 3 | 4,5,6,7], draft rows [0,1 | - | 2,3,4].
"""

from __future__ import annotations

import torch

from engine.sampler import sample_from_probs


def rejection_sample(
    num_draft_tokens: list[int],
    draft_token_ids: torch.Tensor,
    target_argmax: torch.Tensor | None,
    target_probs: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    is_greedy: list[bool],
    generators: list[torch.Generator | None],
) -> list[list[int]]:
    """Accepted draft tokens plus one recovered/bonus token, per request.

    num_draft_tokens: k_r per request. draft_token_ids [sum k] int64.
    target_argmax [sum (k+1)] int64 (needed when any request is greedy).
    target_probs [sum (k+1), vocab] float32 and draft_probs [sum k, vocab] float32 (needed when
    any request samples; rows of greedy requests are ignored). A draft that is deterministic
    (n-gram lookup) passes a one-hot row as its q.
    """
    drafts = draft_token_ids.tolist()
    argmax = target_argmax.tolist() if target_argmax is not None else None
    out: list[list[int]] = []
    t0 = d0 = 0
    for r, k in enumerate(num_draft_tokens):
        if is_greedy[r]:
            accepted: list[int] = []
            for i in range(k):
                if drafts[d0 + i] != argmax[t0 + i]:
                    break
                accepted.append(drafts[d0 + i])
            accepted.append(argmax[t0 + len(accepted)])
        else:
            accepted = _sample_one(
                drafts[d0 : d0 + k],
                draft_token_ids[d0 : d0 + k],
                target_probs[t0 : t0 + k + 1],
                draft_probs[d0 : d0 + k] if k else None,
                generators[r],
            )
        out.append(accepted)
        t0 += k + 1
        d0 += k
    return out


def _sample_one(drafts, draft_ids_t, p, q, generator) -> list[int]:
    # p [k+1, vocab] target probs; q [k, vocab] draft probs; drafts: k token ids
    k = len(drafts)
    device = p.device
    if k:
        rows = torch.arange(k, device=device)
        p_d = p[rows, draft_ids_t]
        q_d = q[rows, draft_ids_t]
        u = torch.rand(k, generator=generator, device=device)
        # accept iff u < p/q  (<=> u * q < p; q > 0 since d was drawn from q)
        accept = (u * q_d < p_d).tolist()
        n = 0
        while n < k and accept[n]:
            n += 1
    else:
        n = 0
    if n < k:
        residual = (p[n] - q[n]).clamp_min(0.0)
        total = residual.sum()
        # p == q exactly leaves no residual mass; then rejection had probability 0 anyway.
        dist = residual / total if total > 0 else p[n]
    else:
        dist = p[k]
    token = sample_from_probs(dist.unsqueeze(0), [generator]).item()  # 25 us; torch.multinomial: 180
    return drafts[:n] + [int(token)]
