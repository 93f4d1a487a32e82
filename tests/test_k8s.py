"""Offline checks of the Kubernetes deployment (k8s/, Dockerfile): no cluster, no Docker.

The RayService manifests validate against KubeRay's CRD schema (strictly: unknown fields fail,
as with `kubectl apply --validate=strict`), embed deployments/serve_config.yaml with only the
declared per-variant overrides, pass Ray's and the project's config validators, and differ from
each other only in the fields listed in ALLOWED_VARIANT_DIFFERENCES.
"""

from __future__ import annotations

import copy
import fnmatch
import importlib
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from k8s import generate

REPO_ROOT = Path(__file__).resolve().parent.parent
VARIANT_NAMES = list(generate.VARIANTS)
# Test ids name the file: a bare "gpu" id would be a keyword conftest.py skips without CUDA.
VARIANT_IDS = [f"rayservice-{name}" for name in VARIANT_NAMES]
HAS_SLO_POLICY = importlib.util.find_spec("deployments.autoscaling") is not None
POLICY_MISSING = "deployments/autoscaling.py does not exist yet: the SLO policy path is not importable"
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 18k lines each


# --- loading ----------------------------------------------------------------------------------
def load_documents(variant: str) -> list[dict]:
    with open(generate.VARIANTS[variant].path) as f:
        return [doc for doc in yaml.load_all(f, Loader=YAML_LOADER) if doc is not None]


def rayservice(variant: str) -> dict:
    docs = [d for d in load_documents(variant) if d.get("kind") == "RayService"]
    assert len(docs) == 1, f"{variant}: expected one RayService, found {len(docs)}"
    return docs[0]


def serve_config(doc: dict) -> dict:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])


def our_app(config: dict) -> dict:
    return generate.find_app(config)


def our_deployment(config: dict) -> dict:
    deployment = generate.find_deployment(our_app(config))
    assert deployment is not None
    return deployment


