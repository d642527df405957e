"""Test-wide setup.

- Tiny models on a 2-core machine run faster (and as exactly) on one torch thread: two threads
  add milliseconds of handoff to operations that take microseconds.
- The GPU suite: tests marked `gpu` run only when asked for with `pytest -m gpu`, on a CUDA
  machine. Asked for without CUDA, they fail rather than skip (a GPU run that checked nothing
  must not look green); not asked for, they are deselected. In a GPU run the Triton kernels are
  compiled for the device, never interpreted, whatever the CPU tests' modules set at import.
- Triton's interpreter patches triton.language for a launch, then again at every call of a
  device function (@triton.jit called from a kernel) inside it: a walk of the language's modules
  that cost about 7 ms a call, 40% of an interpreted model pass. Inside a launch whose patching
  (its own, or an earlier device call's, which the interpreter never undoes) already covers the
  device function's language modules, the call skips the walk, which would change nothing (it
  re-patches what is patched); the kernels run exactly as before.
"""

import os
import sys
from typing import Any

import pytest
import torch

torch.set_num_threads(1)


INTERPRETER_PATCHED_FOR = "3.7.1"  # the triton whose interpreter _skip_device_call_repatching knows


def _skip_device_call_repatching() -> None:
    """Device function calls inside an interpreted launch run without re-patching the language
    modules the launch patched (see the module docstring)."""
    from triton.runtime import interpreter as it

    executor_call, device_call = it.GridExecutor.__call__, it.InterpretedFunction.__call__
    patched: list[set[int]] = []  # the language modules each launch in progress patched

    def langs(fn: Any) -> set[int]:
        lang = (it.tl, it.tl.core)
        return {id(v) for v in fn.__globals__.values() if any(v is m for m in lang)}

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.append(langs(self.fn))
        try:
            return executor_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not patched or not langs(self.fn) <= patched[-1]:
            if patched:  # the call's patching is never undone: it covers the launch's rest
                patched[-1] |= langs(self.fn)
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise it.InterpreterError(repr(e)) from e

    it.GridExecutor.__call__, it.InterpretedFunction.__call__ = launch, call


@pytest.fixture(scope="session", autouse=True)
def _interpreted_device_calls() -> None:
    """After collection, where the modules that interpret their kernels have imported triton
    (importing it before they set TRITON_INTERPRET would compile triton.language's own jit
    functions instead of interpreting them)."""
    triton = sys.modules.get("triton")
    # the interpreter's internals this replaces are those of the pinned triton (pyproject.toml's
    # test extra); another version runs its own, slower but unchanged
    if triton is not None and triton.__version__ == INTERPRETER_PATCHED_FOR:
        if os.environ.get("TRITON_INTERPRET") == "1":
            _skip_device_call_repatching()


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
