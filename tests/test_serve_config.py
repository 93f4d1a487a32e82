"""The shipped Serve config parses with Ray's schemas, its import paths resolve, and the app-arg
validator refuses bad or unknown fields with messages naming the field. No Ray cluster needed."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from deployments.config import (
    DEFAULT_CONFIG_PATH,
    AppConfig,
    ConfigError,
    load_serve_config,
    validate_serve_config,
)

SHIPPED = load_serve_config(DEFAULT_CONFIG_PATH)
SMOLLM2 = "models/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # `make fetch`


def test_shipped_config_parses_with_ray_schema() -> None:
    schema = ServeDeploySchema.model_validate(SHIPPED)
    assert schema.grpc_options.port == 9000
    assert schema.grpc_options.enable_reflection
    assert len(schema.applications) == 1
    for app in SHIPPED["applications"]:
        for deployment in app.get("deployments") or []:
            if deployment.get("autoscaling_config") is not None:
                AutoscalingConfig(**deployment["autoscaling_config"])


def test_shipped_config_passes_our_validator() -> None:
    apps = validate_serve_config(SHIPPED)
    (config,) = apps.values()
    assert config.model == SMOLLM2 and config.model_id == "SmolLM2-135M-Instruct"
    assert AppConfig.from_dict({"model": "models/target"}).model_id == "models/target"
    with pytest.raises(ConfigError, match="served_model_name"):
        AppConfig.from_dict({"served_model_name": 7})
    assert config.speculative is not None
    assert (config.speculative.method, config.speculative.model, config.speculative.num_speculative_tokens) == (
        "ngram", None, 4,
    )
    code = validate_serve_config(load_serve_config(DEFAULT_CONFIG_PATH.parent / "serve_config_code.yaml"))
    (code,) = code.values()
    assert (code.model, code.speculative.method, code.speculative.model) == ("models/target", "eagle3", "models/eagle3-head")


def test_import_paths_resolve() -> None:
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.config import gRPCOptions

    grpc_options = gRPCOptions(**SHIPPED["grpc_options"])
    assert len(grpc_options.grpc_servicer_func_callable) == len(SHIPPED["grpc_options"]["grpc_servicer_functions"]) == 2
    for app in SHIPPED["applications"]:
        builder = import_attr(app["import_path"])
        # What `serve run` does with the import path: one-parameter builder returning an Application.
        built = call_user_app_builder_with_args_if_necessary(builder, app["args"])
        ingress = built._bound_deployment
        deployment = ingress.init_args[0]._bound_deployment  # the engine replicas behind the ingress
        names = {d["name"] for d in app["deployments"]}
        assert {ingress.name, deployment.name} == names == {"SpecDecodeIngress", "SpecDecode"}
        assert ingress.ray_actor_options == {"num_cpus": 0}
        assert deployment.max_ongoing_requests == app["args"]["max_num_seqs"]
        assert deployment._deployment_config.max_queued_requests == app["args"]["max_queued_requests"]
        assert deployment.ray_actor_options["num_cpus"] == app["args"]["num_cpus"]  # Ray is not running
        assert "num_gpus" not in deployment.ray_actor_options


def test_deployment_overrides_are_applied() -> None:
    from deployments.app import bind_app

    overrides = {"name": "SpecDecode", "autoscaling_config": {"min_replicas": 1, "max_replicas": 3},
                 "ray_actor_options": {"num_gpus": 1}, "max_queued_requests": 5}
    ingress = bind_app(AppConfig(), overrides, {"num_replicas": 3})._bound_deployment
    assert ingress._deployment_config.num_replicas == 3
    deployment = ingress.init_args[0]._bound_deployment
    assert deployment.ray_actor_options["num_gpus"] == 1
    assert deployment._deployment_config.max_queued_requests == 5
    assert deployment._deployment_config.autoscaling_config.max_replicas == 3


def test_defaults_round_trip() -> None:
    config = AppConfig.from_dict(SHIPPED["applications"][0]["args"])
    assert AppConfig.from_dict(config.to_dict()) == config
    assert AppConfig.from_dict({}) == AppConfig()
    assert AppConfig.from_dict({"speculative": None}).speculative is None
    ngram = AppConfig.from_dict({"speculative": {"method": "ngram"}}).speculative
    assert ngram is not None and ngram.model is None
    eagle3 = AppConfig.from_dict({"speculative": {"method": "eagle3"}}).speculative
    assert eagle3 is not None and eagle3.model == "models/eagle3-head"
    with pytest.raises(ConfigError, match="method 'eagle' needs a checkpoint directory"):
        AppConfig.from_dict({"speculative": {"method": "eagle"}})  # no EAGLE-1 head is shipped


def with_args(**changes) -> dict:
    config = copy.deepcopy(SHIPPED)
    args = config["applications"][0]["args"]
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        target = args
        for p in parents:
            target = target[p]
        target[leaf] = value
    return config


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"speculative__num_speculative_tokens": 0},
         "applications[0].args.speculative.num_speculative_tokens: must be in [1, 16], got 0"),
        ({"speculative__num_speculative_tokens": 17}, "applications[0].args.speculative.num_speculative_tokens"),
        ({"speculative__method": "lookahead"}, "applications[0].args.speculative.method: must be one of"),
        ({"speculative__method": "ngram", "speculative__model": "models/drafter"},
         "applications[0].args.speculative.model: must be null for method 'ngram'"),
        ({"speculative__method": "eagle", "speculative__model": None},
         "applications[0].args.speculative.model: method 'eagle' needs"),
        ({"speculative__method": "eagle3", "speculative__model": None},
         "applications[0].args.speculative.model: method 'eagle3' needs a checkpoint directory"),
        ({"speculative__method": "eagle3", "speculative__draft_vocab_size": 1024},
         "applications[0].args.speculative.draft_vocab_size: does not apply to method 'eagle3'"),
        ({"speculative__adaptive": "yes"}, "applications[0].args.speculative.adaptive: must be true or false"),
        ({"speculative__draft_weights": "fp8"}, "applications[0].args.speculative.draft_weights: must be one of"),
        ({"speculative__method": "draft", "speculative__model": "models/drafter", "speculative__draft_weights": "int8"},
         "applications[0].args.speculative.draft_weights: 'int8' applies to method 'eagle3' only"),
        ({"speculative__draft_vocab_size": -1},
         "applications[0].args.speculative.draft_vocab_size: must be >= 0, got -1"),
        ({"speculative__draft_vocab_size": "2k"}, "applications[0].args.speculative.draft_vocab_size: must be an integer"),
        ({"speculative__temperature": 1}, "applications[0].args.speculative.temperature: unknown field"),
        ({"max_batch": 8}, "applications[0].args.max_batch: unknown field"),
        ({"max_num_seqs": 0}, "applications[0].args.max_num_seqs: must be in [1, 4096], got 0"),
        ({"max_num_seqs": "16"}, "applications[0].args.max_num_seqs: must be an integer"),
        ({"max_num_seqs": True}, "applications[0].args.max_num_seqs: must be an integer"),
        ({"device": "tpu"}, "applications[0].args.device: must be one of auto, cpu, cuda, got 'tpu'"),
        ({"dtype": "fp8"}, "applications[0].args.dtype: must be one of"),
        ({"model": ""}, "applications[0].args.model: must be a non-empty string"),
        ({"max_tokens": 0}, "applications[0].args.max_tokens: must be >= 1, got 0"),
        ({"default_max_tokens": 2000}, "applications[0].args.default_max_tokens: must be <= max_tokens (1024)"),
        ({"max_model_len": 256, "max_prompt_tokens": 300}, "applications[0].args.max_prompt_tokens: must be <"),
        ({"kv_cache_memory_bytes": -1}, "applications[0].args.kv_cache_memory_bytes: must be >= 1"),
        ({"max_queued_requests": -2}, "applications[0].args.max_queued_requests: must be >= 0"),
        ({"torch_threads": 0}, "applications[0].args.torch_threads: must be in [1, 1024], got 0"),
        ({"torch_threads": "4"}, "applications[0].args.torch_threads: must be an integer or null"),
        ({"cuda_graphs": "no"}, "applications[0].args.cuda_graphs: must be true or false"),
    ],
)
def test_validator_names_the_bad_field(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_serve_config(with_args(**changes))
    assert message in str(info.value)


def test_validator_reports_every_bad_field_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        validate_serve_config(with_args(max_num_seqs=0, device="tpu"))
    assert "max_num_seqs" in str(info.value) and "device" in str(info.value)


def test_validator_checks_autoscaling_blocks_and_servicer() -> None:
    config = copy.deepcopy(SHIPPED)
    del config["applications"][0]["deployments"][0]["num_replicas"]
    config["applications"][0]["deployments"][0]["autoscaling_config"] = {"min_replicas": 4, "max_replicas": 2, "x": 1}
    with pytest.raises(ConfigError) as info:
        validate_serve_config(config)
    assert "applications[0].deployments[0].autoscaling_config: Value error, max_replicas (2)" in str(info.value)
    assert "applications[0].deployments[0].autoscaling_config.x: unknown field" in str(info.value)
    config = copy.deepcopy(SHIPPED)
    config["grpc_options"]["grpc_servicer_functions"] = []
    with pytest.raises(ConfigError, match="grpc_options.grpc_servicer_functions"):
        validate_serve_config(config)
    config = copy.deepcopy(SHIPPED)
    config["applications"][0]["deployments"][0]["name"] = "Other"
    with pytest.raises(ConfigError, match=r"applications\[0\]\.deployments\[0\]\.name"):
        validate_serve_config(config)


def test_build_app_refuses_bad_args_naming_the_field() -> None:
    from deployments.app import build_app

    with pytest.raises(ConfigError, match=r"args\.speculative\.num_speculative_tokens: must be in \[1, 16\], got 0"):
        build_app({"speculative": {"num_speculative_tokens": 0}})


def test_serve_flags_override_the_config() -> None:
    from deployments.serve import apply_flags, parse_args

    config = apply_flags(SHIPPED, parse_args(["--port", "9100", "--method", "ngram", "-k", "6", "--device", "cpu"]))
    args = config["applications"][0]["args"]
    assert config["grpc_options"]["port"] == 9100
    assert args["speculative"]["method"] == "ngram" and args["speculative"]["model"] is None
    assert args["speculative"]["num_speculative_tokens"] == 6 and args["device"] == "cpu"
    validate_serve_config(config)
    config = apply_flags(SHIPPED, parse_args(["--no-speculation", "--model", "/x"]))
    assert config["applications"][0]["args"]["speculative"] is None
    assert SHIPPED["applications"][0]["args"]["model"] == SMOLLM2  # not mutated


def test_serve_says_how_to_train_missing_models(tmp_path: Path, capsys) -> None:
    from deployments.serve import main

    rc = main(["--model", str(tmp_path / "nope"), "--no-speculation"])
    err = capsys.readouterr().err
    assert rc == 2 and "model not found" in err and "nope" in err
    rc = main(["--drafter", str(tmp_path / "nodrafter"), "--model", str(tmp_path / "nope2")])
    assert rc == 2 and "nodrafter" in capsys.readouterr().err


def test_serve_refuses_a_bad_flag_value(capsys) -> None:
    from deployments.serve import main

    assert main(["-k", "0"]) == 2
    assert "applications[0].args.speculative.num_speculative_tokens: must be in [1, 16], got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("num_cpus", "cpus", "threads"), [(2, 2, 1), (1, 2, 1), (1, 1, 1), (4, 4, 3), (2, 16, 2), (8, 4, 3)])
def test_default_torch_threads_leave_the_proxy_a_core(num_cpus: int, cpus: int, threads: int) -> None:
    from deployments.config import default_torch_threads

    assert default_torch_threads(num_cpus, cpus) == threads


def test_engine_threads_follow_the_config() -> None:
    from deployments.config import available_cpus, default_torch_threads

    assert AppConfig.from_dict({"torch_threads": 3}).engine_kwargs()["num_threads"] == 3
    assert AppConfig.from_dict({"num_cpus": 2}).engine_kwargs()["num_threads"] == default_torch_threads(2)
    assert 1 <= available_cpus() <= (os.cpu_count() or 1)


def test_cuda_graphs_reach_the_engine() -> None:
    assert AppConfig.from_dict({}).engine_kwargs()["cuda_graphs"] is True
    assert AppConfig.from_dict({"cuda_graphs": False}).engine_kwargs()["cuda_graphs"] is False


def test_replica_wait_timeout_is_validated() -> None:
    assert AppConfig.from_dict({"replica_wait_timeout_s": 5}).replica_wait_timeout_s == 5.0
    for bad in (0, -1, float("inf"), "10", None):
        with pytest.raises(ConfigError, match="replica_wait_timeout_s"):
            AppConfig.from_dict({"replica_wait_timeout_s": bad})


def test_disaggregated_config_validates_and_builds_both_pools() -> None:
    """deployments/serve_config_pd.yaml (`make serve-pd`): the same service with a prefill pool."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from deployments.config import DEFAULT_CONFIG_PATH, load_serve_config, validate_serve_config

    pd = load_serve_config(DEFAULT_CONFIG_PATH.parent / "serve_config_pd.yaml")
    [(_, config)] = validate_serve_config(pd).items()
    assert config.mode == "disaggregated" and config.disaggregation.min_prompt_tokens == 256
    app = pd["applications"][0]
    assert {d["name"] for d in app["deployments"]} == {"SpecDecode", "SpecDecodePrefill", "SpecDecodeIngress"}
    built = call_user_app_builder_with_args_if_necessary(import_attr(app["import_path"]), app["args"])
    ingress = built._bound_deployment
    decode, prefill = ingress.init_args[0]._bound_deployment, ingress.init_args[2]._bound_deployment
    assert (decode.name, prefill.name) == ("SpecDecode", "SpecDecodePrefill")
    assert decode.ray_actor_options["num_cpus"] == prefill.ray_actor_options["num_cpus"] == 1
    # Apart from the mode and sizing, it is the shipped config.
    base = SHIPPED["applications"][0]["args"]
    differs = {k for k in set(base) | set(app["args"]) if base.get(k) != app["args"].get(k)}
    assert differs == {"mode", "disaggregation", "num_cpus"}


