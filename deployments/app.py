"""The engine replica: one `engine.AsyncLLM` (target + drafter on one device) as a Ray Serve
deployment, called by the gRPC ingress (`deployments/ingress.py`) through a deployment handle.

A thin shell: it translates a `GenerateRequest` into token ids and `SamplingParams` (text is
tokenized in a worker thread, after a length check that needs no tokenizer), streams the engine's
outputs back as `GenerateResponse`s, and reports refusals as a yielded `ClientError` instead of
raising (an exception raised here is logged by Serve with a traceback, and a refusal is not a
fault). Each engine request gets a fresh id of the server's own; the client's `request_id` is a
label for the response, logs and traces, so reusing one can never touch another request.
Cancelling the stream (client cancel, deadline) cancels the generator, which aborts the engine
request and frees its KV blocks. `build_app(args)` is the import path Serve config files name.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from ray import serve
from ray.serve import Application

from deployments.autoscaling import LatencyTracker, replica_autoscaling_stats
from deployments.config import DEPLOYMENT_NAME, INGRESS_DEPLOYMENT_NAME, AppConfig, resolve_path
from deployments.errors import ClientError
from deployments.metrics import start_replica_metrics
from deployments.router import routing_stats
from deployments.tracing import grpc_span_attributes, setup_tracing
from protos.specdecode.v1 import specdecode_pb2 as pb

logger = logging.getLogger("ray.serve")

HEALTH_CHECK_TIMEOUT_S = 30.0
# Limits on fields the proto leaves unbounded (each is named in the error a client gets).
MAX_TEMPERATURE = 100.0  # beyond it every distribution is uniform noise to float32
MAX_SPECULATIVE_TOKENS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
INGRESS_MAX_ONGOING_REQUESTS = 100_000
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


@dataclass(frozen=True)
class Accepted:
    """First item of every `generate` stream that passed validation: the engine holds the request
    (the ingress's bounded wait for a replica ends here)."""

    replica_id: str


class TraceMetadata:
    """The caller's W3C trace headers, shaped like the gRPC context `parent_context` reads."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = pairs

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.pairs


class SpecDecodeServer:
    """One engine replica: an AsyncLLM (target + drafter on one device) behind `generate`."""

    def __init__(self, config: AppConfig) -> None:
        from engine import AsyncLLM

        self.config = config
        engine_kwargs = config.engine_kwargs()
        self.llm = AsyncLLM(resolve_path(config.model), **engine_kwargs)
        engine = self.llm.engine
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.max_prompt_tokens = min(config.max_prompt_tokens or engine.max_model_len - 1, engine.max_model_len - 1)
        self.has_drafter = config.speculative is not None
        self.latency = LatencyTracker(config.metrics_window_s)  # p95s for the SLO autoscaling policy
        # Prometheus metrics always; tracing only when configured (else None: nothing registered).
        k = config.speculative.num_speculative_tokens if config.speculative else 0
        self.metrics = start_replica_metrics(self.llm, k)
        self.tracing = setup_tracing(config.tracing, self.llm)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a replica (direct construction in tests)
            self.replica_id = ""
        logger.info(
            "SpecDecode replica ready: %s, drafter %s, max_model_len %d, max_prompt_tokens %d, "
            "%d torch threads on %s",
            config.model, config.speculative, self.max_model_len, self.max_prompt_tokens,
            engine_kwargs["num_threads"], self.llm.engine.device,
        )

    # --- called by the ingress ----------------------------------------------------------------
    async def generate(
        self, request: pb.GenerateRequest, label: str, trace_metadata: list[tuple[str, str]] | None = None
    ) -> AsyncIterator[Accepted | ClientError | pb.GenerateResponse]:
        """`Accepted`, then the response messages; or one `ClientError` (and nothing else) when the
        request is refused or the engine fails it. `label` is the client's id for the request."""
        from engine import EngineDeadError, EngineError, EngineOverloadedError, InvalidRequestError

        request_id = uuid.uuid4().hex  # the engine's id: never the client's
        try:
            prompt, params = await self.translate(request)
        except ClientError as e:  # logged once, by the ingress
            yield e
            return
        speculating = self.has_drafter and params.speculative and params.num_speculative_tokens != 0
        self.latency.start(request_id)
        try:
            stream = self.llm.generate(prompt, params, request_id=request_id)
            if self.tracing is not None:
                attributes = grpc_span_attributes("Generate", self.replica_id, params, speculating, label)
                parent = self.tracing.parent_context(TraceMetadata(trace_metadata or []))
                stream = self.tracing.trace(stream, request_id, parent=parent, server=True, attributes=attributes)
            yield Accepted(self.replica_id)
            async for out in stream:
                self.latency.on_tokens(request_id, len(out.delta_token_ids))
                if out.finished:
                    self.metrics.on_request_finished(out, speculating)
                yield self.to_response(out, label, speculating)
        except InvalidRequestError as e:
            yield ClientError(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineOverloadedError as e:
            yield ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"replica full: {e}; retry later")
        except EngineDeadError as e:
            logger.error("request %r failed: engine stopped: %s", label, e)
            yield ClientError(grpc.StatusCode.UNAVAILABLE, "the engine on this replica stopped; retry the request")
        except EngineError as e:
            logger.error("request %r failed: engine error: %s", label, e)
            yield ClientError(grpc.StatusCode.INTERNAL, f"engine error: {e}")
        finally:
            self.latency.finish(request_id)

    async def model_info(self) -> pb.ModelInfo:
        return await self.GetModelInfo(pb.GetModelInfoRequest())

    async def GetModelInfo(self, request: pb.GetModelInfoRequest) -> pb.ModelInfo:  # noqa: N802 - gRPC name
        cfg, engine = self.config, self.llm.engine
        stats = await self.llm.call(engine.stats)
        spec = cfg.speculative
        return pb.ModelInfo(
            model=cfg.model,
            drafter_method=spec.method if spec else "",
            drafter_model=(spec.model or "") if spec else "",
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            adaptive=spec.adaptive if spec else False,
            has_tokenizer=self.llm.tokenizer is not None,
            device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."),
            limits=pb.Limits(
                max_model_len=self.max_model_len,
                max_prompt_tokens=self.max_prompt_tokens,
                max_tokens=cfg.max_tokens,
                default_max_tokens=cfg.default_max_tokens,
                max_num_seqs=cfg.max_num_seqs,
                max_queued_requests=cfg.max_queued_requests,
                vocab_size=self.vocab_size,
            ),
            usage=pb.EngineUsage(
                num_blocks=stats["num_blocks"],
                num_used_blocks=stats["num_used_blocks"],
                num_free_blocks=stats["num_free_blocks"],
                num_running=stats["num_running"],
                num_waiting=stats["num_waiting"],
                num_preemptions=stats["num_preemptions"],
                speculation=_spec_stats(stats.get("spec", {}), enabled=spec is not None),
            ),
            replica_id=self.replica_id,
        )

    # --- Serve hooks ------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine thread must answer a no-op
        call between two steps within HEALTH_CHECK_TIMEOUT_S."""
        try:
            await asyncio.wait_for(self.llm.call(_noop), HEALTH_CHECK_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"the engine loop did not answer within {HEALTH_CHECK_TIMEOUT_S} s") from None

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve autoscaling metrics for deployments.autoscaling.SLOAutoscalingPolicy: windowed
        p95 TTFT/TPOT, engine queue and KV-cache use (cheap: a snapshot, no engine call). Async
        so that it runs on the event loop that updates the latency tracker (Serve runs sync
        methods in a thread pool)."""
        return replica_autoscaling_stats(self.llm.stats(), self.latency.snapshot())

    async def record_routing_stats(self) -> dict[str, float]:
        """Engine load for deployments.router.EngineLoadRouter (queued tokens, KV-cache use)."""
        return routing_stats(self.llm.stats())

    def __del__(self) -> None:
        for hook in (getattr(self, "metrics", None), getattr(self, "tracing", None)):
            if hook is not None:
                hook.shutdown()
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()

    # --- translation ------------------------------------------------------------------------
    async def translate(self, request: pb.GenerateRequest) -> tuple[list[int], Any]:
        """Prompt token ids and SamplingParams for a request; ClientError if it is bad. Every
        field is checked before the prompt is tokenized, and the prompt's length before that."""
        from engine import InvalidRequestError, SamplingParams

        invalid = grpc.StatusCode.INVALID_ARGUMENT
        kind = request.WhichOneof("input")
        if kind is None:
            raise ClientError(invalid, "prompt: set `prompt` (text) or `prompt_token_ids`")
        kwargs = self.sampling_kwargs(request)
        try:
            params = SamplingParams(**kwargs)
        except InvalidRequestError as e:
            raise ClientError(invalid, str(e)) from None
        if kind == "prompt":
            if not request.prompt:
                raise ClientError(invalid, "prompt: is empty; give at least one character")
            try:
                _, ids = await self.llm.encode_async(request.prompt, self.max_prompt_tokens)
            except InvalidRequestError as e:
                raise ClientError(invalid, f"prompt: {e}") from None
        else:
            ids = list(request.prompt_token_ids.ids)
            if not ids:
                raise ClientError(invalid, "prompt_token_ids: is empty; give at least one token id")
            if len(ids) > self.max_prompt_tokens:
                raise ClientError(
                    invalid, f"prompt: has {len(ids)} tokens; this deployment accepts at most {self.max_prompt_tokens}"
                )
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ClientError(
                    invalid, f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size - 1}]"
                )
        if len(ids) > self.max_prompt_tokens:
            raise ClientError(
                invalid, f"prompt: has {len(ids)} tokens; this deployment accepts at most {self.max_prompt_tokens}"
            )
        return ids, params

    def sampling_kwargs(self, request: pb.GenerateRequest) -> dict[str, Any]:
        """SamplingParams keyword arguments from the request's fields, each range-checked here (the
        proto's ranges are wider than the engine's: int64 seeds, infinite doubles, long lists)."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        cfg = self.config
        max_tokens = request.max_tokens if request.HasField("max_tokens") else cfg.default_max_tokens
        if max_tokens > cfg.max_tokens:
            raise ClientError(invalid, f"max_tokens: {max_tokens} exceeds this deployment's cap of {cfg.max_tokens}")
        for name in ("temperature", "top_p"):
            value = getattr(request, name)
            if request.HasField(name) and not math.isfinite(value):
                raise ClientError(invalid, f"{name}: must be a finite number, got {value!r}")
        if request.HasField("temperature") and request.temperature > MAX_TEMPERATURE:
            raise ClientError(invalid, f"temperature: must be in [0, {MAX_TEMPERATURE}], got {request.temperature!r}")
        if request.HasField("top_k") and request.top_k > self.vocab_size:
            raise ClientError(invalid, f"top_k: must be in [0, {self.vocab_size}] (0 = off), got {request.top_k}")
        if request.HasField("seed") and request.seed < 0:
            raise ClientError(invalid, f"seed: must be in [0, {2**63 - 1}], got {request.seed}")
        mode = request.speculation
        if mode not in pb.SpeculationMode.values():
            names = ", ".join(pb.SpeculationMode.keys())
            raise ClientError(invalid, f"speculation: unknown mode {mode}; use one of {names}")
        if mode == pb.SPECULATION_MODE_ON and not self.has_drafter:
            raise ClientError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "speculation: ON, but this deployment has no drafter; use DEFAULT or OFF",
            )
        if request.HasField("max_speculative_tokens") and request.max_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ClientError(invalid, f"max_speculative_tokens: must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                                       f"got {request.max_speculative_tokens}")
        stops = list(request.stop)
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ClientError(invalid, f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                                       f"characters, got {len(stops)} (longest {max(map(len, stops))})")
        stop_ids = list(request.stop_token_ids)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise ClientError(invalid, f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(stop_ids)}")
        bad = [t for t in stop_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ClientError(invalid, f"stop_token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size - 1}]")
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "stop": stops or None,
            "stop_token_ids": stop_ids,
            "ignore_eos": request.ignore_eos,
            "speculative": mode != pb.SPECULATION_MODE_OFF,
        }
        for name in ("temperature", "top_p", "top_k", "seed"):
            if request.HasField(name):
                kwargs[name] = getattr(request, name)
        if request.HasField("max_speculative_tokens"):
            kwargs["num_speculative_tokens"] = request.max_speculative_tokens
        return kwargs

    @staticmethod
    def to_response(out: Any, label: str, speculating: bool) -> pb.GenerateResponse:
        """One engine RequestOutput as a stream message (the last one carries the totals)."""
        msg = pb.GenerateResponse(request_id=label, token_ids=out.delta_token_ids, text=out.delta_text)
        if out.finished:
            m = out.metrics
            msg.finish_reason = _FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
            msg.usage.CopyFrom(
                pb.Usage(
                    prompt_tokens=m.get("num_prompt_tokens", len(out.prompt_token_ids)),
                    completion_tokens=m.get("num_output_tokens", len(out.token_ids)),
                    cached_prompt_tokens=out.num_cached_tokens,
                )
            )
            msg.speculation.CopyFrom(_spec_stats(m.get("spec", {}), enabled=speculating))
            msg.timing.CopyFrom(pb.Timing(ttft_s=m.get("ttft_s") or 0.0, e2e_s=m.get("e2e_s") or 0.0))
        return msg


def _noop() -> None:
    return None


def _spec_stats(spec: dict, enabled: bool) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        enabled=enabled,
        num_draft_tokens=spec.get("num_draft_tokens", 0),
        num_accepted_tokens=spec.get("num_accepted_tokens", 0),
        num_verify_steps=spec.get("num_verify_steps", 0),
        acceptance_rate=spec.get("acceptance_rate", 0.0),
        mean_accepted_length=spec.get("mean_accepted_length", 0.0),
        draft_time_s=spec.get("draft_time_s", 0.0),
        verify_time_s=spec.get("verify_time_s", 0.0),
    )


def replica_resources(config: AppConfig) -> dict:
    """`ray_actor_options`: one GPU per replica when the cluster has GPUs (and the device allows),
    else `num_cpus` CPUs. Decided where the app is built, i.e. on the cluster."""
    import ray

    wants_gpu = config.device == "cuda"
    if config.device == "auto" and ray.is_initialized():
        wants_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    return {"num_gpus": 1, "num_cpus": 1} if wants_gpu else {"num_cpus": config.num_cpus}


def deployment_options(config: AppConfig, overrides: dict | None = None) -> dict:
    """Serve options for the engine deployment: capacity from the engine's limits, then the
    config file's `deployments:` overrides (num_replicas, autoscaling_config, ...) on top."""
    options: dict[str, Any] = {
        "ray_actor_options": replica_resources(config),
        "max_ongoing_requests": config.max_num_seqs,
        "max_queued_requests": config.max_queued_requests,
        # Loading the target and drafter takes a while; a slow health check is not a dead replica.
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": 30,
    }
    return _apply(options, overrides)


