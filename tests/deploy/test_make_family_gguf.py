"""The benchmark GGUF writer writes files raylm reads as the family it names (every tensor used,
none missing), at tiny shapes."""

from __future__ import annotations

import gguf
import pytest

from raylm.benchmarks.make_family_gguf import write_family_gguf
from raylm.model.loaders.load import load_model


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
