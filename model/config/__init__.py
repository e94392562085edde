"""A model without its weights: hyper-parameters read from ``config.json`` or GGUF metadata,
each family's declared differences, the bundled models' names. Imports no JAX."""
