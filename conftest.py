"""Test-wide setup.

- Tiny models on a 2-core machine run faster (and as exactly) on one torch thread: two threads
  add milliseconds of handoff to operations that take microseconds.
- The GPU suite: tests marked `gpu` run only when asked for with `pytest -m gpu`, on a CUDA
  machine. Asked for without CUDA, they fail rather than skip (a GPU run that checked nothing
  must not look green); not asked for, they are deselected. In a GPU run the Triton kernels are
  compiled for the device, never interpreted, whatever the CPU tests' modules set at import.
"""

import os

import pytest
import torch

torch.set_num_threads(1)


def _gpu_run(config: pytest.Config) -> bool:
    expr = config.getoption("markexpr") or ""
    return "gpu" in expr.replace("not gpu", "")


def pytest_configure(config: pytest.Config) -> None:
    if _gpu_run(config):
        # the CPU tests' modules setdefault TRITON_INTERPRET=1 at import; this wins over them
        os.environ["TRITON_INTERPRET"] = "0"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_run(config):
        if not torch.cuda.is_available():
            raise pytest.UsageError("pytest -m gpu needs a CUDA device; this machine has none")
        return
    kept = [item for item in items if item.get_closest_marker("gpu") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
