"""Shared kernels: each op has a torch reference (the CPU path) and, where written, a Triton
kernel beside it. Every op keeps the exactness rules: a row's result never depends on how many
rows share the pass."""
