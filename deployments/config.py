"""The serving application's arguments (`applications[i].args` of serve_config.yaml), validated.

`AppConfig.from_dict(args, where)` refuses unknown fields and bad values with messages that name
the field, e.g. "applications[0].args.speculative.num_speculative_tokens: must be in [1, 16], got 0".
`validate_serve_config(config)` checks a whole Serve config file: Ray's own schema, each
deployment's autoscaling block, and our app's args. Defaults live here and only here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from engine.config import DRAFT_WEIGHTS, EXACT_MODES, QUANTIZATIONS, SPECULATIVE_METHODS

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_PATH = REPO_ROOT / "deployments" / "serve_config.yaml"
APP_IMPORT_PATH = "deployments.app:build_app"
DEPLOYMENT_NAME = "SpecDecode"  # the engine replicas: the pool that scales on the SLO
INGRESS_DEPLOYMENT_NAME = "SpecDecodeIngress"  # the gRPC methods, in front of the engine replicas
PREFILL_DEPLOYMENT_NAME = "SpecDecodePrefill"  # mode: disaggregated: the pool that prefills long prompts
DRAFTER_DEPLOYMENT_NAME = "SpecDrafter"  # speculative.placement: remote: the drafter pool
PLACEMENTS = ("colocated", "remote")  # where the drafter runs: in each engine replica, or its own pool
SLO_POLICY_PATH = "deployments.autoscaling:SLOAutoscalingPolicy"  # its policy_kwargs are checked here
SERVICER_FUNCTION = "deployments.servicer.add_SpecDecodeServicer_to_server"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
METHODS_WITH_MODEL = ("draft", "eagle", "eagle3", "medusa")  # eagle, medusa: no shipped head, `model` required
# mtp: `model` null (the MTP layers stored in the target's own checkpoint) or the target's directory
# Where `make serve` finds each drafter kind's shipped checkpoint when the config names none.
DEFAULT_DRAFTER_MODELS = {"draft": "models/drafter", "eagle3": "models/eagle3-head"}


class ConfigError(ValueError):
    """A config value is wrong; the message names every bad field (one per line)."""


class _Checker:
    """Collects `path: problem` messages while reading a mapping."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def fail(self, path: str, message: str) -> None:
        self.errors.append(f"{path}: {message}")

    def mapping(self, path: str, value: Any, allowed: list[str]) -> dict:
        if not isinstance(value, dict):
            self.fail(path, f"must be a mapping, got {_show(value)}")
            return {}
        for key in value:
            if key not in allowed:
                self.fail(f"{path}.{key}", f"unknown field; allowed fields: {', '.join(allowed)}")
        return value

    def integer(self, path: str, value: Any, lo: int, hi: int | None = None, optional: bool = False) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"must be an integer{' or null' if optional else ''}, got {_show(value)}")
            return None
        if value < lo or (hi is not None and value > hi):
            self.fail(path, f"must be in [{lo}, {hi}], got {value}" if hi is not None else f"must be >= {lo}, got {value}")
            return None
        return value

    def number(self, path: str, value: Any, lo: float, hi: float | None = None, optional: bool = False) -> Any:
        """A finite int or float in (lo, hi] (or None, when optional)."""
        if optional and value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            self.fail(path, f"must be a number, got {_show(value)}")
            return None
        if value <= lo or (hi is not None and value > hi):
            self.fail(path, f"must be in ({lo}, {hi}], got {value}" if hi is not None else f"must be > {lo}, got {value}")
            return None
        return float(value)

    def boolean(self, path: str, value: Any) -> Any:
        if not isinstance(value, bool):
            self.fail(path, f"must be true or false, got {_show(value)}")
            return None
        return value

    def string(self, path: str, value: Any, choices: tuple[str, ...] | None = None, optional: bool = False) -> Any:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value:
            self.fail(path, f"must be a non-empty string{' or null' if optional else ''}, got {_show(value)}")
            return None
        if choices is not None and value not in choices:
            self.fail(path, f"must be one of {', '.join(choices)}, got {value!r}")
            return None
        return value

    def raise_if_failed(self) -> None:
        if self.errors:
            raise ConfigError("\n".join(self.errors))


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})" if value is not None else "null"


