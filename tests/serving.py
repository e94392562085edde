"""A real local Ray cluster with Serve, shared by every serving test of a session.

Starting Ray + Serve costs ~20 s here, so one cluster hosts every test application; each
application gets its own route prefix.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
from typing import Any

from raylm.cluster.local_ray import LOCAL_RAY_ENV
from raylm.deploy.config import DeployConfig, parse_deploy_config
from raylm.deploy.readiness import wait_healthy

RAY_ENV = {
    **LOCAL_RAY_ENV,
    "RAY_metrics_report_interval_ms": "1000",  # metrics reach the endpoint within ~1 s, not 10
}

# Small and quick: two replicas, a modest pool and context, so tests finish fast on 2 cores.
TEST_DEPLOY: dict[str, Any] = {
    "name": "raylm",
    "model": {"name": "smollm2-135m-instruct"},
    "workers": {
        "num_replicas": 2,
        "num_cpus": 1,
        "max_ongoing_requests": 16,
        "max_queued_requests": 16,
        "graceful_shutdown_timeout_s": 5,
    },
    "engine": {
        "num_kv_blocks": 512,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 256,
        "max_model_len": 1024,
        "num_scheduler_steps": 2,
        "scheduling_policy": "priority",
        "compilation_cache_dir": "~/.cache/raylm/jax",
        "hidden_state_slots": 1,  # 4.6 MB of buffers for 64 positions of the bundled model
        "hidden_state_max_tokens": 64,
    },
    "router": {"max_queue_size": 16, "prefix_routing": {"stats_period_s": 0.5, "imbalance_threshold_tokens": 1500}},
}


def free_port() -> int:
    """A port free now, below the ephemeral range: the OS hands ephemeral ports to every bind(0)
    and outgoing connection (Ray starts dozens of processes), and one of them took a port picked
    there before the server under test bound it ("Failed to bind to address"). SystemRandom:
    pytest workers with the same seeded random state would pick the same ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first_ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    for port in random.SystemRandom().sample(range(20000, max(first_ephemeral, 20100)), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@dataclasses.dataclass
class ServeCluster:
    """The session's Ray cluster; ``deploy`` adds an application and returns its base URL."""

    http_port: int
    metrics_port: int

    def deploy(self, raw_config: dict[str, Any], route_prefix: str = "/") -> "ServedApp":
        from ray import serve

        from raylm.deploy.app_builder import build_application

        config = parse_deploy_config({**raw_config, "route_prefix": route_prefix})
        serve.run(build_application(config), name=config.name, route_prefix=route_prefix, blocking=False)
        base = f"http://127.0.0.1:{self.http_port}{route_prefix.rstrip('/')}"
        wait_healthy(base)
        return ServedApp(config, base)

    def remove(self, app: "ServedApp") -> None:
        from ray import serve

        serve.delete(app.config.name)

    def stop(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


@dataclasses.dataclass
class ServedApp:
    config: DeployConfig
    base_url: str

    @property
    def model(self) -> str:
        return self.config.served_model_name


def start_cluster(num_cpus: int = 12) -> ServeCluster:
    """Ray's CPUs here are logical slots for replicas, not cores: replicas share the 2 cores."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    import ray
    from ray import serve

    metrics_port = free_port()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return ServeCluster(port, metrics_port)
