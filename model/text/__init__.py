"""Text in and out: the tokenizer (HF ``tokenizers`` or a GGUF's vocabulary), chat templates,
incremental detokenization and the prompt rules every entry point applies. Imports no JAX."""
