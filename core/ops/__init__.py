"""Shared kernels: each op has a torch reference (the CPU path) and, where written, a Triton
kernel beside it (triton_*.py), which the op takes when its inputs are on CUDA (ops.gpu says
when; ops.gpu.set_triton(False) turns them off). Every op keeps the exactness rules
(docs/architecture.md): a row's result never depends on how many rows share the pass.
docs/reference.md lists each op with the transformers function it matches and where it rounds."""