def test_disaggregation_args_are_validated() -> None:
    assert AppConfig.from_dict({"mode": "disaggregated"}).disaggregation.min_prompt_tokens == 256
    with pytest.raises(ConfigError, match="mode"):
        AppConfig.from_dict({"mode": "split"})
    with pytest.raises(ConfigError, match="min_prompt_tokens"):
        AppConfig.from_dict({"disaggregation": {"min_prompt_tokens": 0}})
    with pytest.raises(ConfigError, match="disaggregation.bogus"):
        AppConfig.from_dict({"disaggregation": {"bogus": 1}})
    with pytest.raises(ConfigError, match="disaggregation.max_inflight_prefills"):  # replaced by slo.ttft_ms
        AppConfig.from_dict({"disaggregation": {"max_inflight_prefills": 1}})
    assert AppConfig.from_dict({"disaggregation": {"pool_max_streams": 2}}).disaggregation.pool_max_streams == 2
    for bad in (-1, 1.5, "two", True):
        with pytest.raises(ConfigError, match="disaggregation.pool_max_streams"):
            AppConfig.from_dict({"disaggregation": {"pool_max_streams": bad}})


def test_slo_budgets_are_validated_and_reach_the_engine() -> None:
    """slo.tpot_ms becomes the engine's step budget for stall-free chunked prefill (null: none);
    slo.ttft_ms is the placement's budget; both positive numbers or null."""
    default = AppConfig.from_dict({})
    assert (default.slo.ttft_ms, default.slo.tpot_ms) == (4000.0, 100.0)
    assert default.engine_kwargs()["decode_step_budget_s"] == pytest.approx(0.1)
    off = AppConfig.from_dict({"slo": {"tpot_ms": None, "ttft_ms": None}})
    assert off.engine_kwargs()["decode_step_budget_s"] is None and off.slo.ttft_ms is None
    assert AppConfig.from_dict(off.to_dict()) == off
    with pytest.raises(ConfigError, match=r"slo.tpot_ms: must be in \(0.0, 60000.0\], got -5"):
        AppConfig.from_dict({"slo": {"tpot_ms": -5}})
    with pytest.raises(ConfigError, match=r"slo.ttft_ms: must be a number, got 'fast'"):
        AppConfig.from_dict({"slo": {"ttft_ms": "fast"}})
    with pytest.raises(ConfigError, match="slo.p99"):
        AppConfig.from_dict({"slo": {"p99": 1}})


