"""Multi-node serving and the cluster autoscaler, on one machine.

Run as ``python -m tests.multinode_scenario [--temp-dir DIR]`` (``tests/cluster/test_multinode.py`` does).
It starts its own fake multi-node Ray cluster whose autoscaler launches worker "nodes" as extra
raylets on this machine (Ray's ``fake_multinode`` node provider), deploys raylm with two worker
replicas that each fill a whole worker node, and checks that

* the cluster starts with one worker node and the autoscaler adds a second for the second replica,
* the two replicas run on two different nodes,
* concurrent HTTP completions all succeed and both replicas (so both nodes) serve some.

It prints one JSON line with its findings and always tears the cluster down.

Why not ``ray.cluster_utils.AutoscalingCluster`` itself: in Ray 2.60 its constructor reads
``ray/autoscaler/_private/fake_multi_node/example.yaml``, which the wheel does not ship
(FileNotFoundError), and its ``start()``/``shutdown()`` run ``ray stop --force``, which kills
every Ray process of this user on the machine, other test sessions' clusters included. So
``FakeAutoscalingCluster`` below does what it does (same config: the example.yaml base with the
head and worker node types replaced; ``ray start --head --autoscaling-config`` with
``RAY_FAKE_CLUSTER=1``) but isolated: its own GCS port, temp dir and process group, and it stops
only its own processes.
"""

from __future__ import annotations

import os

from raylm.cluster.local_ray import apply_local_ray_env

apply_local_ray_env()  # before ray is imported

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import ray  # noqa: E402

from raylm.cluster.names import WORKER_DEPLOYMENT  # noqa: E402
from raylm.deploy.readiness import wait_healthy  # noqa: E402
from tests.serving import TEST_DEPLOY, free_port  # noqa: E402

APP_NAME = "raylm"
MIB = 1024 * 1024
# What ``ray start`` says when a raylet has not registered with the GCS in its 30 s.
STARTUP_TIMED_OUT = "The current node timed out during startup"
WORKER_NODE_TYPE = "cpu_node"
# The head has no CPU: Serve's controller and proxy and the raylm router (num_cpus 0) fit there,
# a worker replica (num_cpus 1) does not. A worker node has exactly one replica's worth of CPU.
HEAD_RESOURCES: dict[str, Any] = {"CPU": 0, "object_store_memory": 100 * MIB}
WORKER_NODE_TYPES: dict[str, Any] = {
    WORKER_NODE_TYPE: {
        "resources": {"CPU": 1, "object_store_memory": 100 * MIB},
        "node_config": {},
        "min_workers": 1,
        "max_workers": 2,
    },
}
DEPLOY: dict[str, Any] = {
    "name": APP_NAME,
    "model": TEST_DEPLOY["model"],
    "workers": {**TEST_DEPLOY["workers"], "graceful_shutdown_timeout_s": 2},  # two replicas, a CPU each
    "engine": {
        "num_kv_blocks": 128,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "max_model_len": 512,
        "num_scheduler_steps": 2,
        "compilation_cache_dir": "~/.cache/raylm/jax",
    },
    "router": {"max_queue_size": 32, "prefix_routing": {"stats_period_s": 0.5}},
}
NUM_REQUESTS = 12
PROMPT_TOKENS = 40
MAX_TOKENS = 16

# ray/autoscaler/_private/fake_multi_node/example.yaml (Ray's source tree; missing from the wheel).
_BASE_CONFIG: dict[str, Any] = {
    "cluster_name": "raylm_fake_multinode",
    "max_workers": 8,
    "provider": {
        "type": "fake_multinode",
        "use_node_id_as_ip": True,
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
    },
    "head_node_type": "ray.head.default",
    "auth": {},
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": 0.1,
    "docker": {},
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
}


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the process that started it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def processes_using(temp_dir: str) -> list[int]:
    """Ids of live Ray processes of the cluster whose private temp dir is ``temp_dir`` (never this
    process or the ones that started it): GCS, raylets and agents name a session dir inside it on
    their command line; workers retitle themselves (``ray::...``) but log into it (stdout/stderr)."""
    needle = os.path.join(temp_dir, "session_")
    skip = _ancestors()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in skip:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found = needle.encode() in f.read()
            for fd in (1, 2):
                if not found:
                    try:
                        found = os.readlink(f"/proc/{entry}/fd/{fd}").startswith(needle)
                    except OSError:
                        pass
        except OSError:
            continue
        if found:
            pids.append(int(entry))
    return pids


