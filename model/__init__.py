"""Pure JAX models: config, one decoder for every family, weight loading, tokenizer, kernels.

Knows nothing of Ray or HTTP. One subpackage per concept, imported by its full path:

- ``config``: hyper-parameters and each family's declared differences (no JAX);
- ``text``: tokenizer, chat template, detokenizer, prompt rules (no JAX);
- ``loaders``: HF safetensors directories, GGUF files and LoRA adapters into params;
- ``quantization``: the stored formats (8-bit arrays, GGUF blocks, integer-mode panels);
- ``kernels``: the C++ CPU kernels, each Python binding beside its ``.cc``;
- ``decoder``: the forward pass over a paged KV pool, its layers, MoE and LoRA slots;
- ``runtime``: device meshes and sharding, shape buckets, the compilation cache.

This package's ``__init__`` imports nothing, so the router reads ``config`` and ``text``
without loading JAX.
"""
