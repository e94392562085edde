"""The benchmark GGUF writer writes files raylm reads as the family it names (every tensor used,
none missing), at tiny shapes."""

from __future__ import annotations

import gguf
import pytest

from raylm.benchmarks.make_family_gguf import (
    GPT_OSS_20B_CONTEXT,
    GPT_OSS_20B_WINDOW,
    GPT_OSS_20B_YARN,
    V2_LITE_YARN,
    write_family_gguf,
)
from raylm.model.config.latent_attention import LatentAttention
from raylm.model.loaders.gguf_file import GGUFFile
from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint
from tests.gguf_export import _write_deepseek2, export_gguf, released_gpt_oss_types

T = gguf.GGMLQuantizationType


def _vocab(path) -> None:
    """A byte-level vocabulary GGUF to copy the tokenizer from."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list(bytes_to_unicode().values()))
    writer.add_token_types([gguf.TokenType.NORMAL] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "qwen3moe"])
def test_written_file_loads_as_its_family(arch, tmp_path):
    _vocab(tmp_path / "vocab.gguf")
    out = write_family_gguf(tmp_path / f"{arch}.gguf", tmp_path / "vocab.gguf", arch, "Q8_0",
                            layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=32, experts=4)
    model = load_model(out, keep_blocks=True)
    config = model.config
    assert (config.num_layers, config.hidden_size, config.head_dim, config.vocab_size) == (2, 64, 32, 256)
    assert config.tie_word_embeddings and config.qk_norm == (arch != "gemma2")
    if arch == "qwen3moe":  # every layer sparse, the experts kept in their blocks, the router F32
        assert (config.moe.num_experts, config.moe.top_k, config.moe.expert_size) == (4, 2, 128)
        assert config.moe.norm_topk_prob and all(config.moe.sparse_layers)
        layer = model.params.layers[0]
        assert type(layer.w_experts_gate_up).__name__ == type(layer.w_experts_down).__name__ == "GgufBlocks"
    if arch == "gemma2":
        assert config.layer_windows == (4096, None) and (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    assert len(model.tokenizer.encode("hello")) == 5


def test_deepseek2_file_states_what_the_converter_writes_and_serves(tmp_path):
    """V2-Lite's layout at tiny sizes: the deepseek2 keys are those tests/gguf_export.py (the
    converter's DeepseekV2Model) writes for V2-Lite's config.json at these sizes; raylm reads its
    latent attention, dense layer 0, routed and shared experts and YaRN; the engine generates."""
    _vocab(tmp_path / "vocab.gguf")
    mla = LatentAttention(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    out = write_family_gguf(tmp_path / "ds.gguf", tmp_path / "vocab.gguf", "deepseek2", "Q8_0", layers=2, hidden=64,
                            ffn=64, heads=4, experts=4, top_k=2, mla=mla, dense_ffn=128, shared_experts=2)
    v2_lite = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 256, "q_lora_rank": None,
               "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
               "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 64, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
               "norm_topk_prob": False, "scoring_func": "softmax", "topk_method": "greedy", "n_group": 1,
               "topk_group": 1}
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "mscale": V2_LITE_YARN["mscale_all_dim"], **V2_LITE_YARN}
    writer = gguf.GGUFWriter(str(tmp_path / "keys.gguf"), "deepseek2")
    _write_deepseek2(writer, v2_lite, rope, split_kv_b=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = {k: v for k, v in GGUFFile(tmp_path / "keys.gguf").fields.items() if k.startswith("deepseek2.")}
    del expected["deepseek2.expert_weights_norm"]  # (False: today's converter leaves it out)
    fields = GGUFFile(out).fields
    assert {k: fields.get(k) for k in expected} == pytest.approx(expected)
    assert fields["deepseek2.attention.q_lora_rank"] == 0  # (llama.cpp reads it unless the file has 27 layers)

    model = load_model(out, keep_blocks=True)
    config = model.config
    assert config.mla == mla and config.num_layers == 2 and not config.tie_word_embeddings
    assert (config.moe.num_experts, config.moe.top_k, config.moe.expert_size) == (4, 2, 64)
    assert config.moe.sparse_layers == (False, True) and config.moe.shared_expert_size == 128
    assert config.moe.deepseek.scoring == "softmax" and not config.moe.norm_topk_prob
    assert config.intermediate_size == 128 and config.rope_scaling.factor == 40.0
    assert config.rope_scaling.mscale_all_dim == pytest.approx(0.707)
    assert type(model.params.layers[1].w_experts_down).__name__ == "GgufBlocks"
    llm = LLM(model, max_model_len=32, num_kv_blocks=8, max_num_seqs=1, warmup=False)
    [output] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0,
                                                                             ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 3


def test_gpt_oss_file_is_the_converters_layout_and_serves(tmp_path):
    """gpt-oss-20b's layout at tiny sizes: every tensor's name, shape and type, and the keys, as
    tests/gguf_export.py (the converter's GptOssModel) writes a tiny gpt-oss checkpoint of the same
    sizes with gpt-oss-20b's window and YaRN (MXFP4 experts, Q8_0 matrices, F32 router as the
    released files hold them); raylm reads its sinks, windows, biased experts and YaRN; the engine
    generates."""
    _vocab(tmp_path / "vocab.gguf")
    out = write_family_gguf(tmp_path / "oss.gguf", tmp_path / "vocab.gguf", "gpt-oss", "Q8_0", layers=2, hidden=64,
                            ffn=32, heads=4, kv_heads=2, head_dim=64, experts=4, top_k=2)
    directory, _ = build_tiny_checkpoint(
        "gpt-oss", tmp_path / "hf", num_hidden_layers=2, vocab_size=256, sliding_window=GPT_OSS_20B_WINDOW,
        max_position_embeddings=GPT_OSS_20B_CONTEXT, rope_parameters={**GPT_OSS_20B_YARN, "truncate": False})
    released = export_gguf(directory, tmp_path / "converted.gguf", released_gpt_oss_types)

    def layout(path):
        return {t.name: (tuple(t.shape), t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}

    assert layout(out) == layout(released)
    expected = {k: v for k, v in GGUFFile(released).fields.items() if k.startswith("gpt-oss.")}
    fields = GGUFFile(out).fields
    assert {k: fields.get(k) for k in expected} == pytest.approx(expected)
    # (the converter writes the betas too; the test exporter leaves them out)
    assert (fields["gpt-oss.rope.scaling.yarn_beta_fast"], fields["gpt-oss.rope.scaling.yarn_beta_slow"]) == (32, 1)

    model = load_model(out, keep_blocks=True)
    config = model.config
    assert config.attention_sinks and config.o_proj_bias and config.attention_bias
    assert config.layer_windows == (GPT_OSS_20B_WINDOW, None) and not config.tie_word_embeddings
    assert (config.moe.num_experts, config.moe.top_k, config.moe.expert_size) == (4, 2, 32)
    assert config.moe.router_bias and config.moe.expert_bias and config.moe.clamped_swiglu is not None
    assert config.rope_scaling.factor == 32.0 and config.rope_theta == 150000.0
    assert type(model.params.layers[1].w_experts_down).__name__ == "GgufBlocks"
    llm = LLM(model, max_model_len=32, num_kv_blocks=8, max_num_seqs=1, warmup=False)
    [output] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0,
                                                                             ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 3
