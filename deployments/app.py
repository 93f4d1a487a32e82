"""The Ray Serve replica: gRPC `specdecode.v1.SpecDecode` methods over one `engine.AsyncLLM`.

A thin shell: it translates protobuf requests into `SamplingParams`, streams the engine's
outputs back as `GenerateResponse`s and maps engine errors to gRPC status codes. Serve's gRPC
proxy calls `Generate`/`GetModelInfo` by name. Cancelling the stream (client cancel, deadline)
cancels the generator, which aborts the engine request and frees its KV blocks.
`build_app(args)` is the import path Serve config files name.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from ray import serve
from ray.serve import Application
from ray.serve.grpc_util import RayServegRPCContext

from deployments.autoscaling import LatencyTracker, replica_autoscaling_stats
from deployments.config import DEPLOYMENT_NAME, AppConfig, resolve_path
from deployments.metrics import start_replica_metrics
from deployments.router import routing_stats
from deployments.tracing import grpc_span_attributes, setup_tracing
from protos.specdecode.v1 import specdecode_pb2 as pb

logger = logging.getLogger("ray.serve")

HEALTH_CHECK_TIMEOUT_S = 30.0
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class RequestRejected(Exception):
    """A request the replica refuses, with the gRPC status code and details to send back."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)  # both in args, so the exception pickles across Ray
        self.code = code
        self.details = details

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class SpecDecodeServer:
    """One replica: an AsyncLLM (target + drafter on one device) behind the gRPC methods."""

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
        self.live_request_ids: set[str] = set()
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

    # --- gRPC methods -----------------------------------------------------------------------
    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        from engine import EngineDeadError, EngineError, EngineOverloadedError, InvalidRequestError

        try:
            prompt, params = self.translate(request)
            request_id = request.request_id or grpc_context.request_id() or uuid.uuid4().hex
            if request_id in self.live_request_ids:
                raise RequestRejected(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already in use")
            speculating = self.has_drafter and params.speculative and params.num_speculative_tokens != 0
            self.live_request_ids.add(request_id)
            self.latency.start(request_id)
            try:
                stream = self.llm.generate(prompt, params, request_id=request_id)
                if self.tracing is not None:
                    attributes = grpc_span_attributes("Generate", self.replica_id, params, speculating)
                    parent = self.tracing.parent_context(grpc_context)
                    stream = self.tracing.trace(stream, request_id, parent=parent, server=True, attributes=attributes)
                async for out in stream:
                    self.latency.on_tokens(request_id, len(out.delta_token_ids))
                    if out.finished:
                        self.metrics.on_request_finished(out, speculating)
                    yield self.to_response(out, request_id, speculating)
            finally:
                self.live_request_ids.discard(request_id)
                self.latency.finish(request_id)
        except RequestRejected as e:
            _fail(grpc_context, e.code, e.details)
            raise
        except InvalidRequestError as e:
            _fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise
        except EngineOverloadedError as e:
            _fail(grpc_context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"replica full: {e}; retry later")
            raise
        except EngineDeadError as e:
            _fail(grpc_context, grpc.StatusCode.UNAVAILABLE, f"engine stopped: {e}")
            raise
        except EngineError as e:
            _fail(grpc_context, grpc.StatusCode.INTERNAL, f"engine error: {e}")
            raise

    async def GetModelInfo(  # noqa: N802 - gRPC method name
        self, request: pb.GetModelInfoRequest, grpc_context: RayServegRPCContext | None = None
    ) -> pb.ModelInfo:
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
    def translate(self, request: pb.GenerateRequest) -> tuple[list[int], Any]:
        """Prompt token ids and SamplingParams for a request; RequestRejected if it is bad."""
        from engine import InvalidRequestError, SamplingParams

        invalid = grpc.StatusCode.INVALID_ARGUMENT
        kind = request.WhichOneof("input")
        if kind is None:
            raise RequestRejected(invalid, "prompt: set `prompt` (text) or `prompt_token_ids`")
        if kind == "prompt":
            if not request.prompt:
                raise RequestRejected(invalid, "prompt: is empty; give at least one character")
            try:
                _, ids = self.llm.llm.encode(request.prompt)
            except InvalidRequestError as e:
                raise RequestRejected(invalid, f"prompt: {e}") from None
        else:
            ids = list(request.prompt_token_ids.ids)
            if not ids:
                raise RequestRejected(invalid, "prompt_token_ids: is empty; give at least one token id")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestRejected(
                    invalid, f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size - 1}]"
                )
        if len(ids) > self.max_prompt_tokens:
            raise RequestRejected(
                invalid, f"prompt: has {len(ids)} tokens; this deployment accepts at most {self.max_prompt_tokens}"
            )
        max_tokens = request.max_tokens if request.HasField("max_tokens") else self.config.default_max_tokens
        if max_tokens > self.config.max_tokens:
            raise RequestRejected(
                invalid, f"max_tokens: {max_tokens} exceeds this deployment's cap of {self.config.max_tokens}"
            )
        mode = request.speculation
        if mode not in pb.SpeculationMode.values():
            names = ", ".join(pb.SpeculationMode.keys())
            raise RequestRejected(invalid, f"speculation: unknown mode {mode}; use one of {names}")
        if mode == pb.SPECULATION_MODE_ON and not self.has_drafter:
            raise RequestRejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "speculation: ON, but this deployment has no drafter; use DEFAULT or OFF",
            )
        stop_ids = list(request.stop_token_ids)
        bad = [t for t in stop_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejected(invalid, f"stop_token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size - 1}]")
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "stop": list(request.stop) or None,
            "stop_token_ids": stop_ids,
            "ignore_eos": request.ignore_eos,
            "speculative": mode != pb.SPECULATION_MODE_OFF,
        }
        for name in ("temperature", "top_p", "top_k", "seed"):
            if request.HasField(name):
                kwargs[name] = getattr(request, name)
        if request.HasField("max_speculative_tokens"):
            kwargs["num_speculative_tokens"] = request.max_speculative_tokens
        try:
            params = SamplingParams(**kwargs)
        except InvalidRequestError as e:
            raise RequestRejected(invalid, str(e)) from None
        return ids, params

    @staticmethod
    def to_response(out: Any, request_id: str, speculating: bool) -> pb.GenerateResponse:
        """One engine RequestOutput as a stream message (the last one carries the totals)."""
        msg = pb.GenerateResponse(request_id=request_id, token_ids=out.delta_token_ids, text=out.delta_text)
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


