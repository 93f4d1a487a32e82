"""SLO autoscaling end to end on the CPU: real Ray Serve, the gRPC proxy, the SLO policy, the
engine-load router and tiny random models; bounded in time.

A steady load of concurrent streams pushes p95 TPOT over a test-sized SLO on one replica; the
policy must add a replica, p95 TPOT (as the clients see it) must come back under the SLO, and
once the load stops the deployment must shrink back to one replica. The tiny model's engine steps
are padded with a sleep of STEP_BASE_S + STEP_PER_SEQ_S per running sequence: a stand-in for a
model whose step time grows with the batch, which costs no CPU, so what the test measures is each
replica's own capacity and not the contention on a shared 2-core machine. Replicas ask for half a
CPU each so two fit. Short look-back, delays, windows and cooldown keep it to about a minute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from deployments.autoscaling import METRIC_NUM_RUNNING, METRIC_TPOT_P95_MS, SLO_POLICY_PATH
from deployments.client import SpecDecodeClient
from deployments.router import ROUTER_PATH

pytestmark = [pytest.mark.slow, pytest.mark.timeout(170)]

APP = "slo-test"
TPOT_SLO_MS = 110.0
STEP_BASE_S = 0.004
STEP_PER_SEQ_S = 0.012  # 12 streams on one replica: >= 148 ms a step; 6 on each of two: >= 76 ms
NUM_STREAMS = 12
MAX_TOKENS = 32
PROMPT = [5, 17, 33, 8, 40, 41]


def padded_server_class(step_base_s: float, step_per_seq_s: float) -> type:
    """SpecDecodeServer whose engine sleeps before each step. Defined in a function so that Ray
    pickles it by value: replicas need not import this test module."""
    from deployments.replica import SpecDecodeServer

    class PaddedStepServer(SpecDecodeServer):
        def __init__(self, config) -> None:  # noqa: ANN001 - AppConfig
            super().__init__(config)
            engine = self.llm.engine
            execute_step = engine.execute_step  # what AsyncLLM's loop calls each step

            def padded_step():  # noqa: ANN202 - execute_step's own result
                time.sleep(step_base_s + step_per_seq_s * len(engine.scheduler.running))
                return execute_step()

            engine.execute_step = padded_step

    return PaddedStepServer


def running_replicas() -> int:
    from ray import serve

    from deployments.config import DEPLOYMENT_NAME

    app = serve.status().applications.get(APP)
    if app is None or DEPLOYMENT_NAME not in app.deployments:
        return 0
    return app.deployments[DEPLOYMENT_NAME].replica_states.get("RUNNING", 0)


def replica_reports() -> list[dict[str, float]]:
    """Each running replica's latest `record_autoscaling_stats` as the controller holds it (via
    Serve's controller test hook: the figures the policy decides on)."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    from deployments.config import DEPLOYMENT_NAME

    controller = _get_global_client()._controller
    metrics = ray.get(controller._get_metrics_for_deployment_for_testing.remote(DeploymentID(DEPLOYMENT_NAME, APP)))
    series = {name: values for name, values in metrics.items() if name in (METRIC_TPOT_P95_MS, METRIC_NUM_RUNNING)}
    num = min((len(v) for v in series.values()), default=0)
    return [{name: values[i][-1].value for name, values in series.items() if values[i]} for i in range(num)]


