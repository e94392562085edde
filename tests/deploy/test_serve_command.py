"""``raylm serve CONFIG --address ...`` in a subprocess: deploys, answers, and Ctrl-C removes it
quietly (none of Ray's task-failure lines a user would read as an error)."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.test_one_import_name import shadowing_folder
from tests.serving import free_port

# What Ray prints when serve.shutdown() waits on the controller that kills itself.
SHUTDOWN_NOISE = "killed by `ray.kill`"


def _lines(proc: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for(lines: queue.Queue, needle: str, timeout_s: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} not printed; output was:\n{''.join(seen)}")


def _rest(lines: queue.Queue) -> str:
    """Everything printed until the process closed its output."""
    seen: list[str] = []
    while (line := lines.get(timeout=60)) is not None:
        seen.append(line)
    return "".join(seen)


def _start_serve(serve_cluster, tmp_path, name: str, route_prefix: str, **options) -> subprocess.Popen:
    """``raylm serve`` of a one-replica app attached to the test cluster, output piped."""
    import ray

    address = ray.get_runtime_context().gcs_address
    return _raylm_serve(tmp_path, name, route_prefix, serve_cluster.http_port, address, **options)


# What a non-interactive shell does to a command it starts in the background (``cmd &``): SIGINT
# ignored, which exec keeps. Done by a shell rather than a ``preexec_fn``, which makes Python fork
# this multithreaded test process (gRPC's fork handlers then abort the child now and then).
_IN_THE_BACKGROUND = ["sh", "-c", 'trap "" INT; exec "$0" "$@"']


def _raylm_serve(tmp_path, name: str, route_prefix: str, port: int, address: str,
                 background: bool = False, cwd: Path | None = None) -> subprocess.Popen:
    """``raylm serve`` of a one-replica app on the cluster at ``address``, output piped
    (``background``: started as a shell starts ``cmd &``; ``cwd``: run from there)."""
    config = {
        "name": name,
        "route_prefix": route_prefix,
        "workers": {"num_replicas": 1},
        "engine": {"num_kv_blocks": 64, "max_model_len": 512},
        "http": {"port": port},
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [str(Path(sys.executable).with_name("raylm")), "serve", str(path), "--address", address]
    return subprocess.Popen((_IN_THE_BACKGROUND if background else []) + command, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_serve_attaches_to_a_cluster_and_ctrl_c_removes_the_app(serve_cluster, raylm_app, tmp_path):
    proc = _start_serve(serve_cluster, tmp_path, "cli-app", "/cli")
    try:
        lines = _lines(proc)
        output = "".join(_wait_for(lines, "Press Ctrl-C to stop", timeout_s=240))
        base = f"http://127.0.0.1:{serve_cluster.http_port}/cli"
        assert f"raylm is serving smollm2-135m-instruct at {base}/v1" in output
        assert f"curl {base}/v1/chat/completions" in output
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        })
        assert reply.status_code == 200, reply.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert SHUTDOWN_NOISE not in _rest(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 404
    # The other application on the same cluster is untouched.
    assert httpx.get(f"{raylm_app.base_url}/v1/models", timeout=30).status_code == 200


def test_a_signal_during_start_up_stops_it_even_started_in_the_background(serve_cluster, tmp_path):
    proc = _start_serve(serve_cluster, tmp_path, "cli-early-stop", "/early", background=True)
    try:
        lines = _lines(proc)
        _wait_for(lines, "deploying smollm2-135m-instruct", timeout_s=240)
        proc.send_signal(signal.SIGINT)  # before the app is healthy
        assert proc.wait(timeout=120) == 0
        assert SHUTDOWN_NOISE not in _rest(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    from ray import serve

    assert "cli-early-stop" not in serve.status().applications
    assert httpx.get(f"http://127.0.0.1:{serve_cluster.http_port}/early/v1/models", timeout=30).status_code == 404


def test_on_a_cluster_of_its_own_ctrl_c_stops_serve_and_ray_quietly(tmp_path):
    """The ``make serve`` case: raylm serve started Ray and Serve, so Ctrl-C shuts both down, and
    prints nothing after "stopping ..." (Ray's line about the killed controller included). It
    runs from a folder holding the user's own ``model.py``, ``cache.py``, ... that raise on import."""
    port = free_port()
    users_folder = tmp_path / "project"
    users_folder.mkdir()
    proc = _raylm_serve(tmp_path, "alone", "/", port, "local", cwd=shadowing_folder(users_folder))
    try:
        lines = _lines(proc)
        _wait_for(lines, "Press Ctrl-C to stop", timeout_s=240)
        proc.send_signal(signal.SIGINT)
        stopped_at = time.monotonic()
        assert proc.wait(timeout=120) == 0
        assert time.monotonic() - stopped_at < 10
        after_stop = _rest(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert after_stop.strip() == "stopping ...", after_stop
    with pytest.raises(httpx.ConnectError):  # Serve's proxy went with the cluster
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)


def test_ctrl_c_stops_it_within_10_s_after_its_cluster_died(tmp_path):
    """raylm serve started Ray; the cluster's GCS is killed; Ctrl-C still ends raylm serve within
    10 s, and the Ray processes it started go with it."""
    import psutil

    proc = _raylm_serve(tmp_path, "orphan", "/", free_port(), "local")
    started: list[psutil.Process] = []
    try:
        lines = _lines(proc)
        _wait_for(lines, "Press Ctrl-C to stop", timeout_s=240)
        started = psutil.Process(proc.pid).children(recursive=True)
        [gcs] = [p for p in started if p.name() == "gcs_server"]
        gcs.kill()
        deadline = time.monotonic() + 10  # gone (or a zombie: raylm serve, its parent, reaps it)
        while gcs.is_running() and gcs.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2)  # the driver notices the lost GCS connection and starts retrying
        proc.send_signal(signal.SIGINT)
        stopped_at = time.monotonic()
        proc.wait(timeout=30)
        assert time.monotonic() - stopped_at < 10
    finally:
        if proc.poll() is None:
            proc.kill()
    _, alive = psutil.wait_procs([p for p in started if p.is_running()], timeout=20)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [p.name() for p in alive]
