"""The `Proposer` protocol every drafter implements, and what it returns.

A proposer gets the requests that will verify drafts next step and a k for each, and returns
k draft token ids per request, with the draft distribution q [k, vocab] when the request samples
(so the rejection sampler stays exact) or None when drafts are deterministic (greedy requests,
n-gram lookup). Proposers never commit anything: their own caches only keep accepted positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.request import Request


@dataclass
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] float32, or None if deterministic


class Proposer(Protocol):
    method: str

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    def kv_bytes_per_token(self) -> int: ...

    def propose(self, requests: list[Request], num_tokens: list[int], context: ProposeContext) -> list[Draft]: ...

    def on_request_finished(self, request: Request) -> None: ...

    def step_cost(self, num_requests: int, k: int) -> float:
        """Estimated drafting time for `num_requests` requests at k tokens, in seconds."""
        ...


@dataclass
class ProposeContext:
    """What the engine hands a proposer after a step: the target runner and its last output."""

    runner: object  # engine.model_runner.ModelRunner
    runner_output: object  # engine.model_runner.ModelRunnerOutput
    scheduler_output: object  # engine.scheduler.SchedulerOutput