@dataclass(frozen=True)
class DrafterArgs:
    """Who drafts (engine.SpeculativeConfig names). `model` is a checkpoint dir (none for ngram).
    placement: "colocated" (default: each engine replica holds its drafter) or "remote" (method
    "draft" only: the draft model runs in a drafter pool of its own, `SpecDrafter`, shared by the
    engine replicas; see DrafterPoolArgs and deployments/drafter.py)."""

    method: str = "draft"
    model: str | None = "models/drafter"
    num_speculative_tokens: int = 4
    adaptive: bool = True
    draft_vocab_size: int | None = None
    draft_weights: str = "auto"
    placement: str = "colocated"

    @classmethod
    def from_dict(cls, data: Any, where: str, check: _Checker) -> DrafterArgs | None:
        data = check.mapping(where, data, [f.name for f in fields(cls)])
        n = len(check.errors)
        method = check.string(f"{where}.method", data.get("method", cls.method), SPECULATIVE_METHODS)
        before = len(check.errors)
        model = check.string(f"{where}.model", data.get("model", DEFAULT_DRAFTER_MODELS.get(method)), optional=True)
        if len(check.errors) == before and method in METHODS_WITH_MODEL and model is None:
            check.fail(f"{where}.model", f"method {method!r} needs a checkpoint directory, got null")
        if len(check.errors) == before and method == "ngram" and model is not None:
            check.fail(f"{where}.model", f"must be null for method 'ngram' (n-gram lookup needs no model), got {model!r}")
        k = check.integer(f"{where}.num_speculative_tokens", data.get("num_speculative_tokens", cls.num_speculative_tokens), 1, 16)
        adaptive = check.boolean(f"{where}.adaptive", data.get("adaptive", cls.adaptive))
        before = len(check.errors)
        dv = check.integer(f"{where}.draft_vocab_size", data.get("draft_vocab_size"), 0, optional=True)
        if len(check.errors) == before and method == "ngram" and dv:
            check.fail(f"{where}.draft_vocab_size", f"does not apply to method 'ngram' (no LM head), got {dv}")
        if len(check.errors) == before and method == "eagle3" and dv:
            check.fail(f"{where}.draft_vocab_size",
                       f"does not apply to method 'eagle3' (the head's checkpoint fixes its draft vocabulary), got {dv}")
        before = len(check.errors)
        dw = check.string(f"{where}.draft_weights", data.get("draft_weights", cls.draft_weights), DRAFT_WEIGHTS)
        if len(check.errors) == before and dw in ("int8", "int4") and method != "eagle3":
            check.fail(f"{where}.draft_weights", f"{dw!r} applies to method 'eagle3' only, got method {method!r}")
        before = len(check.errors)
        placement = check.string(f"{where}.placement", data.get("placement", cls.placement), PLACEMENTS)
        if len(check.errors) == before and placement == "remote" and method != "draft":
            check.fail(f"{where}.placement", f"'remote' needs method 'draft' (a draft model drafts in the pool; "
                                             f"{method!r} reads the target's own state each step), got {method!r}")
        if len(check.errors) == before and placement == "remote" and dv:
            check.fail(f"{where}.draft_vocab_size", f"does not apply to placement 'remote' (the pool drafts over the "
                                                    f"whole vocabulary), got {dv}")
        if len(check.errors) > n:
            return None
        return cls(method=method, model=model, num_speculative_tokens=k, adaptive=adaptive, draft_vocab_size=dv,
                   draft_weights=dw, placement=placement)

    def to_engine(self, model_path: str | None) -> Any:
        from engine import SpeculativeConfig

        return SpeculativeConfig(
            method=self.method, model=model_path, num_speculative_tokens=self.num_speculative_tokens,
            adaptive=self.adaptive, draft_vocab_size=self.draft_vocab_size, draft_weights=self.draft_weights,
        )


MODES = ("colocated", "disaggregated")
HANDOFF_TRANSPORTS = ("auto", "object_store", "nixl")  # deployments/handoff_transport.py


