"""How users launch raylm: the ``raylm`` CLI, the YAML deploy schema, the Serve application
builder, and the benchmarks."""
