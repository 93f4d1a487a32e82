"""Engine hardening: the inverse-CDF sampler's top end."""

from __future__ import annotations

import torch

from engine.sampler import sample_from_probs


def test_inverse_cdf_never_picks_a_zero_probability_token(monkeypatch):
    """u * total reaching the total (u rounded to 1) once picked the last token of the
    vocabulary even at probability 0; it must pick the last token with nonzero probability."""
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    for u in (1.0, 1.0 - 2**-24):
        monkeypatch.setattr(torch, "rand", lambda n, u=u, **kw: torch.full((n,), u))
        assert sample_from_probs(probs, [None] * 3).tolist() == [1, 2, 3]
        assert sample_from_probs(probs, [torch.Generator()] * 3).tolist() == [1, 2, 3]
    monkeypatch.undo()
    g = torch.Generator().manual_seed(0)
    rows = torch.rand(512, 40, generator=g) * (torch.rand(512, 40, generator=g) < 0.3)
    rows[:, 0] += 1e-3
    for _ in range(20):
        picked = sample_from_probs(rows, [None] * 512)
        assert (rows[torch.arange(512), picked] > 0).all()