@dataclass(frozen=True)
class DisaggregationArgs:
    """Prefill/decode disaggregation (`mode: disaggregated`). The ingress asks a decode replica
    where each prompt is prefilled (deployments/placement.py): prompts with fewer than
    `min_prompt_tokens` tokens outside the decode replica's prefix cache are prefilled there;
    longer ones go to the prefill pool unless the predicted time to first token says the decode
    replica is faster (the pool is saturated), and are then handed over (KV + drafter state) to
    the decode replica the router picks when the handoff is ready. A request waiting for the pool
    holds no decode replica's slot. `with_drafter_state: false` hands over the target's KV only
    (the decode side rebuilds the drafter's state; an ablation for the benchmark). `transport`
    moves the handoff (deployments/handoff_transport.py): auto, object_store or nixl.
    `pool_max_streams`: a prefill replica given a prompt while it has nothing else to prefill, and
    fewer streams than this, decodes the request itself (no handoff), as a co-located replica
    would (0, the default: it always hands over; measured in bench/bench_pd.py, its streams slow
    the pool's next prefills by more than they spare the decode replica)."""

    min_prompt_tokens: int = 256
    with_drafter_state: bool = True
    transport: str = "auto"
    pool_max_streams: int = 0

    @classmethod
    def from_dict(cls, data: Any, where: str, check: _Checker) -> DisaggregationArgs | None:
        data = check.mapping(where, data, [f.name for f in fields(cls)])
        n = len(check.errors)
        threshold = check.integer(f"{where}.min_prompt_tokens", data.get("min_prompt_tokens", cls.min_prompt_tokens), 1)
        with_state = check.boolean(f"{where}.with_drafter_state", data.get("with_drafter_state", cls.with_drafter_state))
        transport = check.string(f"{where}.transport", data.get("transport", cls.transport), HANDOFF_TRANSPORTS)
        pool_streams = check.integer(f"{where}.pool_max_streams", data.get("pool_max_streams", cls.pool_max_streams), 0)
        if len(check.errors) > n:
            return None
        return cls(min_prompt_tokens=threshold, with_drafter_state=with_state, transport=transport,
                   pool_max_streams=pool_streams)


@dataclass(frozen=True)
class SLOArgs:
    """The latency budgets the engine and the placement work to (null: none).
    tpot_ms: while streams decode, a prompt is prefilled beside them in chunks sized (from the
    engine's measured step cost) so that a step takes at most this long: no stream stalls for a
    whole prefill (Sarathi's stall-free batching), in every placement.
    ttft_ms: in disaggregated mode, long prompts go to the prefill pool while its predicted time
    to first token and the decode replica's are both within this; beyond it, to the faster one.
    The autoscaling policy's targets (its policy_kwargs) are set apart: they say when to add
    replicas, these how each replica schedules."""

    ttft_ms: float | None = 4000.0
    tpot_ms: float | None = 100.0

    @classmethod
    def from_dict(cls, data: Any, where: str, check: _Checker) -> SLOArgs | None:
        data = check.mapping(where, data, [f.name for f in fields(cls)])
        n = len(check.errors)
        ttft = check.number(f"{where}.ttft_ms", data.get("ttft_ms", cls.ttft_ms), 0.0, 3.6e6, optional=True)
        tpot = check.number(f"{where}.tpot_ms", data.get("tpot_ms", cls.tpot_ms), 0.0, 6e4, optional=True)
        if len(check.errors) > n:
            return None
        return cls(ttft_ms=ttft, tpot_ms=tpot)


@dataclass(frozen=True)
class DrafterPoolArgs:
    """The drafter pool (`speculative.placement: remote`, deployments/drafter.py): `SpecDrafter`
    replicas of `num_cpus` CPUs (or one GPU where the engine replicas take GPUs) with
    `torch_threads` matmul threads (null: as the engine's default), each holding the draft model
    and a KV cache of `kv_cache_memory_bytes` (null: 256 MiB) for its sessions, which it forgets
    after `session_ttl_s` idle. An engine replica waits at most `timeout_s` for a step's drafts
    (then that step has none; outputs never change). `draft_ahead`: between calls, draft the
    next round assuming every draft is accepted (engine/spec_decode/remote.py); off by default: on the
    2-core CPU host it made a round trip ~1 ms dearer and served 1.6% of the shipped draft
    model's rounds (bench/bench_remote_drafter.py). `max_batch_size` and
    `batch_wait_timeout_s`: how Serve batches the calls of several engine replicas into one round."""

    num_cpus: int = 1
    torch_threads: int | None = None
    kv_cache_memory_bytes: int | None = None
    session_ttl_s: float = 300.0
    timeout_s: float = 0.25
    draft_ahead: bool = False
    max_batch_size: int = 64
    batch_wait_timeout_s: float = 0.0

    @classmethod
    def from_dict(cls, data: Any, where: str, check: _Checker) -> DrafterPoolArgs | None:
        data = check.mapping(where, data, [f.name for f in fields(cls)])
        n = len(check.errors)
        values = {
            "num_cpus": check.integer(f"{where}.num_cpus", data.get("num_cpus", cls.num_cpus), 1, 1024),
            "torch_threads": check.integer(f"{where}.torch_threads", data.get("torch_threads"), 1, 1024, optional=True),
            "kv_cache_memory_bytes": check.integer(f"{where}.kv_cache_memory_bytes", data.get("kv_cache_memory_bytes"),
                                                   1, optional=True),
            "session_ttl_s": check.number(f"{where}.session_ttl_s", data.get("session_ttl_s", cls.session_ttl_s),
                                          0.0, 86400.0),
            "timeout_s": check.number(f"{where}.timeout_s", data.get("timeout_s", cls.timeout_s), 0.0, 60.0),
            "draft_ahead": check.boolean(f"{where}.draft_ahead", data.get("draft_ahead", cls.draft_ahead)),
            "max_batch_size": check.integer(f"{where}.max_batch_size", data.get("max_batch_size", cls.max_batch_size),
                                            1, 4096),
        }
        wait = data.get("batch_wait_timeout_s", cls.batch_wait_timeout_s)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 1:
            check.fail(f"{where}.batch_wait_timeout_s", f"must be a number in [0, 1], got {_show(wait)}")
        if len(check.errors) > n:
            return None
        return cls(batch_wait_timeout_s=float(wait), **values)


