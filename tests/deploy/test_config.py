"""The deploy YAML schema: shipped files validate, mistakes are named by their key path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raylm.deploy.app_builder import replica_placement, worker_actor_options
from raylm.deploy.config import DeployConfigError, load_deploy_config, parse_deploy_config
from raylm.workers.engine.engine_args import EngineArgs

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"


def test_default_yaml_serves_the_bundled_model():
    config = load_deploy_config(DEPLOY_DIR / "default.yaml")
    assert config.model.name == "smollm2-135m-instruct"
    assert config.http.host == "127.0.0.1"
    args = config.engine_args()
    assert isinstance(args, EngineArgs) and args.dtype == "float32" and args.tensor_parallel_size == 1


def test_serve_config_file_args_are_a_valid_deploy_config():
    serve_config = yaml.safe_load((DEPLOY_DIR / "serve_config.yaml").read_text())
    (app,) = serve_config["applications"]
    assert app["import_path"] == "raylm.deploy.app_builder:build_app"
    parse_deploy_config(app["args"])


def test_every_engine_arg_is_settable_from_yaml():
    config = parse_deploy_config({"engine": {"num_kv_blocks": 64, "max_num_seqs": 8, "scheduling_policy": "priority"},
                                  "workers": {"tensor_parallel_size": 2, "expert_parallel_size": 2},
                                  "model": {"dtype": "bfloat16", "quantization": "int8", "gguf_blocks": "expand"}})
    args = config.engine_args()
    assert (args.num_kv_blocks, args.max_num_seqs, args.scheduling_policy) == (64, 8, "priority")
    assert (args.tensor_parallel_size, args.dtype, args.quantization) == (2, "bfloat16", "int8")
    assert args.expert_parallel_size == 2 and args.num_devices == 4
    assert args.gguf_blocks == "expand" and not args.keep_gguf_blocks()
    assert args.activation_quantization == "none"
    int8 = parse_deploy_config({"model": {"activation_quantization": "int8", "quantization": "int8_g32"}})
    assert int8.engine_args().activation_quantization == "int8"


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"workers": {"num_replica": 2}}, "workers.num_replica: unknown key"),
        ({"engine": {"block_sise": 16}}, "engine.block_sise: unknown key"),
        ({"engine": {"block_size": 12}}, "block_size must be a power of two"),
        ({"engine": {"gpu_attention": "triton"}}, "gpu_attention must be pallas or jnp, got 'triton'"),
        ({"engine": {"max_num_seqs": "many"}}, "engine.max_num_seqs"),
        ({"model": {"dtype": "int3"}}, "model.dtype"),
        ({"model": {"quantization": "int4"}}, "model.quantization"),
        ({"engine": {"quantization": "int8"}}, "engine.quantization: unknown key"),
        ({"model": {"gguf_blocks": "sometimes"}}, "model.gguf_blocks"),
        ({"model": {"activation_quantization": "int4"}}, "model.activation_quantization"),
        ({"model": {"activation_quantization": "int8", "quantization": "fp8"}},
         "activation_quantization int8 computes GGUF block and int8 weights in integers, not fp8"),
        ({"model": {"activation_quantization": "int8"}, "workers": {"tensor_parallel_size": 3}},
         "activation_quantization int8 runs a CPU kernel on one device; got 3"),
        ({"model": {"gguf_blocks": "keep"}, "workers": {"tensor_parallel_size": 3}},
         "gguf_blocks=keep serves a float32 model on one device"),
        ({"workers": {"num_replicas": 2, "autoscaling_config": {"max_replicas": 3}}}, "not both"),
        ({"workers": {"autoscaling_config": {"min_replicas": 4, "max_replicas": 2}}}, "exceeds max_replicas"),
        ({"workers": {"num_gpus": -1}}, "workers.num_gpus"),
        ({"workers": {"num_gpus": 2, "tensor_parallel_size": 2, "expert_parallel_size": 2}},
         "num_gpus is 2 but tensor_parallel_size x expert_parallel_size is 4"),
        ({"workers": {"num_hosts": 2, "tensor_parallel_size": 3}},
         "num_hosts is 2 but tensor_parallel_size x expert_parallel_size is 3: each host gives the mesh the same"),
        ({"workers": {"num_hosts": 2, "tensor_parallel_size": 4, "num_gpus": 4}},
         "num_gpus is 4 but tensor_parallel_size x expert_parallel_size is 4 over num_hosts=2"),
        ({"workers": {"num_hosts": 2, "tensor_parallel_size": 2}, "engine": {"enable_lora": True}},
         "engine: num_hosts=2: a mesh over several hosts does not support enable_lora yet"),
        ({"engine": {"num_hosts": 2}}, "engine.num_hosts: unknown key"),
        ({"http": {"port": 70000}}, "http.port"),
        ({"htp": {}}, "htp: unknown key"),
        ({"model": {"lora_modules": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]}}, "distinct"),
        ({"model": {"lora_modules": [{"name": "a"}]}}, "model.lora_modules.0.path"),
        ({"model": {"reasoning_parser": "o1"}}, "model.reasoning_parser"),
        ({"model": {"tool_call_parser": "xml"}}, "model.tool_call_parser"),
        ({"engine": {"max_loras": 4, "max_cpu_loras": 2}}, "max_cpu_loras must be an integer >= max_loras"),
        ({"engine": {"lora_dtype": "float16"}}, "lora_dtype must be one of"),
        ({"router": {"responses_store": {"max_bytes": 0}}}, "router.responses_store.max_bytes"),
        ({"router": {"responses_store": {"max_age": 60}}}, "router.responses_store.max_age: unknown key"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_mistakes_are_named(raw, message):
    with pytest.raises(DeployConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        parse_deploy_config(raw)


def test_num_hosts_reaches_the_engine_and_places_one_bundle_per_host():
    """Each host's actor gets the workers' resources and a device count of mesh / num_hosts, on
    nodes of its own (STRICT_SPREAD) unless host_placement packs them; one host needs no placement group."""
    config = parse_deploy_config({"workers": {"num_hosts": 2, "tensor_parallel_size": 4, "num_cpus": 2}})
    assert config.engine_args().num_hosts == 2 and config.engine_args().num_devices == 4
    options = worker_actor_options(config)
    assert options["runtime_env"]["env_vars"]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert replica_placement(config, config.workers) == {
        "placement_group_bundles": [{"CPU": 2.0}, {"CPU": 2.0}], "placement_group_strategy": "STRICT_SPREAD"}
    assert replica_placement(parse_deploy_config({}), parse_deploy_config({}).workers) == {}
    packed = parse_deploy_config({"workers": {"num_hosts": 2, "tensor_parallel_size": 2, "host_placement": "PACK"}})
    assert replica_placement(packed, packed.workers)["placement_group_strategy"] == "PACK"
    # One device per host: still set, so a node's forced device count cannot leak into the mesh.
    assert worker_actor_options(packed)["runtime_env"]["env_vars"]["XLA_FLAGS"].endswith("count=1")


def test_lora_modules_turn_lora_on_and_are_the_router_s_models():
    from raylm.deploy.app_builder import router_settings
    from raylm.workers.core.lora_adapters import LoRARequest

    config = parse_deploy_config({"model": {"lora_modules": [{"name": "sql", "path": "/adapters/sql"}]},
                                  "engine": {"max_loras": 2, "max_lora_rank": 8, "lora_dtype": "bfloat16"}})
    args = config.engine_args()
    assert args.enable_lora and (args.max_loras, args.max_lora_rank, args.lora_dtype) == (2, 8, "bfloat16")
    assert config.model.lora_requests() == [LoRARequest("sql", 1, "/adapters/sql")]
    assert router_settings(config).lora_modules == {"sql": "/adapters/sql"}
    assert not parse_deploy_config({}).engine_args().enable_lora


def test_the_model_s_parsers_reach_the_router():
    from raylm.deploy.app_builder import router_settings

    settings = router_settings(parse_deploy_config({"model": {"reasoning_parser": "deepseek_r1",
                                                              "tool_call_parser": "mistral"}}))
    assert (settings.reasoning_parser, settings.tool_call_parser) == ("deepseek_r1", "mistral")
    default = router_settings(parse_deploy_config({}))
    assert (default.reasoning_parser, default.tool_call_parser) == ("auto", "auto")  # the chat template's
    from raylm.router.reasoning import REASONING_PARSERS
    from raylm.router.tool_parsers import TOOL_CALL_PARSERS

    for name in TOOL_CALL_PARSERS:  # every format the router reads can be named in the deploy file
        assert router_settings(parse_deploy_config({"model": {"tool_call_parser": name}})).tool_call_parser == name
    for name in REASONING_PARSERS:
        assert router_settings(parse_deploy_config({"model": {"reasoning_parser": name}})).reasoning_parser == name


def test_the_responses_store_limits_reach_the_router():
    from raylm.deploy.app_builder import router_settings

    settings = router_settings(parse_deploy_config({"router": {"responses_store": {"max_bytes": 4096,
                                                                                   "max_age_s": 60}}}))
    assert (settings.responses_store_max_bytes, settings.responses_store_max_age_s) == (4096, 60)
    default = load_deploy_config(DEPLOY_DIR / "default.yaml").router.responses_store
    assert (default.max_bytes, default.max_age_s) == (256 << 20, 86400)


def test_unreadable_files_say_so(tmp_path):
    with pytest.raises(DeployConfigError, match="cannot read"):
        load_deploy_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(DeployConfigError, match="not valid YAML"):
        load_deploy_config(bad)


def test_serve_cli_reports_a_bad_config_without_starting_ray(tmp_path, capsys):
    from raylm.deploy.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("workers:\n  num_replica: 2\n")
    assert main(["serve", str(bad)]) == 2
    assert "workers.num_replica: unknown key" in capsys.readouterr().err


def test_pipeline_stages_are_one_placement_group_of_the_replica():
    """``workers.pipeline_parallel_size``: the engine splits the layers, and each replica is a
    placement group of one bundle per stage (the replica's own resources each), spread or packed."""
    raw = {"workers": {"pipeline_parallel_size": 3, "num_cpus": 2, "memory_bytes": 1 << 30}}
    config = parse_deploy_config(raw)
    args = config.engine_args()
    assert (args.pipeline_parallel_size, args.pipeline_placement) == (3, "spread")
    options = replica_placement(config, config.workers)
    assert options == {"placement_group_bundles": [{"CPU": 2.0, "memory": 1 << 30}] * 3,
                       "placement_group_strategy": "SPREAD"}
    packed = parse_deploy_config({"workers": {"pipeline_parallel_size": 2, "pipeline_placement": "pack"}})
    assert replica_placement(packed, packed.workers)["placement_group_strategy"] == "PACK"
    assert replica_placement(parse_deploy_config({}), parse_deploy_config({}).workers) == {}
    with pytest.raises(DeployConfigError, match="pipeline_placement"):
        parse_deploy_config({"workers": {"pipeline_placement": "local"}})
    with pytest.raises(DeployConfigError, match="num_hosts=2: pipeline stages over a mesh"):
        parse_deploy_config({"workers": {"pipeline_parallel_size": 2, "num_hosts": 2, "tensor_parallel_size": 2}})
