"""Test-wide setup. Tiny models on a 2-core machine run faster (and as exactly) on one torch
thread: two threads add milliseconds of handoff to operations that take microseconds."""

import torch

torch.set_num_threads(1)
