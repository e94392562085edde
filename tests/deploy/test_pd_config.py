"""Worker roles in the deploy file: a ``prefill_workers`` section beside ``workers`` disaggregates
prefill from decode; the application gets a prefill deployment and the router its handle."""

from __future__ import annotations

import pytest

from raylm.cluster.names import PREFILL_WORKER_DEPLOYMENT, WORKER_DEPLOYMENT
from raylm.deploy.config import DeployConfigError, parse_deploy_config

CLUSTER_TIER = {"kv_offload": {"cluster_bytes": 1 << 28, "load_timeout_s": 3.0}}
PD = {"prefill_workers": {"num_replicas": 2, "num_cpus": 2, "tensor_parallel_size": 2, "timeout_s": 5},
      "workers": {"num_replicas": 3}, "engine": CLUSTER_TIER}


def test_without_prefill_workers_each_replica_does_both():
    config = parse_deploy_config({"workers": {"num_replicas": 2}})
    assert config.prefill_workers is None and config.worker_role == "both"
    assert parse_deploy_config({"workers": {"role": "both"}}).worker_role == "both"


@pytest.mark.parametrize("role", [None, "decode"])
def test_prefill_workers_make_the_workers_decode(role):
    raw = {**PD, "workers": {**PD["workers"], **({"role": role} if role else {})}}
    config = parse_deploy_config(raw)
    assert config.worker_role == "decode"
    assert config.prefill_workers.num_replicas == 2 and config.prefill_workers.timeout_s == 5
    # Both groups share the model and the engine; each has its own mesh.
    decode, prefill = config.engine_args(), config.engine_args(config.prefill_workers)
    assert (decode.tensor_parallel_size, prefill.tensor_parallel_size) == (1, 2)
    assert decode.kv_offload == prefill.kv_offload and decode.kv_offload.cluster_bytes == 1 << 28
    assert decode.num_kv_blocks == prefill.num_kv_blocks and decode.block_size == prefill.block_size


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"prefill_workers": {}}, "prefill_workers needs the cluster KV tier to hand prompts' KV to the decode "
                                  "replicas: set engine.kv_offload.cluster_bytes"),
        ({"prefill_workers": {}, "engine": {"kv_offload": {"host_bytes": 1 << 20}}},
         "set engine.kv_offload.cluster_bytes"),
        ({"workers": {"role": "prefill"}}, "workers.role: prefill replicas go in a prefill_workers section"),
        ({"workers": {"role": "decode"}}, "workers.role is decode but there is no prefill_workers section"),
        ({**PD, "workers": {"role": "both"}}, "workers.role is both but prefill_workers is set"),
        ({**PD, "prefill_workers": {"role": "decode"}}, "prefill_workers.role can only be prefill"),
        ({**PD, "prefill_workers": {"timeout_s": 0}}, "prefill_workers.timeout_s"),
        ({**PD, "prefill_workers": {"num_replica": 1}}, "prefill_workers.num_replica: unknown key"),
        ({"workers": {"timeout_s": 5}}, "workers.timeout_s: unknown key"),
        ({"workers": {"role": "mixed"}}, "workers.role"),
        ({**PD, "prefill_workers": {"num_gpus": 1, "tensor_parallel_size": 2}},
         "num_gpus is 1 but tensor_parallel_size x expert_parallel_size is 2"),
    ],
)
def test_impossible_roles_are_refused_naming_the_key(raw, message):
    with pytest.raises(DeployConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        parse_deploy_config(raw)


def _bound(app) -> dict:
    """A bound worker deployment's name, role, handoff timeout, replicas and routing knobs."""
    deployment = app._bound_deployment
    config = deployment._deployment_config
    return {"name": deployment.name, "role": deployment.init_kwargs["role"],
            "handoff_s": deployment.init_kwargs.get("kv_handoff_timeout_s"), "replicas": config.num_replicas,
            "threshold": config.request_router_config.request_router_kwargs["imbalance_threshold_tokens"],
            "cpus": deployment._replica_config.ray_actor_options["num_cpus"]}


def test_a_disaggregated_app_has_a_prefill_deployment_beside_the_decoding_workers():
    from raylm.deploy.app_builder import build_application

    router = build_application(parse_deploy_config(PD))._bound_deployment
    worker, settings, prefill = router.init_args
    assert _bound(worker) == {"name": WORKER_DEPLOYMENT, "role": "decode", "handoff_s": 3.0, "replicas": 3,
                              "threshold": 0, "cpus": 1.0}  # decode replicas: chosen by load
    assert _bound(prefill) == {"name": PREFILL_WORKER_DEPLOYMENT, "role": "prefill", "handoff_s": 3.0, "replicas": 2,
                               "threshold": 2048, "cpus": 2.0}  # prefill replicas: prefix-aware
    assert prefill._bound_deployment._replica_config.ray_actor_options["runtime_env"] == {
        "env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}}  # its own mesh of two
    assert settings.prefill_timeout_s == 5

    colocated = build_application(parse_deploy_config({"workers": {"num_replicas": 2}}))._bound_deployment
    worker, settings, prefill = colocated.init_args
    assert prefill is None and _bound(worker)["role"] == "both" and _bound(worker)["threshold"] == 2048