def wait_for(predicate, timeout_s: float, what: str) -> float:  # noqa: ANN001 - a () -> bool
    """Poll `predicate` every 0.5 s; return the seconds it took, or fail naming `what`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what} ({running_replicas()} replicas running)")
        time.sleep(0.5)
    return time.monotonic() - start


@dataclass
class Load:
    """NUM_STREAMS client threads streaming Generate back to back until stopped."""

    port: int
    started: list[tuple[float, float]] = field(default_factory=list)  # (start time, TPOT s) per request
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def run(self) -> None:
        with SpecDecodeClient(f"127.0.0.1:{self.port}", application=APP, timeout=60) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                first, num_tokens = None, 0
                try:
                    for chunk in client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True):
                        if chunk.token_ids and first is None:
                            first = time.monotonic()
                        num_tokens += len(chunk.token_ids)
                except grpc.RpcError as e:
                    self.errors.append(f"{e.code().name}: {e.details()}")
                    continue
                if first is not None and num_tokens > 1:
                    self.started.append((start, (time.monotonic() - first) / (num_tokens - 1)))

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(NUM_STREAMS)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)

    def tpot_p95_ms(self, since: float) -> tuple[float, int]:
        """p95 TPOT (ms) of the requests started after `since`, and how many there were."""
        values = sorted(tpot for start, tpot in list(self.started) if start >= since)
        if not values:
            return float("nan"), 0
        return values[max(0, -(-95 * len(values) // 100) - 1)] * 1e3, len(values)


@pytest.fixture(scope="module")
def served_port(tiny_llama: str, serve_instance) -> Iterator[int]:
    from ray import serve

    from deployments.app import bind_app
    from deployments.config import AppConfig

    port = serve_instance.grpc_port
    config = AppConfig(
        model=tiny_llama, speculative=None, device="cpu", dtype="float32", max_num_seqs=16,
        max_queued_requests=64, max_tokens=MAX_TOKENS, default_max_tokens=MAX_TOKENS, num_cpus=1,
        metrics_window_s=3.0,
    )
    overrides = {
        "autoscaling_config": {
            "min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
            "metrics_interval_s": 0.5, "look_back_period_s": 2.0, "upscale_delay_s": 1.0, "downscale_delay_s": 3.0,
            "policy": {
                "policy_function": SLO_POLICY_PATH,
                "policy_kwargs": {"ttft_p95_ms": 10_000, "tpot_p95_ms": TPOT_SLO_MS, "upscale_cooldown_s": 8,
                                  "min_latency_samples": 3},
            },
        },
        "ray_actor_options": {"num_cpus": 0.5},
        "request_router_config": {
            "request_router_class": ROUTER_PATH,
            "request_routing_stats_period_s": 0.5,
            "request_routing_stats_timeout_s": 5.0,
        },
    }
    with serve_instance.apps(APP):
        server = padded_server_class(STEP_BASE_S, STEP_PER_SEQ_S)
        serve.run(bind_app(config, overrides, engine_cls=server), name=APP, route_prefix=f"/{APP}")
        with SpecDecodeClient(f"127.0.0.1:{port}", application=APP) as client:
            client.wait_ready(60)
        yield port


def test_tpot_violation_scales_out_recovers_and_scales_back_in(served_port: int) -> None:
    assert running_replicas() == 1
    with Load(served_port) as load:
        took_up = wait_for(lambda: running_replicas() >= 2, 60, "a second replica")
        before = replica_reports()
        client_before, n_before = load.tpot_p95_ms(since=0.0)
        # The replicas' p95 windows and Serve's look-back move past the single-replica overload
        # while the router spreads the streams; then every replica's p95 must be under the SLO.
        since = time.monotonic()
        reports: list[dict[str, float]] = []

        def recovered() -> bool:
            nonlocal reports
            reports = replica_reports()
            return len(reports) >= 2 and all(r.get(METRIC_TPOT_P95_MS, 1e9) < TPOT_SLO_MS for r in reports)

        took_recover = wait_for(recovered, 40, f"every replica's p95 TPOT under {TPOT_SLO_MS:g} ms")
        time.sleep(8.0)  # what the clients see from here on (a request takes ~3 s)
        client_after, n_after = load.tpot_p95_ms(since=since + took_recover)
    assert not load.errors, load.errors[:5]
    assert any(r.get(METRIC_TPOT_P95_MS, 0) > TPOT_SLO_MS for r in before), f"no violation on one replica: {before}"
    # The clients' p95 also includes the proxy, which does not scale with replicas here; it must
    # at least have improved clearly.
    assert n_after >= 12 and client_after < 0.85 * client_before, (client_before, client_after, n_after)
    took_down = wait_for(lambda: running_replicas() == 1, 60, "the scale-down to one replica")
    print(
        f"\nscale-up {took_up:.1f} s after the load started (replica p95 TPOT {before}; clients {client_before:.0f} ms, "
        f"{n_before} requests); every replica under the SLO {took_recover:.1f} s later ({reports}; clients "
        f"{client_after:.0f} ms, {n_after} requests); scale-down {took_down:.1f} s after the load stopped"
    )
