import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from helpers import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), "llama")


@pytest.fixture(scope="session")
def serve_instance():
    """One Ray (2 CPUs) and one Serve with gRPC and HTTP proxies for every module that deploys
    applications (each deletes its own through `SharedServe.apps`): starting and stopping Ray and
    Serve per module cost ~10 s each time. Spans are exported within 0.1 s (replicas inherit the
    environment of `ray.init`)."""
    import ray
    from helpers import SERVICERS, SharedServe, free_port
    from ray import serve

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        shared = SharedServe(free_port(), free_port())
        serve.start(
            http_options={"host": "127.0.0.1", "port": shared.http_port},
            grpc_options={"port": shared.grpc_port, "grpc_servicer_functions": SERVICERS},
        )
        yield shared
    finally:
        serve.shutdown()
        ray.shutdown()


# The modules whose tests run on Ray: the shared Serve (`serve_instance`) or a cluster of their
# own. `make test` runs them in one pytest process beside another for the rest (tests/run.py):
# they mostly wait on replicas, timers and subprocesses, the others mostly compute.
RAY_MODULES = {
    "test_disaggregated", "test_drafter_pool", "test_failover_cluster",  # a multi-node cluster of their own
    "test_drain", "test_faults_serve", "test_loadtest", "test_serve_grpc", "test_serve_http", "test_slo_scaling", "test_tracing",
}


def pytest_collection_modifyitems(config, items):
    import torch

    unlisted = {item.module.__name__ for item in items if "serve_instance" in getattr(item, "fixturenames", ())}
    unlisted -= RAY_MODULES
    if unlisted:
        raise pytest.UsageError(f"tests/conftest.py: add {sorted(unlisted)} to RAY_MODULES (they use serve_instance)")
    # the tests on the shared Serve run last, together: its Ray stays up from the first to the
    # last of them, and would otherwise idle next to the CPU-bound tests in between
    items.sort(key=lambda item: "serve_instance" in getattr(item, "fixturenames", ()))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
