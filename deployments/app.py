"""The Serve application: the ingress (`deployments/ingress.py`) bound over the engine replicas
(`deployments/replica.py`) and, in disaggregated mode, the prefill pool; the engine pools bound
over the drafter pool (`deployments/drafter.py`) with `speculative.placement: remote`; each
deployment's options sized from the `AppConfig`, then a config file's `deployments:` overrides on top.
`deployments.app:build_app` is the import path Serve config files and the k8s manifests name.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from deployments.common import apply_overrides, replica_resources
from deployments.config import (
    DEPLOYMENT_NAME,
    DRAFTER_DEPLOYMENT_NAME,
    INGRESS_DEPLOYMENT_NAME,
    PREFILL_DEPLOYMENT_NAME,
    AppConfig,
)
from deployments.drafter import SpecDrafterServer, drafter_options
from deployments.ingress import SpecDecodeIngress
from deployments.replica import SpecDecodeServer

INGRESS_MAX_ONGOING_REQUESTS = 100_000
# An ingress replica being replaced (a config update) keeps relaying its streams until they end:
# they cannot move (the client's connection ends there), and it holds no model to free. Its
# streams' engine replicas hand them over meanwhile (deployments/drain.py); Serve's drain ends
# as soon as the last one does, so the bound only matters for a stream that never ends.
INGRESS_GRACEFUL_SHUTDOWN_TIMEOUT_S = 300


def deployment_options(config: AppConfig, overrides: dict | None = None) -> dict:
    """Serve options for the engine deployment: capacity from the engine's limits, then the
    config file's `deployments:` overrides (num_replicas, autoscaling_config, ...) on top."""
    options: dict[str, Any] = {
        "ray_actor_options": replica_resources(config),
        "max_ongoing_requests": config.max_num_seqs,
        "max_queued_requests": config.max_queued_requests,
        # Loading the target and drafter takes a while; a slow health check is not a dead replica.
        "health_check_timeout_s": 60,
        # a replica being removed hands its streams over drain_timeout_s into it, at most 28 s
        "graceful_shutdown_timeout_s": 30,
    }
    return apply_overrides(options, overrides)


def ingress_options(config: AppConfig, overrides: dict | None = None) -> dict:
    """Serve options for the gRPC ingress: no CPU reservation (it only relays messages; the proxy
    does the same), and no limit of its own on requests in flight: the engine deployment's
    max_ongoing_requests and max_queued_requests are the service's capacity."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS,
        "graceful_shutdown_timeout_s": INGRESS_GRACEFUL_SHUTDOWN_TIMEOUT_S,
    }
    return apply_overrides(options, overrides)


def build_app(args: dict) -> Application:
    """Serve application builder (`import_path: deployments.app:build_app`): validate the args
    and bind the deployments. Serve applies a config file's `deployments:` overrides itself."""
    return bind_app(AppConfig.from_dict(args or {}))


def bind_app(
    config: AppConfig, overrides: dict | None = None, ingress_overrides: dict | None = None,
    engine_cls: type = None,  # type: ignore[assignment] - SpecDecodeServer or a subclass (tests)
    prefill_overrides: dict | None = None,
    prefill_cls: type = None,  # type: ignore[assignment] - the prefill pool's class when it differs (tests)
    drafter_overrides: dict | None = None,
) -> Application:
    """The gRPC ingress bound over the engine deployment (in disaggregated mode, over the decode
    pool and the prefill pool; with `speculative.placement: remote`, the engine pools bound over
    the drafter pool), each sized from `config`, with `overrides` / `ingress_overrides` /
    `prefill_overrides` / `drafter_overrides` (deployment options as in a config file's
    `deployments:` entries: num_replicas, autoscaling_config, ...) applied on top."""
    cls = engine_cls or SpecDecodeServer
    pool = {}
    if config.speculative is not None and config.speculative.placement == "remote":
        drafter = serve.deployment(SpecDrafterServer, name=DRAFTER_DEPLOYMENT_NAME)
        pool["drafter_pool"] = drafter.options(**drafter_options(config, drafter_overrides)).bind(config)
    prefill_app = None
    if config.mode == "disaggregated":
        prefill = serve.deployment(prefill_cls or cls, name=PREFILL_DEPLOYMENT_NAME)
        prefill_app = prefill.options(**deployment_options(config, prefill_overrides)).bind(config, **pool)
    engine = serve.deployment(cls, name=DEPLOYMENT_NAME)
    role = {"role": "decode"} if config.mode == "disaggregated" else {}
    engine_app = engine.options(**deployment_options(config, overrides)).bind(config, **pool, **role)
    ingress = serve.deployment(SpecDecodeIngress, name=INGRESS_DEPLOYMENT_NAME)
    # the ingress probes the drafter pool for its health (deployments/health.py); the engine replicas draft through it
    return ingress.options(**ingress_options(config, ingress_overrides)).bind(
        engine_app, config, prefill_app, pool.get("drafter_pool"))
