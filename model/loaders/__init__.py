"""Checkpoints into parameters: HF safetensors directories, GGUF files and PEFT LoRA adapters.
``load.load_model`` is the one entry point."""