def tear_down_private_cluster(cluster: Any, temp_dir: str) -> list[int]:
    """End a scenario's own ``ray.cluster_utils.Cluster`` (disconnect, shut it down, SIGKILL any of
    its processes still alive, remove its temp dir); returns the ids of those that had to be killed."""
    try:
        ray.shutdown()
        cluster.shutdown()
    finally:
        leftovers = processes_using(temp_dir)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)
    return leftovers


class FakeAutoscalingCluster:
    """``ray.cluster_utils.AutoscalingCluster``, isolated from other Ray clusters on the machine.

    The head runs ``ray start --head --block`` in a new session, so it and everything it starts
    (GCS, raylets, the autoscaler monitor and the worker nodes the monitor launches) share one
    process group that ``shutdown`` ends; the temp dir is private, so ``ray_current_cluster``
    and the session dirs of other clusters are left alone.
    """

    def __init__(self, head_resources: dict[str, Any], worker_node_types: dict[str, Any], temp_dir: str,
                 idle_timeout_minutes: float = 10.0):
        self.head_resources = dict(head_resources)
        self.worker_node_types = worker_node_types
        self.temp_dir = temp_dir
        self.idle_timeout_minutes = idle_timeout_minutes
        self.process: subprocess.Popen | None = None
        self.gcs_address: str | None = None

    def _config(self) -> dict[str, Any]:
        config = json.loads(json.dumps(_BASE_CONFIG))
        config["provider"]["gcs_address"] = self.gcs_address  # workers join this GCS, not :6379
        config["idle_timeout_minutes"] = self.idle_timeout_minutes
        config["max_workers"] = sum(t.get("max_workers", 0) for t in self.worker_node_types.values())
        config["available_node_types"] = {
            **json.loads(json.dumps(self.worker_node_types)),
            "ray.head.default": {"resources": self.head_resources, "node_config": {}, "max_workers": 0},
        }
        return config

    def start(self, timeout_s: float = 90.0) -> str:
        """Start the head (and its autoscaler); returns the GCS address to ``ray.init``. A head
        whose raylet did not register with its GCS within the 30 s ``ray start`` allows (fixed in
        ray/_private/node.py; seen in CI with both test workers busy) is stopped and started
        once more: the machine's load, not the cluster under test."""
        try:
            return self._start_head(timeout_s)
        except RuntimeError:
            if STARTUP_TIMED_OUT not in self.start_log():
                raise
        self.shutdown()
        return self._start_head(timeout_s)

    def start_log(self) -> str:
        try:
            with open(os.path.join(self.temp_dir, "ray_start.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _start_head(self, timeout_s: float) -> str:
        port = free_port()
        self.gcs_address = f"{ray.util.get_node_ip_address()}:{port}"
        config_path = os.path.join(self.temp_dir, "autoscaling.json")
        with open(config_path, "w") as f:
            json.dump(self._config(), f)
        resources = dict(self.head_resources)
        cmd = [
            shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray", "start", "--head", "--block",
            f"--port={port}",
            f"--temp-dir={self.temp_dir}",
            f"--autoscaling-config={config_path}",
            f"--num-cpus={resources.pop('CPU', 0)}",
            f"--num-gpus={resources.pop('GPU', 0)}",
            f"--object-store-memory={resources.pop('object_store_memory', 100 * MIB)}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        env = {
            **os.environ,
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            "RAY_FAKE_CLUSTER": "1",
            # Each node's raylet waits for its (Python) agents to report their ports; on a busy
            # 2-core machine importing them can take longer than the default allows.
            "RAY_agent_register_timeout_ms": "120000",
        }
        log = open(os.path.join(self.temp_dir, "ray_start.log"), "ab")
        self.process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        address_file = os.path.join(self.temp_dir, "ray_current_cluster")
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(address_file):
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.process.returncode}; see {self.temp_dir}/ray_start.log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the head did not start within {timeout_s} s")
            time.sleep(0.2)
        return self.gcs_address

    def monitor_log_lines(self, needle: str) -> list[str]:
        path = os.path.join(self.temp_dir, "session_latest", "logs", "monitor.log")
        try:
            with open(path, errors="replace") as f:
                return [line.rstrip() for line in f if needle in line]
        except OSError:
            return []

    def shutdown(self) -> list[int]:
        """Stop this cluster's processes only; returns the ids of any that had to be killed late."""
        if self.process is not None and self.process.poll() is None:
            pgid = self.process.pid  # a session leader: its pid is the group id
            for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    continue
                break
        # Stragglers outside the group (none expected): match this cluster's private temp dir.
        late = processes_using(self.temp_dir)
        for pid in late:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while processes_using(self.temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        return late


def alive_worker_nodes(head_node_id: str) -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head_node_id)


def head_node_id_of_cluster() -> str:
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

    ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    if FAKE_HEAD_NODE_ID in ids:
        return FAKE_HEAD_NODE_ID
    # Otherwise the head is the node with no CPU.
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and not n["Resources"].get("CPU"))


