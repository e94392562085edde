"""Paged KV memory: block pool with ref counts, prefix cache (chained block hashes), device KV arrays."""