def _fail(grpc_context: RayServegRPCContext, code: grpc.StatusCode, details: str) -> None:
    grpc_context.set_code(code)
    grpc_context.set_details(details)


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
    """Serve options for the replica deployment: capacity from the engine's limits, then the
    config file's `deployments:` overrides (num_replicas, autoscaling_config, ...) on top."""
    options: dict[str, Any] = {
        "ray_actor_options": replica_resources(config),
        "max_ongoing_requests": config.max_num_seqs,
        "max_queued_requests": config.max_queued_requests,
        # Loading the target and drafter takes a while; a slow health check is not a dead replica.
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": 30,
    }
    for key, value in (overrides or {}).items():
        if key != "name":
            options[key] = value
    return options


def build_app(args: dict) -> Application:
    """Serve application builder (`import_path: deployments.app:build_app`): validate the args
    and bind the deployment. Serve applies a config file's `deployments:` overrides itself."""
    return bind_app(AppConfig.from_dict(args or {}))


def bind_app(config: AppConfig, overrides: dict | None = None) -> Application:
    """The bound deployment, sized from `config`, with `overrides` (deployment options as in a
    config file's `deployments:` entry: num_replicas, autoscaling_config, ...) applied on top."""
    deployment = serve.deployment(SpecDecodeServer, name=DEPLOYMENT_NAME)
    return deployment.options(**deployment_options(config, overrides)).bind(config)
