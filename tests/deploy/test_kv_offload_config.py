"""``engine.kv_offload`` in the deploy file: sizes with units reach the engine's KVOffloadConfig,
impossible tier settings are refused naming their key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raylm.cache.offload.config import KVOffloadConfig
from raylm.deploy.config import DeployConfigError, parse_deploy_config


def _engine_offload(section: dict, **sections) -> KVOffloadConfig | None:
    return parse_deploy_config({"engine": {"kv_offload": section}, **sections}).engine_args().kv_offload


def test_tiers_reach_the_engine_in_bytes():
    text = """
engine:
  kv_offload:
    host_bytes: 8GiB
    cluster_bytes: 512MB
    disk_path: ~/raylm-kv
    disk_bytes: 1073741824
    load_timeout_s: 2.5
"""
    offload = parse_deploy_config(yaml.safe_load(text)).engine_args().kv_offload
    assert offload == KVOffloadConfig(host_bytes=8 * 2**30, cluster_bytes=512 * 10**6,
                                      disk_path=str(Path.home() / "raylm-kv"), disk_bytes=2**30, load_timeout_s=2.5)


def test_offload_is_off_unless_a_tier_has_a_size():
    assert parse_deploy_config({}).engine_args().kv_offload is None
    assert _engine_offload({}) is None
    assert _engine_offload({"host_bytes": 0, "load_timeout_s": 1}) is None
    assert _engine_offload({"cluster_bytes": "1MiB"}) == KVOffloadConfig(cluster_bytes=2**20)


@pytest.mark.parametrize("section, message", [
    ({"host_bytes": "8G"}, "engine.kv_offload.host_bytes: unknown unit 'G' ('G' alone is ambiguous"),
    ({"cluster_bytes": -1}, "engine.kv_offload.cluster_bytes: a size in bytes must be >= 0"),
    ({"host_bytes": "0.5B"}, "engine.kv_offload.host_bytes: a size must be a whole number of bytes"),
    ({"disk_path": "/kv", "disk_bytes": "4 parsecs"}, "engine.kv_offload.disk_bytes: unknown unit 'parsecs'"),
    ({"disk_bytes": "1GiB"}, "engine.kv_offload.disk_bytes: the disk tier needs engine.kv_offload.disk_path"),
    ({"disk_path": "/kv"}, "engine.kv_offload.disk_bytes: engine.kv_offload.disk_path is '/kv', but the disk "
                           "tier has no size"),
    ({"disk_path": "kv", "disk_bytes": "1GiB"}, "engine.kv_offload.disk_path: must be an absolute directory"),
    ({"load_timeout_s": 0}, "engine.kv_offload.load_timeout_s"),
    ({"load_timeout_s": float("nan")}, "engine.kv_offload.load_timeout_s"),
    ({"host_byte": 1}, "engine.kv_offload.host_byte: unknown key"),
])
def test_impossible_settings_are_named(section, message):
    with pytest.raises(DeployConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        parse_deploy_config({"engine": {"kv_offload": section}})


def test_settings_against_the_rest_of_the_file_are_named():
    with pytest.raises(DeployConfigError, match="kv_offload .* needs enable_prefix_caching"):
        parse_deploy_config({"engine": {"enable_prefix_caching": False, "kv_offload": {"host_bytes": "1GiB"}}})
    with pytest.raises(DeployConfigError, match=r"engine\.kv_offload\.host_bytes \(8\.0 GiB\) exceeds "
                                                r"workers\.memory_bytes \(4\.0 GiB\)"):
        parse_deploy_config({"engine": {"kv_offload": {"host_bytes": "8GiB"}}, "workers": {"memory_bytes": 4 << 30}})
    fits = _engine_offload({"host_bytes": "4GiB"}, workers={"memory_bytes": 4 << 30})
    assert fits is not None and fits.host_bytes == 4 << 30
