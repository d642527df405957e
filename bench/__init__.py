"""Benchmarks for the GPU machine (not tests): see bench/lfm2_speed.py and docs/perf.md."""
