"""How users launch raylm: the ``raylm`` CLI, the YAML deploy schema and the Serve application
builder."""
