"""One request object carries all per-request scheduling state, as plain data; derived values
are properties.

The scheduler, block manager and model runner all read and update this object. It holds token ids
only (the engine knows nothing about text) and no tensors: a seeded request's generator and its
draft distributions belong to the model runner, a drafter's per-request state to its proposer,
each keyed by request id.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.spec_decode.tree import DraftTree


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_HANDOFF = "handoff"  # exported to another engine after its prefill (engine/handoff.py)

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_HANDOFF,
        )


@dataclass
class SpecStats:
    """Speculation counters of one request (or, summed, of the engine)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    # token trees (SpeculativeConfig.tree_nodes): verifications of a tree, their draft nodes and
    # accepted tokens (also counted above). For a tree, "position" i above is depth i + 1: a tree
    # of depth d counts once at positions 0..d-1, its accepted path at 0..accepted-1.
    num_tree_steps: int = 0
    num_tree_nodes: int = 0
    num_tree_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per verification step, including the bonus/recovered token."""
        if not self.num_verify_steps:
            return 0.0
        return (self.num_accepted_tokens + self.num_verify_steps) / self.num_verify_steps

    def record(self, num_draft: int, num_accepted: int, tree_depth: int | None = None) -> None:
        """One verification of num_draft drafts (a chain, or a tree of that many nodes and
        `tree_depth` levels) of which num_accepted were accepted."""
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_verify_steps += 1
        if tree_depth is not None:
            self.num_tree_steps += 1
            self.num_tree_nodes += num_draft
            self.num_tree_accepted_tokens += num_accepted
            num_draft = tree_depth
        while len(self.drafted_by_position) < num_draft:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(num_draft):
            self.drafted_by_position[i] += 1
            if i < num_accepted:
                self.accepted_by_position[i] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_verify_steps += other.num_verify_steps
        self.draft_time_s += other.draft_time_s
        self.verify_time_s += other.verify_time_s
        self.num_tree_steps += other.num_tree_steps
        self.num_tree_nodes += other.num_tree_nodes
        self.num_tree_accepted_tokens += other.num_tree_accepted_tokens
        for name in ("drafted_by_position", "accepted_by_position"):
            mine, theirs = getattr(self, name), getattr(other, name)
            while len(mine) < len(theirs):
                mine.append(0)
            for i, v in enumerate(theirs):
                mine[i] += v

    def as_dict(self) -> dict:
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_verify_steps": self.num_verify_steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_by_position": list(self.accepted_by_position),
            "drafted_by_position": list(self.drafted_by_position),
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "num_tree_steps": self.num_tree_steps,
            "num_tree_nodes": self.num_tree_nodes,
            "num_tree_accepted_tokens": self.num_tree_accepted_tokens,
        }


class Request:
    """A generation request: prompt, outputs so far, cache state, sampling and speculation state."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of this request's full, committed blocks
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at (last) admission
        self.num_preemptions = 0
        # Prefill/decode disaggregation: leave this engine as a `Handoff` after the first token(s).
        self.export_after_prefill = False
        self.export_drafter_state = True
        # Speculation: drafts proposed for the next step (their distributions: the model runner's).
        self.spec_token_ids: list[int] = []
        # ...or, for tree speculation, the tree they form (its nodes 1.. are spec_token_ids, in
        # index order; node 0 is the last token); None for a chain.
        self.spec_tree: DraftTree | None = None
        self.acceptance_counts = (0.0, 0.0)  # decayed (accepted, tried) drafts: spec_decode/acceptance.py
        self.spec_stats = SpecStats()
        # Timing for metrics / tracing.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    # --- derived values -------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    @property
    def is_decoding(self) -> bool:
        """All tokens but the last sampled one have KV: the next step makes a new token."""
        return self.num_computed_tokens == self.num_tokens - 1

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
