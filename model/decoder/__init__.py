"""The decoder: one forward pass for every family over a paged KV pool (``forward``), its
layers, attention, MoE block, LoRA slots, parameter pytree, and the reference single-sequence
generation loop that tests compare the engine with."""
