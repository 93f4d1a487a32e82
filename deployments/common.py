"""What the ingress, the engine replicas, the OpenAI API and the drafter pool share, below all of
them: the items of an engine replica's stream besides its messages, the limits both protocols apply to a request, what a
lost replica looks like to a handle call, and the Serve options every deployment starts from.
It imports nothing else from `deployments` but its config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from deployments.config import AppConfig

HEALTH_TIMEOUT_S = 5.0  # /health and grpc.health.v1: healthy when an engine replica answers within it
# A client's request_id is a label that goes back in every message and into logs and traces: short
# and printable (no newline to forge a log line with, no 4 MB label echoed with every token).
MAX_REQUEST_ID_CHARS = 256

# What a lost replica (its actor or node died, or Serve took it out) looks like to a handle call.
REPLICA_LOST = (RayActorError, WorkerCrashedError, NodeDiedError, ObjectLostError, ReplicaUnavailableError,
                DeploymentUnavailableError)


@dataclass(frozen=True)
class Accepted:
    """First item of every `generate` stream that passed validation: the engine holds the request
    (the ingress's bounded wait for a replica ends here)."""

    replica_id: str


@dataclass(frozen=True)
class PrefillElsewhere:
    """A decode replica's answer to `generate` in disaggregated mode when the prompt is to be
    prefilled by the prefill pool: the translated request and why it goes there (its slot is
    free once this is sent). The ingress sends it to the pool, then to a decode replica's
    `resume` with the handoff."""

    prompt: list[int]
    params: Any  # engine.SamplingParams
    placement: Any  # deployments.placement.Placement
    uncached_tokens: int
    speculating: bool
    tools: list | None = None  # deployments.tools.Tool: the calls are parsed from the output
    num_completions: tuple[int, int] = (1, 1)  # (n, best_of): the pool prefills completion 0


def completion_params(params: Any, i: int, ranking: bool) -> Any:
    """Completion `i`'s params of a request with several (n or best_of > 1): its seed is the
    request's seed + i (unseeded stays unseeded); when they are ranked (best_of > n) each keeps
    its log-probabilities, which the ranking sums."""
    import dataclasses

    return dataclasses.replace(params, seed=None if params.seed is None else params.seed + i,
                               logprobs=0 if ranking and params.logprobs is None else params.logprobs)


@dataclass(frozen=True)
class PrefillResult:
    """A prefill replica's last item: where the handoff is and what the client already got.
    The ObjectRef sits in a list, so that Ray passes it on as a reference (not its value)."""

    handoff: list  # [ObjectRef[engine.handoff.Handoff]]
    transport: str  # how it was put (deployments/handoff_transport.py)
    num_bytes: int
    num_emitted_chars: int  # characters of text the first message(s) carried
    sent_at: float  # time.time() when the handoff was put into the object store
    replica_id: str = ""  # the prefill replica, and its engine's measured prefill rate
    prefill_tokens_per_s: float | None = None


@dataclass(frozen=True)
class Resume:
    """The rest of a stream whose replica was lost or handed it over: the tokens the client
    already has and the characters of their text it was sent (the new replica prefills them with
    the prompt and streams what follows); why (engine: the replica was lost; drain: it was being
    removed) and which resumption of the request this is (1 for the first), for its trace."""

    token_ids: list[int]
    num_chars: int
    reason: str = "engine"
    ordinal: int = 1


@dataclass(frozen=True)
class Handover:
    """An engine replica's last item of a stream it gives up because Serve is removing the
    replica (downscale, redeploy) and the stream outlived the drain window (deployments/drain.py):
    the client has every message before it, and the ingress resumes the request on another
    replica after them (`Resume`), as for a lost replica but not counted as a failure."""


@dataclass(frozen=True)
class HandoffRead:
    """A decode replica's `resume` has read the handoff (or found it lost): the prefill call that
    holds it can be closed."""

    found: bool


@dataclass(frozen=True)
class Prefilled:
    """Where a disaggregated request's prompt ended up prefilled, sent before its first message:
    "remote" (the handoff was imported), "fallback" (prefilled by the decode replica after the
    tokens already sent), with the reason for a fallback (no_handoff, lost, refused), or "pool"
    (the prefill replica decodes it as well: no handoff)."""

    where: str
    reason: str = ""


def replica_resources(config: AppConfig) -> dict:
    """`ray_actor_options`: one GPU per replica when the cluster has GPUs (and the device allows),
    else `num_cpus` CPUs. Decided where the app is built, i.e. on the cluster."""
    wants_gpu = config.device == "cuda"
    if config.device == "auto" and ray.is_initialized():
        wants_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    return {"num_gpus": 1, "num_cpus": 1} if wants_gpu else {"num_cpus": config.num_cpus}


def apply_overrides(options: dict, overrides: dict | None) -> dict:
    """`options` with a config file's `deployments:` entry (num_replicas, autoscaling_config, ...)
    set on top; its `name` only says which deployment the entry is for, so it is not an option."""
    for key, value in (overrides or {}).items():
        if key != "name":
            options[key] = value
    return options
