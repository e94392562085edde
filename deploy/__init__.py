"""How users launch raylm: the ``raylm`` CLI, (later) the YAML deploy schema and benchmarks."""
