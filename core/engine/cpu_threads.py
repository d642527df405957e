"""A pass on the CPU runs on one torch thread.

The CPU path's exactness (a row's bits the same alone or beside others) rests on the BLAS giving
every row of a fixed-shape block the same summation order. With several threads a BLAS may split
a block between them by rows, and then a row's order depends on its place in the block: measured
under MKL's AVX2 path (what AMD machines get) with 2 threads, 12 of 20 slices of a [16, 256] x
[256, 64] product differed from the same rows in a larger batch; with one thread, none did.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 inside, restored after (one pass at a time holds it)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