TRACE_EXPORTERS = ("file", "otlp", "console", "none")


@dataclass(frozen=True)
class TracingArgs:
    """Request tracing (deployments/tracing.py); a `tracing:` block turns it on. Null fields fall
    back to the OpenTelemetry variables: exporter to OTEL_TRACES_EXPORTER (else "file"),
    sampling_ratio to OTEL_TRACES_SAMPLER[_ARG], file to SPECDECODE_TRACES_FILE (else
    traces/spans.jsonl). Without the block, OTEL_TRACES_EXPORTER alone decides (unset: off)."""

    exporter: str | None = None
    file: str | None = None
    sampling_ratio: float | None = None

    @classmethod
    def from_dict(cls, data: Any, where: str, check: _Checker) -> TracingArgs | None:
        data = check.mapping(where, data, [f.name for f in fields(cls)])
        n = len(check.errors)
        exporter = check.string(f"{where}.exporter", data.get("exporter"), TRACE_EXPORTERS, optional=True)
        file = check.string(f"{where}.file", data.get("file"), optional=True)
        ratio = data.get("sampling_ratio")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1):
            check.fail(f"{where}.sampling_ratio", f"must be a number in [0, 1] or null, got {_show(ratio)}")
        if len(check.errors) > n:
            return None
        return cls(exporter=exporter, file=file, sampling_ratio=None if ratio is None else float(ratio))


