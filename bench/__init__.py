"""Benchmarks for deltasync (not part of the package)."""
