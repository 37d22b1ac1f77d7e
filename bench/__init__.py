"""Benchmarks, printed as ratios measured in one run: python -m bench [section ...]."""