@dataclass(frozen=True)
class AppConfig:
    """Everything one replica needs: models, engine sizing, request limits, replica resources.

    model: a checkpoint directory or a GGUF file; served_model_name: its name in the APIs (the
    OpenAI `model` field, ModelInfo.model; None: `model` as written).

    max_prompt_tokens None: the engine's max_model_len - 1. max_tokens caps a request's
    max_tokens; default_max_tokens applies when a request leaves it unset. max_num_seqs is also
    the replica's `max_ongoing_requests` and max_queued_requests the Serve queue in front of it,
    so a full deployment refuses (RESOURCE_EXHAUSTED) instead of queueing forever. num_cpus is
    what a replica asks Ray for on a host without GPUs. torch_threads is the engine's CPU matmul
    thread count; None picks `default_torch_threads`: num_cpus, but one core fewer when the
    replica would otherwise take every core the process may use (then the Serve proxy and the
    gRPC stream preempt a matmul thread each step: measured +61% time per output token on a
    2-core host with 2 threads, +12% with 1). exact: the engine's `exact` mode (speculation that
    never changes greedy output; engine/model_runner.py). quantization: the engine's ("auto": a
    GGUF file's Q4_0/Q4_1/Q8_0 matrices served as stored on a CPU unless dtype is float32; "none":
    dequantized). cuda_graphs: the engine's (on a GPU, its small steps replay captured CUDA
    graphs; false runs them eagerly).
    metrics_window_s is the window of the p95 TTFT/TPOT each replica reports to the SLO
    autoscaling policy (deployments/autoscaling.py; the SLO targets are its policy_kwargs).
    drafter_pool: the drafter pool's settings where `speculative.placement` is "remote"
    (DrafterPoolArgs).
    replica_wait_timeout_s bounds how long the ingress waits for an engine replica to accept a
    request (none is running, or all are full and Serve queues it) before answering UNAVAILABLE.
    drain_timeout_s: how long an engine replica that Serve is removing (a downscale, a redeploy)
    lets its running streams go on before it hands them over to another replica, which resumes
    them after the tokens already sent (deployments/drain.py); cut to the deployment's
    graceful_shutdown_timeout_s less 2 s, so that the handover comes before Serve's kill.
    mode: "colocated" (each engine replica prefills and decodes its requests) or "disaggregated"
    (a prefill pool, `SpecDecodePrefill`, prefills long prompts and hands them to the decode
    replicas, `SpecDecode`; see DisaggregationArgs). Both pools use this config's engine settings.
    slo: the TTFT and TPOT budgets each replica schedules to (SLOArgs).
    """

    model: str = "models/target"
    served_model_name: str | None = None
    tokenizer: str | None = None
    speculative: DrafterArgs | None = field(default_factory=DrafterArgs)
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 16
    max_model_len: int | None = None
    max_prompt_tokens: int | None = None
    max_tokens: int = 1024
    default_max_tokens: int = 128
    kv_cache_memory_bytes: int | None = None
    max_queued_requests: int = 64
    num_cpus: int = 2
    torch_threads: int | None = None
    exact: str = "auto"
    quantization: str = "auto"
    cuda_graphs: bool = True
    metrics_window_s: float = 30.0
    replica_wait_timeout_s: float = 30.0
    drain_timeout_s: float = 10.0
    mode: str = "colocated"
    disaggregation: DisaggregationArgs = field(default_factory=DisaggregationArgs)
    slo: SLOArgs = field(default_factory=SLOArgs)
    drafter_pool: DrafterPoolArgs = field(default_factory=DrafterPoolArgs)
    tracing: TracingArgs | None = None

    @classmethod
    def from_dict(cls, data: Any, where: str = "args") -> AppConfig:
        """Validate `data` (the app's args mapping); raise ConfigError naming every bad field."""
        check = _Checker()
        data = check.mapping(where, data if data is not None else {}, [f.name for f in fields(cls)])
        d = cls()
        values: dict[str, Any] = {
            "model": check.string(f"{where}.model", data.get("model", d.model)),
            "served_model_name": check.string(f"{where}.served_model_name", data.get("served_model_name"),
                                              optional=True),
            "tokenizer": check.string(f"{where}.tokenizer", data.get("tokenizer"), optional=True),
            "device": check.string(f"{where}.device", data.get("device", d.device), DEVICES),
            "dtype": check.string(f"{where}.dtype", data.get("dtype", d.dtype), DTYPES),
            "max_num_seqs": check.integer(f"{where}.max_num_seqs", data.get("max_num_seqs", d.max_num_seqs), 1, 4096),
            "max_model_len": check.integer(f"{where}.max_model_len", data.get("max_model_len"), 2, optional=True),
            "max_prompt_tokens": check.integer(f"{where}.max_prompt_tokens", data.get("max_prompt_tokens"), 1, optional=True),
            "max_tokens": check.integer(f"{where}.max_tokens", data.get("max_tokens", d.max_tokens), 1),
            "default_max_tokens": check.integer(
                f"{where}.default_max_tokens", data.get("default_max_tokens", d.default_max_tokens), 1
            ),
            "kv_cache_memory_bytes": check.integer(
                f"{where}.kv_cache_memory_bytes", data.get("kv_cache_memory_bytes"), 1, optional=True
            ),
            "max_queued_requests": check.integer(
                f"{where}.max_queued_requests", data.get("max_queued_requests", d.max_queued_requests), 0
            ),
            "num_cpus": check.integer(f"{where}.num_cpus", data.get("num_cpus", d.num_cpus), 1, 1024),
            "torch_threads": check.integer(f"{where}.torch_threads", data.get("torch_threads"), 1, 1024, optional=True),
            "exact": check.string(f"{where}.exact", data.get("exact", d.exact), EXACT_MODES),
            "quantization": check.string(
                f"{where}.quantization", data.get("quantization", d.quantization), QUANTIZATIONS
            ),
            "cuda_graphs": check.boolean(f"{where}.cuda_graphs", data.get("cuda_graphs", d.cuda_graphs)),
            "metrics_window_s": check.number(
                f"{where}.metrics_window_s", data.get("metrics_window_s", d.metrics_window_s), 0.0, 3600.0
            ),
            "mode": check.string(f"{where}.mode", data.get("mode", d.mode), MODES),
            "replica_wait_timeout_s": check.number(
                f"{where}.replica_wait_timeout_s", data.get("replica_wait_timeout_s", d.replica_wait_timeout_s),
                0.1, 3600.0,
            ),
            "drain_timeout_s": check.number(
                f"{where}.drain_timeout_s", data.get("drain_timeout_s", d.drain_timeout_s), 0.0, 3600.0
            ),
        }
        if "speculative" in data and data["speculative"] is None:
            values["speculative"] = None
        else:
            values["speculative"] = DrafterArgs.from_dict(data.get("speculative", {}), f"{where}.speculative", check)
        tracing = data.get("tracing")
        values["tracing"] = None if tracing is None else TracingArgs.from_dict(tracing, f"{where}.tracing", check)
        values["disaggregation"] = DisaggregationArgs.from_dict(
            data.get("disaggregation") or {}, f"{where}.disaggregation", check)
        values["slo"] = SLOArgs.from_dict(data.get("slo") or {}, f"{where}.slo", check)
        values["drafter_pool"] = DrafterPoolArgs.from_dict(data.get("drafter_pool") or {}, f"{where}.drafter_pool", check)
        v = values
        if v["max_model_len"] and v["max_prompt_tokens"] and v["max_prompt_tokens"] >= v["max_model_len"]:
            check.fail(
                f"{where}.max_prompt_tokens",
                f"must be < max_model_len ({v['max_model_len']}) to leave room for output, got {v['max_prompt_tokens']}",
            )
        if v["max_tokens"] and v["default_max_tokens"] and v["default_max_tokens"] > v["max_tokens"]:
            check.fail(
                f"{where}.default_max_tokens",
                f"must be <= max_tokens ({v['max_tokens']}), got {v['default_max_tokens']}",
            )
        check.raise_if_failed()
        return cls(**values)

    @property
    def model_id(self) -> str:
        """The model's name in the APIs (OpenAI `model`, ModelInfo.model): served_model_name, or
        the checkpoint's path as configured."""
        return self.served_model_name or self.model

    def to_dict(self) -> dict:
        """The args mapping this config came from (round-trips through from_dict)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.speculative is not None:
            out["speculative"] = {f.name: getattr(self.speculative, f.name) for f in fields(self.speculative)}
        if self.tracing is not None:
            out["tracing"] = {f.name: getattr(self.tracing, f.name) for f in fields(self.tracing)}
        out["disaggregation"] = {f.name: getattr(self.disaggregation, f.name) for f in fields(self.disaggregation)}
        out["slo"] = {f.name: getattr(self.slo, f.name) for f in fields(self.slo)}
        out["drafter_pool"] = {f.name: getattr(self.drafter_pool, f.name) for f in fields(self.drafter_pool)}
        return out

    def engine_kwargs(self) -> dict:
        """Keyword arguments for engine.AsyncLLM (paths resolved against the repository root)."""
        spec = self.speculative
        return {
            "device": self.device,
            "dtype": self.dtype,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "tokenizer": resolve_path(self.tokenizer) if self.tokenizer else None,
            "speculative": spec.to_engine(resolve_path(spec.model) if spec.model else None) if spec else None,
            # Serve admits at most max_num_seqs per replica, but its limits are approximate under
            # bursts; the engine refuses (RESOURCE_EXHAUSTED) rather than queue without bound.
            "max_waiting_requests": self.max_num_seqs + self.max_queued_requests,
            "num_threads": self.torch_threads or default_torch_threads(self.num_cpus),
            "exact": self.exact,
            "quantization": self.quantization,
            "cuda_graphs": self.cuda_graphs,
            "decode_step_budget_s": self.slo.tpot_ms / 1e3 if self.slo.tpot_ms else None,
        }


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (a
    Kubernetes pod's CPU limit) when there is one."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


def default_torch_threads(num_cpus: int, cpus: int | None = None) -> int:
    """num_cpus, but leave one core to the Serve proxy and gRPC when the replica would take all
    of them. Examples: num_cpus 2 on a 2-core host or pod -> 1; num_cpus 2 on 16 cores -> 2."""
    cpus = available_cpus() if cpus is None else cpus
    return max(1, min(num_cpus, cpus - 1)) if num_cpus >= cpus else num_cpus


def resolve_path(path: str) -> str:
    """An absolute path: as given, else relative to the working directory if it exists there,
    else relative to the repository root (Ray workers may not share the driver's cwd)."""
    if os.path.isabs(path):
        return path
    if os.path.exists(path):
        return os.path.abspath(path)
    return str(REPO_ROOT / path)


def missing_models(config: AppConfig) -> list[str]:
    """Checkpoints the config names that are not there: a GGUF file that does not exist, a
    directory without config.json."""

    def present(path: str) -> bool:
        path = resolve_path(path)
        return os.path.isfile(path) if path.endswith(".gguf") else os.path.isfile(os.path.join(path, "config.json"))

    paths = [config.model]
    if config.speculative is not None and config.speculative.model:
        paths.append(config.speculative.model)
    return [p for p in paths if not present(p)]


def load_serve_config(path: str | os.PathLike = DEFAULT_CONFIG_PATH) -> dict:
    with open(path) as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: must be a mapping (a Serve config file), got {type(config).__name__}")
    return config


def validate_serve_config(config: dict) -> dict[str, AppConfig]:
    """Check a Serve config file's contents; return {app name: AppConfig} for our applications.

    Ray's ServeDeploySchema accepts unknown keys and e.g. min_replicas > max_replicas, so each
    deployment's autoscaling block is also built as an AutoscalingConfig.
    """
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    try:
        schema = ServeDeploySchema.model_validate(config)
    except ValidationError as e:
        raise ConfigError(_pydantic_errors(e, "")) from None
    check = _Checker()
    servicers = schema.grpc_options.grpc_servicer_functions
    if SERVICER_FUNCTION not in servicers:
        check.fail("grpc_options.grpc_servicer_functions", f"must include {SERVICER_FUNCTION}, got {servicers}")
    apps: dict[str, AppConfig] = {}
    for i, app in enumerate(config.get("applications") or []):
        for j, deployment in enumerate(app.get("deployments") or []):
            block = deployment.get("autoscaling_config")
            if block is None:
                continue
            where = f"applications[{i}].deployments[{j}].autoscaling_config"
            check.mapping(where, block, list(AutoscalingConfig.model_fields))
            try:
                AutoscalingConfig(**block)
            except ValidationError as e:
                check.errors.extend(_pydantic_errors(e, where).splitlines())
            except (ValueError, TypeError) as e:
                check.fail(where, str(e))
            policy = block.get("policy") if isinstance(block, dict) else None
            if isinstance(policy, dict) and policy.get("policy_function") == SLO_POLICY_PATH:
                from deployments.autoscaling import SLOPolicyConfig

                check.errors.extend(SLOPolicyConfig.check(policy.get("policy_kwargs") or {}, f"{where}.policy.policy_kwargs"))
        if app.get("import_path") != APP_IMPORT_PATH:
            continue
        for j, deployment in enumerate(app.get("deployments") or []):
            if deployment.get("name") not in (DEPLOYMENT_NAME, INGRESS_DEPLOYMENT_NAME, PREFILL_DEPLOYMENT_NAME,
                                              DRAFTER_DEPLOYMENT_NAME):
                check.fail(
                    f"applications[{i}].deployments[{j}].name",
                    f"this app's deployments are {DEPLOYMENT_NAME!r} (engine replicas; the decode pool in "
                    f"disaggregated mode), {INGRESS_DEPLOYMENT_NAME!r} (gRPC ingress), "
                    f"{PREFILL_DEPLOYMENT_NAME!r} (prefill pool, disaggregated mode) and {DRAFTER_DEPLOYMENT_NAME!r} "
                    f"(drafter pool, speculative.placement: remote); got {deployment.get('name')!r}",
                )
        try:
            apps[app.get("name", "default")] = AppConfig.from_dict(app.get("args"), f"applications[{i}].args")
        except ConfigError as e:
            check.errors.extend(str(e).splitlines())
    check.raise_if_failed()
    return apps


def _pydantic_errors(e: Any, prefix: str) -> str:
    lines = []
    for err in e.errors():
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        path = (prefix + loc).lstrip(".") or "(top level)"
        lines.append(f"{path}: {err['msg']}")
    return "\n".join(lines)
