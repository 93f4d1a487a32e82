"""How a prefill replica's `Handoff` reaches the decode replica: through Ray, never a socket of ours.

- `object_store`: `ray.put` into the prefill replica's node object store (the replica owns the
  object); the decode replica's `ray.get` reads it zero-copy on the same node, and Ray's object
  manager copies it across nodes (through both nodes' shared memory).
- `nixl`: Ray Direct Transport (`ray.put(..., _tensor_transport="nixl")`, alpha in Ray 2.60): the
  handoff's torch tensors stay in the prefill replica's memory (host or GPU), registered with a
  NIXL agent; only the small rest goes through the object store, and the decode replica's
  `ray.get` pulls the tensors one-sided from the exporter (UCX: shared memory or TCP between
  hosts, GPUDirect RDMA/NVLink between GPUs). The owner frees them when the reference is dropped.
  Measured here between two Ray nodes on this host (40 MB of CPU tensors, idle host): 73 ms vs
  239 ms through the object store (median of 5). But NIXL's agent (created by Ray with its
  progress thread on) keeps threads polling: on this 2-core CPU host three such threads took
  40-60% of a core each and slowed the engines' decode steps about 6x under load
  (bench/bench_pd.py), so on CPUs it is opt-in; GPU servers have host cores to spare for it.
- `auto` (default): `nixl` when the `nixl` package is importable and the engine runs on a GPU,
  else `object_store`.

`await ref` does not deserialize Ray Direct Transport objects in Ray 2.60 (the tensors are looked
up in a thread-local that only `ray.get` fills), so the decode side always reads with `ray.get`
in a worker thread, whichever transport put the handoff.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
from typing import Any

import ray

from deployments.config import HANDOFF_TRANSPORTS as TRANSPORTS


@functools.cache
def nixl_available() -> bool:
    return importlib.util.find_spec("nixl") is not None


def resolve_transport(name: str, device_type: str = "cpu") -> str:
    """`object_store` or `nixl` for a configured name and the engine's device type (ValueError
    for `nixl` without the package)."""
    if name not in TRANSPORTS:
        raise ValueError(f"handoff transport must be one of {TRANSPORTS}, got {name!r}")
    if name == "auto":
        return "nixl" if nixl_available() and device_type == "cuda" else "object_store"
    if name == "nixl" and not nixl_available():
        raise ValueError("handoff transport 'nixl' needs the nixl package (pip install nixl); use 'object_store'")
    return name


def put_handoff(handoff: Any, transport: str) -> ray.ObjectRef:
    """Publish a handoff, owned by the calling replica, by a resolved transport."""
    if transport == "nixl":
        return ray.put(handoff, _tensor_transport="nixl")
    return ray.put(handoff)


async def get_handoff(ref: ray.ObjectRef, timeout_s: float) -> Any:
    """Read a handoff put by `put_handoff` (either transport) without blocking the event loop.
    Raises ray.exceptions.GetTimeoutError or the RayError of a lost object / dead owner."""
    return await asyncio.to_thread(ray.get, ref, timeout=timeout_s)
