"""``raylm serve CONFIG.yaml``: deploy the OpenAI server on a Ray cluster and keep it up.

Attaches to a running cluster (``--address``, or the one ``ray start`` left on this machine);
otherwise (or with ``--address local``) starts a local Ray head owned by this process. Ctrl-C
(or SIGTERM) deletes the application, and shuts Serve and Ray down when this process started
them, at any point, start-up included, and within ``STOP_LIMIT_S`` whatever state the cluster is
in: a cluster that does not answer (its GCS died) is left, and the Ray processes this one
started are killed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

from raylm.cluster.local_ray import apply_local_ray_env
from raylm.deploy.config import DeployConfig, DeployConfigError, load_deploy_config
from raylm.deploy.readiness import wait_healthy

DEFAULT_CONFIG = Path(__file__).with_name("default.yaml")
READY_TIMEOUT_S = 900.0  # model load + warm-up compile of every bucket on a slow machine
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_LIMIT_S = 8.0  # Ctrl-C to exit, a healthy cluster's clean-up included
# Of that, how long Serve may take to stop its replicas (each finishes the compile or step it is
# in) before the Ray head this process started is shut down under them.
SERVE_STOP_S = 4.0


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("serve", help="serve a model over the OpenAI HTTP API on Ray")
    p.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="deploy YAML (default: the bundled model)")
    p.add_argument(
        "--address", default=None,
        help="Ray cluster to attach to (e.g. auto, ray://host:10001); local: start a new one",
    )
    p.add_argument("--host", default=None, help="override http.host")
    p.add_argument("--port", type=int, default=None, help="override http.port")
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = load_deploy_config(args.config)
    except DeployConfigError as err:
        print(f"raylm serve: {err}", file=sys.stderr)
        return 2
    host = args.host or config.http.host
    port = config.http.port if args.port is None else args.port
    apply_local_ray_env()
    _stop_on_signals()
    try:
        return _serve(args, config, host, port)
    except KeyboardInterrupt:  # SIGINT or SIGTERM: _serve has cleaned up
        return 0


def _serve(args: argparse.Namespace, config: DeployConfig, host: str, port: int) -> int:
    import ray
    from ray import serve

    from raylm.deploy.app_builder import build_application
    from raylm.model.errors import ModelError

    try:
        app = build_application(config)
    except (ModelError, ValueError) as err:
        print(f"raylm serve: {err}", file=sys.stderr)
        return 2
    started_ray = _connect(ray, args.address)
    serve_was_running = _serve_running(ray)
    try:
        serve.start(http_options={"host": host, "port": port})
        print(f"deploying {config.served_model_name} ({_replicas(config)}) ...", file=sys.stderr, flush=True)
        serve.run(app, name=config.name, route_prefix=config.route_prefix, blocking=False)
        wait_healthy(_base_url(config, host, port), READY_TIMEOUT_S)
        _announce(config, host, port)
        threading.Event().wait()  # until a signal raises KeyboardInterrupt
    finally:
        for sig in STOP_SIGNALS:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        print("\nstopping ...", file=sys.stderr, flush=True)
        _stop_within(ray, config.name, serve_was_running, started_ray)
    return 0


def _stop_within(ray, app_name: str, serve_was_running: bool, started_ray: bool) -> None:
    """Remove the app (or Serve, if this process started it) and the Ray head this process
    started, on a helper thread given ``STOP_LIMIT_S``. Every step waits on the cluster's GCS;
    when that has died the calls retry for minutes, so past the limit the Ray processes this
    process started are killed and it exits at once (Ray's own exit hook would wait again)."""
    from ray import serve

    def clean_up() -> None:
        if serve_was_running:
            serve.delete(app_name)
        else:
            _shutdown_serve(ray, SERVE_STOP_S)
        if started_ray:
            ray.shutdown()

    worker = threading.Thread(target=clean_up, name="raylm-serve-stop", daemon=True)
    worker.start()
    worker.join(STOP_LIMIT_S)
    if not worker.is_alive():
        return
    if started_ray:  # the head's processes and their workers all descend from this process
        import psutil

        print(f"raylm serve: the clean-up did not finish within {STOP_LIMIT_S:.0f} s; killed the Ray processes "
              "raylm serve started", file=sys.stderr, flush=True)
        for process in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        os._exit(0)  # now, not through Ray's exit hook, which would wait on the cluster again
    print(f"raylm serve: the Ray cluster did not answer within {STOP_LIMIT_S:.0f} s; application {app_name!r} may "
          "still be there", file=sys.stderr, flush=True)
    os._exit(1)


def _connect(ray, address: str | None) -> bool:
    """Attach to ``address`` or a cluster already running here; else (or for ``local``) start
    one. True if started."""
    if address not in (None, "local"):
        ray.init(address=address, log_to_driver=False)
        return False
    if address is None:
        try:
            ray.init(address="auto", log_to_driver=False)
            return False
        except ConnectionError:
            pass
    ray.init(address="local", log_to_driver=False, include_dashboard=True, dashboard_host="127.0.0.1")
    return True


def _serve_controller(ray):
    """Serve's controller actor on the cluster, or None when Serve does not run there."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return None


def _serve_running(ray) -> bool:
    """Whether Serve's controller already runs on the cluster (then we only remove our app)."""
    return _serve_controller(ray) is not None


def _shutdown_serve(ray, timeout_s: float) -> None:
    """Shut Serve down without the warning ``serve.shutdown()`` makes Ray print.

    ``serve.shutdown()`` waits on a controller call that only ends when the controller, having
    deleted every application and proxy, kills itself; Ray then reports that call as
    "Task ServeController.graceful_shutdown failed ... killed by ray.kill", which reads like an
    error. Here the call only raises the controller's shutdown flag and returns; the same
    shutdown then runs in the controller's loop while this process waits up to ``timeout_s`` for
    the actor to go (past that it goes on by itself, or goes with the Ray head).
    """
    controller = _serve_controller(ray)
    if controller is None:
        return
    ray.get(controller.graceful_shutdown.remote(wait=False))
    deadline = time.monotonic() + timeout_s
    while _serve_controller(ray) is not None and time.monotonic() < deadline:
        time.sleep(0.2)


def _replicas(config: DeployConfig) -> str:
    scaling = config.workers.autoscaling_config
    if scaling is not None:
        return f"{scaling.min_replicas}..{scaling.max_replicas} worker replicas, autoscaling"
    count = config.workers.num_replicas or 1
    return f"{count} worker replica{'s' if count != 1 else ''}"


def _base_url(config: DeployConfig, host: str, port: int) -> str:
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{shown_host}:{port}{config.route_prefix.rstrip('/')}"


def _announce(config: DeployConfig, host: str, port: int) -> None:
    base = _base_url(config, host, port)
    print(
        f"\nraylm is serving {config.served_model_name} at {base}/v1\n\n"
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"model\": \"{config.served_model_name}\", "
        f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n\n"
        "Press Ctrl-C to stop.",
        flush=True,
    )


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt from here on, wherever the main thread is.
    Installed before Ray starts, so a signal during start-up stops the server too: a process
    started in the background by a non-interactive shell begins with SIGINT ignored, and
    SIGTERM's default would exit without the clean-up."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in STOP_SIGNALS:
        signal.signal(sig, interrupt)