def test_drafter_pool_config_validates_and_builds_the_pool() -> None:
    """deployments/serve_config_drafter.yaml (`make serve-drafter`): the same service with the
    draft model in a drafter pool (`SpecDrafter`) that the engine replicas are bound over."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from deployments.config import DEFAULT_CONFIG_PATH, load_serve_config, validate_serve_config

    raw = load_serve_config(DEFAULT_CONFIG_PATH.parent / "serve_config_drafter.yaml")
    [(_, config)] = validate_serve_config(raw).items()
    assert config.speculative.placement == "remote" and config.speculative.method == "draft"
    assert not config.drafter_pool.draft_ahead and config.drafter_pool.timeout_s == 0.25
    app = raw["applications"][0]
    assert {d["name"] for d in app["deployments"]} == {"SpecDecode", "SpecDrafter", "SpecDecodeIngress"}
    built = call_user_app_builder_with_args_if_necessary(import_attr(app["import_path"]), app["args"])
    engine = built._bound_deployment.init_args[0]._bound_deployment
    pool = engine.init_kwargs["drafter_pool"]._bound_deployment
    assert (engine.name, pool.name) == ("SpecDecode", "SpecDrafter")
    assert pool.ray_actor_options["num_cpus"] == 1
    assert "consistent_hash_router" in pool._deployment_config.request_router_config.request_router_class
    # co-located configs bind no pool
    shipped = SHIPPED["applications"][0]
    base = call_user_app_builder_with_args_if_necessary(import_attr(shipped["import_path"]), shipped["args"])
    assert "drafter_pool" not in base._bound_deployment.init_args[0]._bound_deployment.init_kwargs


def test_drafter_pool_args_are_validated() -> None:
    assert AppConfig.from_dict({}).speculative.placement == "colocated"
    with pytest.raises(ConfigError, match=r"speculative.placement: 'remote' needs method 'draft'"):
        AppConfig.from_dict({"speculative": {"method": "eagle3", "model": "models/eagle3-head", "placement": "remote"}})
    with pytest.raises(ConfigError, match=r"speculative.placement: must be one of"):
        AppConfig.from_dict({"speculative": {"placement": "elsewhere"}})
    with pytest.raises(ConfigError, match=r"drafter_pool.timeout_s: must be in \(0.0, 60.0\]"):
        AppConfig.from_dict({"drafter_pool": {"timeout_s": 0}})
    with pytest.raises(ConfigError, match=r"drafter_pool.batch_wait_timeout_s"):
        AppConfig.from_dict({"drafter_pool": {"batch_wait_timeout_s": -1}})
    with pytest.raises(ConfigError, match=r"drafter_pool.bogus"):
        AppConfig.from_dict({"drafter_pool": {"bogus": 1}})
    config = AppConfig.from_dict({"speculative": {"placement": "remote"}, "drafter_pool": {"num_cpus": 2}})
    assert AppConfig.from_dict(config.to_dict()) == config
