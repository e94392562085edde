"""Benchmarks that print numbers (never timed unit tests)."""