def worker_replica_states() -> dict[str, int]:
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None or WORKER_DEPLOYMENT not in app.deployments:
        return {}
    return {str(k): v for k, v in app.deployments[WORKER_DEPLOYMENT].replica_states.items()}


def send_completions(base_url: str, model: str) -> list[dict[str, Any]]:
    """NUM_REQUESTS concurrent completions with unrelated random token-id prompts."""
    rng = random.Random(0)
    prompts = [[rng.randint(1000, 30000) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_REQUESTS)]

    def one(prompt: list[int]) -> dict[str, Any]:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        try:
            r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=180)
        except httpx.HTTPError as err:
            return {"status": None, "error": repr(err)}
        out: dict[str, Any] = {"status": r.status_code}
        if r.status_code == 200:
            out["completion_tokens"] = r.json()["usage"]["completion_tokens"]
        else:
            out["error"] = r.text[:300]
        return out

    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
        return list(pool.map(one, prompts))


def run_scenario(cluster: FakeAutoscalingCluster, result: dict[str, Any], scale_timeout_s: float) -> None:
    from ray import serve

    from raylm.deploy.app_builder import build_application
    from raylm.deploy.config import parse_deploy_config

    t0 = time.monotonic()
    gcs_address = cluster.start()
    result["gcs_address"] = gcs_address
    ray.init(address=gcs_address, log_to_driver=False)
    head = head_node_id_of_cluster()
    result["head_node_id"] = head
    result["head_resources"] = next(n["Resources"] for n in ray.nodes() if n["NodeID"] == head)

    # The autoscaler brings up min_workers (1) worker node on its own.
    deadline = time.monotonic() + scale_timeout_s
    while len(alive_worker_nodes(head)) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError("the autoscaler did not start the min_workers node")
        time.sleep(0.5)
    result["seconds_to_first_worker_node"] = round(time.monotonic() - t0, 1)
    time.sleep(2)  # nothing else should come up unasked
    nodes_before = alive_worker_nodes(head)
    result["worker_nodes_before"] = nodes_before
    result["alive_nodes_before"] = len(nodes_before) + 1

    http_port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port})
    config = parse_deploy_config({**DEPLOY, "route_prefix": "/"})
    application = build_application(config)
    run_error: list[BaseException] = []

    def deploy() -> None:
        try:  # serve.run waits until the application is RUNNING, i.e. both replicas are up
            serve.run(application, name=config.name, route_prefix="/")
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            run_error.append(err)

    t_deploy = time.monotonic()
    threading.Thread(target=deploy, daemon=True).start()
    deadline = t_deploy + scale_timeout_s
    seconds_to_scale = seconds_to_running = None
    states: dict[str, int] = {}
    while seconds_to_scale is None or seconds_to_running is None:
        if run_error:
            raise RuntimeError(f"serve.run failed: {run_error[0]!r}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not scaled within {scale_timeout_s} s: worker nodes {alive_worker_nodes(head)}, "
                               f"replica states {states}")
        now = time.monotonic() - t_deploy
        if seconds_to_scale is None and len(alive_worker_nodes(head)) > len(nodes_before):
            seconds_to_scale = round(now, 1)
        states = worker_replica_states()
        if seconds_to_running is None and states.get("RUNNING", 0) == 2:
            seconds_to_running = round(now, 1)
        time.sleep(0.5)
    result["seconds_to_scale"] = seconds_to_scale
    result["seconds_to_replicas_running"] = seconds_to_running
    result["replica_states"] = states
    nodes_after = alive_worker_nodes(head)
    result["worker_nodes_after"] = nodes_after
    result["alive_nodes_after"] = len(nodes_after) + 1
    result["worker_node_resources"] = {
        n["NodeID"]: {k: v for k, v in n["Resources"].items() if not k.startswith("node:") and "memory" not in k}
        for n in ray.nodes() if n["Alive"] and n["NodeID"] != head
    }
    result["autoscaler_launches"] = cluster.monitor_log_lines(f"Adding 1 node(s) of type {WORKER_NODE_TYPE}")

    base_url = f"http://127.0.0.1:{http_port}"
    wait_healthy(base_url, 120)
    from raylm.workers.wire.replica_protocol import replica_reports

    before = replica_reports(APP_NAME)
    result["replica_nodes"] = {rid: r.node_id for rid, r in sorted(before.items())}
    t_requests = time.monotonic()
    responses = send_completions(base_url, config.served_model_name)
    result["seconds_for_requests"] = round(time.monotonic() - t_requests, 1)
    result["statuses"] = [r["status"] for r in responses]
    result["completion_tokens"] = [r.get("completion_tokens") for r in responses]
    result["errors"] = [r["error"] for r in responses if "error" in r][:3]
    after = replica_reports(APP_NAME)
    result["replica_requests"] = {
        rid: after[rid].engine.requests - (before[rid].engine.requests if rid in before else 0) for rid in sorted(after)}
    app = serve.status().applications[APP_NAME]
    result["app_status"] = str(app.status.value if hasattr(app.status, "value") else app.status)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temp-dir", help="the cluster's private Ray temp dir (short: socket paths live in it)")
    parser.add_argument("--scale-timeout", type=float, default=240.0)
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below on SIGTERM
    temp_dir = args.temp_dir or tempfile.mkdtemp(prefix="rlmn-", dir="/tmp")
    os.makedirs(temp_dir, exist_ok=True)
    cluster = FakeAutoscalingCluster(HEAD_RESOURCES, WORKER_NODE_TYPES, temp_dir)
    result: dict[str, Any] = {"ok": False, "temp_dir": temp_dir}
    t0 = time.monotonic()
    try:
        run_scenario(cluster, result, args.scale_timeout)
        result["ok"] = True
    except BaseException as err:  # noqa: BLE001 - reported in the JSON line
        result["error"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    finally:
        from ray import serve

        for step in (serve.shutdown, ray.shutdown):
            try:
                if ray.is_initialized():
                    step()
            except Exception:  # noqa: BLE001 - keep tearing down
                traceback.print_exc()
        result["late_killed_pids"] = cluster.shutdown()
        result["leftover_pids"] = processes_using(temp_dir)
        result["seconds_total"] = round(time.monotonic() - t0, 1)
        if result["ok"] and not args.temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
        print(json.dumps(result, sort_keys=True), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