def ingress_options(config: AppConfig, overrides: dict | None = None) -> dict:
    """Serve options for the gRPC ingress: no CPU reservation (it only relays messages; the proxy
    does the same), and no limit of its own on requests in flight: the engine deployment's
    max_ongoing_requests and max_queued_requests are the service's capacity."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS,
        "graceful_shutdown_timeout_s": 30,
    }
    return _apply(options, overrides)


def _apply(options: dict, overrides: dict | None) -> dict:
    for key, value in (overrides or {}).items():
        if key != "name":
            options[key] = value
    return options


def build_app(args: dict) -> Application:
    """Serve application builder (`import_path: deployments.app:build_app`): validate the args
    and bind the deployments. Serve applies a config file's `deployments:` overrides itself."""
    return bind_app(AppConfig.from_dict(args or {}))


def bind_app(
    config: AppConfig, overrides: dict | None = None, ingress_overrides: dict | None = None,
    engine_cls: type = None,  # type: ignore[assignment] - SpecDecodeServer or a subclass (tests)
) -> Application:
    """The gRPC ingress bound over the engine deployment, each sized from `config`, with
    `overrides` / `ingress_overrides` (deployment options as in a config file's `deployments:`
    entries: num_replicas, autoscaling_config, ...) applied on top."""
    from deployments.ingress import SpecDecodeIngress

    engine = serve.deployment(engine_cls or SpecDecodeServer, name=DEPLOYMENT_NAME)
    engine_app = engine.options(**deployment_options(config, overrides)).bind(config)
    ingress = serve.deployment(SpecDecodeIngress, name=INGRESS_DEPLOYMENT_NAME)
    return ingress.options(**ingress_options(config, ingress_overrides)).bind(engine_app, config)
