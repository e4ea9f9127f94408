"""Evaluation: benchmarks and acceptance measurements."""