def head_container(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def worker_groups(doc: dict) -> list[dict]:
    return doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def worker_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


def without_policy(block: dict) -> dict:
    """The autoscaling block minus `policy` (AutoscalingConfig imports the policy's module)."""
    return {k: v for k, v in block.items() if k != "policy"}


def checkable(config: dict) -> dict:
    """The Serve config as Ray can check it here: policy blocks dropped while the module is missing."""
    if HAS_SLO_POLICY:
        return config
    config = copy.deepcopy(config)
    for app in config.get("applications") or []:
        for deployment in app.get("deployments") or []:
            if isinstance(deployment.get("autoscaling_config"), dict):
                deployment["autoscaling_config"] = without_policy(deployment["autoscaling_config"])
    return config


# --- KubeRay's CRD schema -----------------------------------------------------------------------
def crd_dir() -> Path:
    """$KUBERAY_CRD_DIR if set, else <repo>/../shared/kuberay/crds (CI clones beside shared/)."""
    env = os.environ.get("KUBERAY_CRD_DIR")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "kuberay" / "crds"


def strict(schema: Any) -> Any:
    """The CRD's structural schema with unknown fields refused (the API server would prune them
    silently, `kubectl apply --validate=strict` refuses them) and `nullable` honoured."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k in ("properties", "items", "additionalProperties", "anyOf", "allOf", "oneOf", "not") else v
           for k, v in schema.items()}
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _list_map_keys(validator: Any, keys: list[str], instance: Any, schema: dict) -> Iterator[jsonschema.ValidationError]:
    """`x-kubernetes-list-map-keys`: no two items may share the key tuple (e.g. env names, ports)."""
    if not isinstance(instance, list):
        return
    seen: set[tuple] = set()
    for item in instance:
        if isinstance(item, dict):
            key = tuple(item.get(k) for k in keys)
            if key in seen:
                yield jsonschema.ValidationError(f"duplicate entry for key {dict(zip(keys, key, strict=True))}")
            seen.add(key)


CRDValidator = jsonschema.validators.extend(jsonschema.Draft7Validator, {"x-kubernetes-list-map-keys": _list_map_keys})


@pytest.fixture(scope="module")
def rayservice_validator() -> Any:
    path = crd_dir() / "ray.io_rayservices.yaml"
    if not path.is_file():
        pytest.skip(f"KubeRay CRDs not found at {path}: set KUBERAY_CRD_DIR or put them at <repo>/../shared/kuberay/crds")
    with open(path) as f:
        crd = yaml.load(f, Loader=YAML_LOADER)
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    schema = strict(versions["v1"]["schema"]["openAPIV3Schema"])
    CRDValidator.check_schema(schema)
    return CRDValidator(schema)


def crd_errors(validator: Any, doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_rayservice_validates_against_kuberay_crd(rayservice_validator: Any, variant: str) -> None:
    doc = rayservice(variant)
    assert doc["apiVersion"] == "ray.io/v1"
    assert crd_errors(rayservice_validator, doc) == []


def test_crd_validation_catches_wrong_types_missing_fields_and_typos(rayservice_validator: Any) -> None:
    good = rayservice("gpu")

    def errors_after(change: Any) -> list[str]:
        doc = copy.deepcopy(good)
        change(doc["spec"]["rayClusterConfig"])
        return crd_errors(rayservice_validator, doc)

    def wrong_type(c: dict) -> None:
        c["workerGroupSpecs"][0]["minReplicas"] = "1"

    def missing_required(c: dict) -> None:
        del c["workerGroupSpecs"][0]["groupName"]

    def typo(c: dict) -> None:
        c["enableInTreeAutoScaling"] = c.pop("enableInTreeAutoscaling")

    def bad_quantity(c: dict) -> None:
        c["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "lots"

    def non_string_start_param(c: dict) -> None:
        c["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0

    def duplicate_env(c: dict) -> None:
        env = c["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
        env.append(dict(env[-1]))

    assert any("minReplicas" in e and "'1' is not of type 'integer'" in e for e in errors_after(wrong_type))
    assert any("'groupName' is a required property" in e for e in errors_after(missing_required))
    assert any("enableInTreeAutoScaling" in e for e in errors_after(typo))
    assert any("limits.memory" in e for e in errors_after(bad_quantity))
    assert any("num-cpus" in e for e in errors_after(non_string_start_param))
    assert any("duplicate entry" in e for e in errors_after(duplicate_env))


@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_other_documents_are_well_formed(variant: str) -> None:
    docs = load_documents(variant)
    for doc in docs:
        assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], doc
        assert isinstance(doc.get("kind"), str) and doc["kind"], doc
        assert isinstance(doc.get("metadata", {}).get("name"), str) and doc["metadata"]["name"], doc
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), f"duplicate objects in {variant}: {names}"


# --- the embedded Serve config ----------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_serve_config_v2_is_the_project_config_plus_declared_overrides(variant: str) -> None:
    """Everything but the overridden app args and deployment keys equals the variant's Serve config
    (deployments/serve_config.yaml; serve_config_pd.yaml for the pd variant)."""
    v = generate.VARIANTS[variant]
    base = generate.load_serve_config(v.serve_config_path)
    embedded = serve_config(rayservice(variant))
    overrides = generate.serve_overrides(v)
    allowed = generate.override_paths(overrides)
    names = {"deployment": generate.DEPLOYMENT_NAME, "ingress": generate.INGRESS_DEPLOYMENT_NAME,
             "prefill": generate.PREFILL_DEPLOYMENT_NAME, "drafter": generate.DRAFTER_DEPLOYMENT_NAME}

    def strip(config: dict) -> dict:
        config = copy.deepcopy(config)
        app = our_app(config)
        app.pop("args", None)
        app["deployments"] = [d for d in app.get("deployments") or [] if d.get("name") not in names.values()]
        return config

    assert strip(embedded) == strip(base), "serveConfigV2 differs from its Serve config outside our app's args/deployments"
    sections = [("args", our_app(embedded)["args"], our_app(base)["args"])]
    for section, name in names.items():
        theirs = generate.find_deployment(our_app(base), name) or {"name": name}
        ours = generate.find_deployment(our_app(embedded), name) or {"name": name}
        sections.append((section, ours, theirs))
    for section, ours, theirs in sections:
        for path in differing_paths(ours, theirs, (section,)):
            assert any(is_prefix(path, p) or is_prefix(p, path) for p in allowed), (
                f"{variant}: serveConfigV2 {'.'.join(path)} differs from {v.serve_config_path.name} "
                "and is not one of k8s/generate.py's declared overrides"
            )
    # ... and every declared override is really there.
    assert our_app(embedded)["args"]["device"] == overrides["args"]["device"]
    assert "num_replicas" not in our_deployment(embedded)
    if v.pd:
        assert our_app(embedded)["args"]["mode"] == "disaggregated"
        prefill = generate.find_deployment(our_app(embedded), generate.PREFILL_DEPLOYMENT_NAME)
        assert prefill["ray_actor_options"]["resources"] == {"prefill": 1}
        assert our_deployment(embedded)["ray_actor_options"]["resources"] == {"decode": 1}
    if v.drafter:
        assert our_app(embedded)["args"]["speculative"]["placement"] == "remote"
        pool = generate.find_deployment(our_app(embedded), generate.DRAFTER_DEPLOYMENT_NAME)
        assert pool["ray_actor_options"]["resources"] == {"drafter": 1} and "num_replicas" not in pool
        assert our_deployment(embedded)["ray_actor_options"]["resources"] == {"engine": 1}


def differing_paths(a: Any, b: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                yield (*prefix, str(key))
            else:
                yield from differing_paths(a[key], b[key], (*prefix, str(key)))
    elif a != b:
        yield prefix


def is_prefix(short: tuple[str, ...], long: tuple[str, ...]) -> bool:
    return long[: len(short)] == short


def test_manifests_are_up_to_date() -> None:
    assert generate.stale(generate.render_all()) == {}, "run `python -m k8s.generate` and commit the manifests"
    assert generate.main(["--check"]) == 0


def test_check_fails_when_serve_config_drifts(tmp_path: Path) -> None:
    drifted = generate.load_serve_config()
    our_app(drifted)["args"]["max_tokens"] = 777
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(drifted, sort_keys=False))
    # Every manifest that embeds deployments/serve_config.yaml is stale (pd embeds serve_config_pd.yaml).
    embedding = {str(v.path) for v in generate.VARIANTS.values() if v.serve_config_path == generate.SERVE_CONFIG_PATH}
    assert set(generate.stale(generate.render_all(drifted))) == embedding
    assert generate.main(["--check", "--serve-config", str(path)]) == 1


def test_generate_writes_to_out_dir(tmp_path: Path) -> None:
    assert generate.main(["--out-dir", str(tmp_path)]) == 0
    for variant in generate.VARIANTS.values():
        assert (tmp_path / variant.path.name).read_text() == variant.path.read_text()


@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_serve_config_passes_ray_schema_and_autoscaling_config(variant: str) -> None:
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    config = serve_config(rayservice(variant))
    ServeDeploySchema.model_validate(checkable(config))  # it too builds the policy when present
    block = our_deployment(config)["autoscaling_config"]
    # The schema alone accepts min > max and unknown keys; AutoscalingConfig does not.
    parsed = AutoscalingConfig(**(block if HAS_SLO_POLICY else without_policy(block)))
    assert parsed.min_replicas == block["min_replicas"] <= parsed.max_replicas == block["max_replicas"]
    assert set(block) <= set(AutoscalingConfig.model_fields)
    assert block["policy"]["policy_function"] == generate.SLO_POLICY
    with pytest.raises(ValueError):
        AutoscalingConfig(**{**without_policy(block), "min_replicas": block["max_replicas"] + 1})


@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_serve_config_passes_the_project_validator(variant: str) -> None:
    from deployments.config import (
        APP_IMPORT_PATH,
        DEPLOYMENT_NAME,
        SERVICER_FUNCTION,
        AppConfig,
        validate_serve_config,
    )

    assert (generate.APP_IMPORT_PATH, generate.DEPLOYMENT_NAME) == (APP_IMPORT_PATH, DEPLOYMENT_NAME)
    config = serve_config(rayservice(variant))
    apps = validate_serve_config(checkable(config))
    app = our_app(config)
    assert apps[app["name"]] == AppConfig.from_dict(app["args"])
    assert apps[app["name"]].device == ("cuda" if generate.VARIANTS[variant].gpu else "cpu")
    assert SERVICER_FUNCTION in config["grpc_options"]["grpc_servicer_functions"]


def _import(path: str) -> Any:
    """`pkg.mod:attr` or `pkg.mod.attr`."""
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_import_paths_resolve_to_project_code(variant: str) -> None:
    config = serve_config(rayservice(variant))
    build_app = _import(our_app(config)["import_path"])
    assert callable(build_app) and build_app.__module__ == "deployments.app"
    for servicer in config["grpc_options"]["grpc_servicer_functions"]:
        assert callable(_import(servicer))
    assert config["grpc_options"]["port"] == generate.GRPC_PORT


def test_slo_policy_path_resolves() -> None:
    if not HAS_SLO_POLICY:
        pytest.skip(POLICY_MISSING)
    assert callable(_import(generate.SLO_POLICY))


# --- the cluster shape ------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_worker_bounds_match_serve_autoscaling(variant: str) -> None:
    """Each worker group hosts one deployment (its pool); its bounds are that deployment's."""
    doc = rayservice(variant)
    pools = generate.VARIANTS[variant].pools
    assert [g["groupName"] for g in worker_groups(doc)] == list(pools)
    for group in worker_groups(doc):
        block = generate.find_deployment(our_app(serve_config(doc)), pools[group["groupName"]])["autoscaling_config"]
        assert (group["minReplicas"], group["maxReplicas"]) == (block["min_replicas"], block["max_replicas"])
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


@pytest.mark.parametrize("variant", ["pd", "drafter"], ids=["rayservice-pd", "rayservice-drafter"])
def test_pools_are_pinned_to_their_worker_groups(variant: str) -> None:
    """pd, drafter: each group's pods offer the custom resource its pool's replicas ask for (and
    only they), so that no replica of one pool lands on the other pool's pods."""
    import json

    doc = rayservice(variant)
    app = our_app(serve_config(doc))
    pools = generate.VARIANTS[variant].pools
    assert len(pools) == 2
    for group in worker_groups(doc):
        pool = group["groupName"].removesuffix("-workers")
        offered = json.loads(json.loads(group["rayStartParams"]["resources"]))
        deployment = generate.find_deployment(app, pools[group["groupName"]])
        assert offered == deployment["ray_actor_options"]["resources"] == {pool: 1}


def test_drafter_variant_sizes_the_pool_by_engine_replicas() -> None:
    """drafter: the pool scales on ongoing calls (each engine replica keeps at most one in flight),
    at most one drafter replica per ENGINES_PER_DRAFTER engine replicas (more could never reach the
    target: each engine replica has at most one call in flight); its pods are smaller."""
    from ray.serve.config import AutoscalingConfig

    doc = rayservice("drafter")
    app = our_app(serve_config(doc))
    engine = our_deployment(serve_config(doc))["autoscaling_config"]
    pool = generate.find_deployment(app, generate.DRAFTER_DEPLOYMENT_NAME)["autoscaling_config"]
    parsed = AutoscalingConfig(**pool)  # Serve's default policy: no policy block
    assert "policy" not in pool and parsed.target_ongoing_requests == generate.ENGINES_PER_DRAFTER
    assert parsed.max_replicas == -(-engine["max_replicas"] // generate.ENGINES_PER_DRAFTER)
    groups = {g["groupName"]: g for g in worker_groups(doc)}
    engine_limits = worker_container(groups["engine-workers"])["resources"]["limits"]
    pool_limits = worker_container(groups["drafter-workers"])["resources"]["limits"]
    assert pool_limits["nvidia.com/gpu"] == engine_limits["nvidia.com/gpu"] == 1
    assert _quantity(pool_limits["cpu"]) < _quantity(engine_limits["cpu"])


def _quantity(value: Any) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_one_replica_per_worker_pod(variant: str) -> None:
    """A worker pod's Ray resources (KubeRay derives them from the limits) hold exactly one replica."""
    from deployments.common import replica_resources
    from deployments.config import AppConfig

    doc = rayservice(variant)
    config = serve_config(doc)
    pools = generate.VARIANTS[variant].pools
    for group in worker_groups(doc):
        deployment = generate.find_deployment(our_app(config), pools[group["groupName"]])
        actor = deployment.get("ray_actor_options") or replica_resources(AppConfig.from_dict(our_app(config)["args"]))
        resources = worker_container(group)["resources"]
        limits = resources["limits"]
        if generate.VARIANTS[variant].gpu:
            assert limits["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
            assert actor["num_gpus"] == 1
            assert actor.get("num_cpus", 1) <= _quantity(limits["cpu"])
        else:
            assert not any(key.endswith("gpu") for key in {**limits, **resources["requests"]})
            assert our_app(config)["args"]["device"] == "cpu"
            assert actor["num_cpus"] <= _quantity(limits["cpu"]) < 2 * actor["num_cpus"]
    assert not any(key.endswith("gpu") for key in head_container(doc)["resources"]["limits"])


@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_head_autoscaling_ports_and_serve_service(variant: str) -> None:
    doc = rayservice(variant)
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]
    assert cluster["rayVersion"] == generate.pinned_ray_version()
    head_ports = {p["name"]: p["containerPort"] for p in head_container(doc)["ports"]}
    assert head_ports["serve-grpc"] == generate.GRPC_PORT and head_ports["serve"] == generate.HTTP_PORT
    service = doc["spec"]["serveService"]
    assert service["metadata"]["name"] == f"{doc['metadata']['name']}-serve-svc"
    grpc = [p for p in service["spec"]["ports"] if p["name"] == "serve-grpc"]
    assert grpc == [{"name": "serve-grpc", "port": 9000, "targetPort": 9000, "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}]
    for group in worker_groups(doc):
        ports = {p["name"]: p["containerPort"] for p in worker_container(group)["ports"]}
        assert ports["serve-grpc"] == generate.GRPC_PORT and ports["serve"] == generate.HTTP_PORT
        # Readiness through Serve's proxy health on the worker.
        assert worker_container(group)["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": generate.HTTP_PORT}


@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_every_container_has_resources_and_probes(variant: str) -> None:
    for doc in load_documents(variant):
        if doc["kind"] == "RayService":
            cluster = doc["spec"]["rayClusterConfig"]
            pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
        elif doc["kind"] == "Deployment":
            pods = [doc["spec"]["template"]["spec"]]
        else:
            continue
        for pod in pods:
            for container in pod["containers"]:
                assert {"livenessProbe", "readinessProbe"} <= set(container), container["name"]
            for container in pod["containers"] + pod.get("initContainers", []):
                resources = container["resources"]
                assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
                assert resources["requests"]["memory"] == resources["limits"]["memory"], container["name"]


@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_models_volume_covers_the_model_paths(variant: str) -> None:
    doc = rayservice(variant)
    args = our_app(serve_config(doc))["args"]
    model_dirs = [args["model"]] + ([args["speculative"]["model"]] if (args.get("speculative") or {}).get("model") else [])
    for group in worker_groups(doc):
        spec = group["template"]["spec"]
        (mount,) = [m for m in worker_container(group)["volumeMounts"] if m["name"] == "models"]
        assert "models" in {v["name"] for v in spec["volumes"]}
        for model_dir in model_dirs:
            assert not os.path.isabs(model_dir), model_dir
            in_pod = os.path.normpath(os.path.join(generate.APP_DIR, model_dir))
            assert in_pod.startswith(mount["mountPath"] + "/"), f"{model_dir} -> {in_pod} is outside {mount['mountPath']}"


@pytest.mark.parametrize("variant", VARIANT_NAMES, ids=VARIANT_IDS)
def test_opentelemetry_settings_are_passed_as_env(variant: str) -> None:
    doc = rayservice(variant)
    containers = [head_container(doc)] + [worker_container(g) for g in worker_groups(doc)]
    for container in containers:
        env = {e["name"]: e.get("value") for e in container["env"]}
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SERVICE_NAME",
                     "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"):
            assert env.get(name), f"{container['name']}: {name} unset"
        assert 0.0 < float(env["OTEL_TRACES_SAMPLER_ARG"]) <= 1.0


def test_ha_variant() -> None:
    docs = load_documents("ha")
    doc = rayservice("ha")
    deployment = our_deployment(serve_config(doc))
    assert deployment["max_replicas_per_node"] == 1
    assert deployment["autoscaling_config"]["min_replicas"] >= 2
    ft = doc["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    secret_ref = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    secret = by_kind[("Secret", secret_ref["name"])]
    assert secret_ref["key"] in secret["stringData"]
    host, _, port = ft["redisAddress"].partition(":")
    service = by_kind[("Service", host)]
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    redis = by_kind[("Deployment", host)]
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    worker_labels = worker_groups(doc)[0]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= worker_labels.items()
    for variant in ("cpu-dev", "gpu"):
        assert "gcsFaultToleranceOptions" not in rayservice(variant)["spec"]["rayClusterConfig"]
        assert "max_replicas_per_node" not in our_deployment(serve_config(rayservice(variant)))


# --- variants differ only where they should -----------------------------------------------------
WORKERS = "spec.rayClusterConfig.workerGroupSpecs.*"
HEAD = "spec.rayClusterConfig.headGroupSpec"
ALLOWED_VARIANT_DIFFERENCES = {
    "spec.serveConfigV2": "checked against deployments/serve_config.yaml + the declared overrides",
    "spec.rayClusterConfig.gcsFaultToleranceOptions": "HA: GCS state in Redis",
    "spec.rayClusterConfig.autoscalerOptions.idleTimeoutSeconds": "GPU pods start slowly: keep idle ones longer",
    f"{HEAD}.template.spec.containers.*.image": "image tag (cpu/gpu)",
    f"{HEAD}.template.spec.containers.*.resources": "sizing",
    f"{HEAD}.template.spec.containers.*.env.name=OTEL_TRACES_SAMPLER_ARG": "dev traces every request",
    f"{WORKERS}.groupName": "cpu-workers / gpu-workers",
    f"{WORKERS}.replicas": "replica bounds",
    f"{WORKERS}.minReplicas": "replica bounds",
    f"{WORKERS}.maxReplicas": "replica bounds",
    f"{WORKERS}.template.spec.containers.*.image": "image tag (cpu/gpu)",
    f"{WORKERS}.template.spec.initContainers.*.image": "image tag (cpu/gpu)",
    f"{WORKERS}.template.spec.containers.*.resources": "sizing, nvidia.com/gpu",
    f"{WORKERS}.template.spec.containers.*.env.name=OTEL_TRACES_SAMPLER_ARG": "dev traces every request",
    f"{WORKERS}.template.spec.tolerations": "GPU nodes' taint",
    f"{WORKERS}.template.spec.affinity": "HA: spread workers over nodes",
}


def drop(node: Any, path: list[str]) -> None:
    """Remove what `path` names: `*` is any list item or key, `name=X` the list item named X."""
    head, rest = path[0], path[1:]
    if isinstance(node, list):
        if head == "*":
            items = node
        elif "=" in head:
            key, _, value = head.partition("=")
            items = [item for item in node if isinstance(item, dict) and item.get(key) == value]
            if not rest:
                node[:] = [item for item in node if item not in items]
                return
        else:
            return
        for item in items:
            drop(item, rest)
    elif isinstance(node, dict):
        keys = list(node) if head == "*" else [head] if head in node else []
        for key in keys:
            if rest:
                drop(node[key], rest)
            else:
                del node[key]


def normalized(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for path in ALLOWED_VARIANT_DIFFERENCES:
        drop(doc, path.split("."))
    return doc


@pytest.mark.parametrize("variant", ["cpu-dev", "ha"], ids=["rayservice-cpu-dev", "rayservice-ha"])
def test_variants_differ_only_where_allowed(variant: str) -> None:
    reference = normalized(rayservice("gpu"))
    other = normalized(rayservice(variant))
    paths = [".".join(p) for p in differing_paths(other, reference)]
    assert paths == [], f"{variant} differs from gpu outside ALLOWED_VARIANT_DIFFERENCES at {paths}"


def test_variant_comparison_catches_an_unexpected_difference() -> None:
    changed = rayservice("ha")
    head_container(changed)["ports"][0]["containerPort"] = 6380
    assert list(differing_paths(normalized(changed), normalized(rayservice("gpu"))))


def test_variants_really_differ_in_the_allowed_fields() -> None:
    dev, gpu, ha = (rayservice(v) for v in ("cpu-dev", "gpu", "ha"))
    assert worker_container(worker_groups(dev)[0])["image"].endswith("-cpu")
    assert worker_container(worker_groups(gpu)[0])["image"].endswith("-gpu")
    assert worker_container(worker_groups(ha)[0])["image"] == worker_container(worker_groups(gpu)[0])["image"]
    assert "tolerations" not in worker_groups(dev)[0]["template"]["spec"]
    assert "affinity" in worker_groups(ha)[0]["template"]["spec"]


# --- the image --------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO_ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def dockerignore_patterns() -> list[str]:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip().strip("/") for line in lines if line.strip() and not line.startswith("#")]


def docker_ignores(path: str, patterns: list[str]) -> bool:
    """Enough of Docker's matching for the patterns we use: a pattern matches a path or a parent."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(prefix.rsplit("/", 1)[-1], pattern[3:]):
                return True
    return False


def test_dockerfile_base_matches_pinned_ray_and_copies_existing_files() -> None:
    instructions = dockerfile_instructions()
    args = dict(rest.split("=", 1) for kind, rest in instructions if kind == "ARG" and "=" in rest)
    ray = generate.pinned_ray_version()
    assert re.fullmatch(rf"rayproject/ray:{re.escape(ray)}-py311-gpu", args["BASE"]), args["BASE"]
    assert ("FROM", "${BASE}") in instructions
    assert "TORCH_INDEX" in args
    copies = [rest for kind, rest in instructions if kind == "COPY"]
    assert copies
    patterns = dockerignore_patterns()
    for rest in copies:
        sources = [s for s in rest.split() if not s.startswith("--")][:-1]
        for source in sources:
            assert (REPO_ROOT / source).exists(), f"Dockerfile COPYs {source}, which does not exist"
            if source != ".":
                assert not docker_ignores(source, patterns), f"{source} is excluded by .dockerignore"
    workdir = [rest for kind, rest in instructions if kind == "WORKDIR"][-1]
    assert workdir == generate.APP_DIR == os.path.dirname(generate.MODELS_MOUNT)


def test_dockerignore_keeps_code_and_models_out_the_rest() -> None:
    patterns = dockerignore_patterns()
    for path in (".venv/bin/python", "runs/x/log.txt", "checkpoints/step1/model.pt", ".pytest_cache/v",
                 "models/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",  # fetched in the build instead
                 "engine/__pycache__/a.pyc", ".ruff_cache/x", "specdecode_serve.egg-info/PKG-INFO"):
        assert docker_ignores(path, patterns), f"{path} would be sent to the Docker build"
    for path in ("models/target/config.json", "models/drafter/model.safetensors", "protos/specdecode/v1/specdecode_pb2.py",
                 "deployments/serve_config.yaml", "engine/llm.py", "pyproject.toml"):
        assert not docker_ignores(path, patterns), f"{path} would be missing from the image"


def test_the_image_fetches_the_served_model() -> None:
    """The shipped config serves a fetched GGUF (models/cache/, git- and docker-ignored): the
    image fetches it at build time, where the manifests' models volume copies it from."""
    from models.fetch import cached_path

    model = generate.load_serve_config()["applications"][0]["args"]["model"]
    assert REPO_ROOT / model == cached_path("smollm2")
    assert "RUN python -m models fetch smollm2" in (REPO_ROOT / "Dockerfile").read_text()


def test_manifest_images_use_the_project_version() -> None:
    version = generate.project_version()
    for variant in generate.VARIANTS.values():
        doc = rayservice(variant.name)
        images = {head_container(doc)["image"]} | {
            c["image"] for g in worker_groups(doc) for c in g["template"]["spec"]["containers"] + g["template"]["spec"].get("initContainers", [])
        }
        assert images == {f"{generate.DEFAULT_IMAGE_REPO}:{version}-{variant.flavour}"}
