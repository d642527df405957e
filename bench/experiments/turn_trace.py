"""Where a timed request's time goes, for benchmarks: the Triton kernels compiled while it ran
(a first compile of a new specialisation costs 0.1-1 s) and the wall seconds spent in the prompt
store's and the runner's steps, from wrappers installed around them.

    trace = TurnTrace.install()
    with trace.window() as w:
        ...                      # the timed request
    w.result()  # {"compiled": [...], "seconds": {"PromptSharing.match": ..., ...}, "calls": {...}}
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any, Iterator

# (module, class, method) wrapped: the store's admission, keeps, evictions and host copies, and
# the runner's passes; wall time, so a step that waits for the GPU includes the wait
WRAPPED = (
    ("tensorfold.memory.prompt_share", "PromptSharing", "match"),
    ("tensorfold.memory.prompt_share", "PromptSharing", "make_room"),
    ("tensorfold.memory.prompt_share", "PromptSharing", "resume"),
    ("tensorfold.memory.prompt_share", "PromptSharing", "keep"),
    ("tensorfold.memory.prompt_share", "PromptSharing", "_evict"),
    ("tensorfold.memory.prompt_share", "PromptSharing", "_page_in"),
    ("tensorfold.memory.host_tier", "HostTier", "page_out"),
    ("tensorfold.memory.host_tier", "HostTier", "page_in"),
    ("tensorfold.engine.runner", "ModelRunner", "run"),
    ("tensorfold.engine.runner", "ModelRunner", "attach"),
    ("tensorfold.engine.runner", "ModelRunner", "keep_state"),
    ("tensorfold.engine.runner", "ModelRunner", "restore_state"),
)


class Window:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.compiled: list[str] = []  # "kernel +seconds from the window's start"
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.first: dict[str, float] = {}  # each step's first call

    def result(self) -> dict[str, Any]:
        return {
            "compiled": self.compiled,
            "seconds": {k: round(v, 4) for k, v in sorted(self.seconds.items())},
            "calls": dict(sorted(self.calls.items())),
            "first": {k: round(v, 4) for k, v in sorted(self.first.items())},
        }


class TurnTrace:
    _installed: "TurnTrace | None" = None

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: Window | None = None

    @classmethod
    def install(cls) -> "TurnTrace":
        """Once a process: the wrappers and Triton's compile hook (chained to one already set)."""
        if cls._installed is not None:
            return cls._installed
        trace = cls._installed = cls()
        import importlib

        for module, owner, name in WRAPPED:
            klass = getattr(importlib.import_module(module), owner)
            setattr(klass, name, trace._wrap(f"{owner}.{name}", getattr(klass, name)))
        try:
            from triton import knobs
        except ImportError:  # the CPU without Triton: no compiles to see
            return trace
        before = knobs.runtime.jit_cache_hook

        def hook(*, repr: str, **kw: Any) -> Any:
            with trace.lock:
                if trace.open is not None:
                    w = trace.open
                    jf = getattr(kw.get("fn"), "jit_function", None)
                    why = spec_diff(jf, kw.get("key")) if jf is not None else ""
                    w.compiled.append(
                        f"{repr.split('[', 1)[0]} +{time.perf_counter() - w.t0:.2f}s"
                        + (f" ({why})" if why else "")
                    )
            return before(repr=repr, **kw) if before else None

        knobs.runtime.jit_cache_hook = hook
        return trace

    def _wrap(self, label: str, fn: Any) -> Any:
        trace = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            a = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                w = trace.open
                if w is not None:
                    with trace.lock:
                        took = time.perf_counter() - a
                        w.seconds[label] = w.seconds.get(label, 0.0) + took
                        w.first.setdefault(label, took)
                        w.calls[label] = w.calls.get(label, 0) + 1

        return timed

    @contextlib.contextmanager
    def window(self) -> Iterator[Window]:
        w = Window()
        self.open = w
        try:
            yield w
        finally:
            self.open = None


def spec_diff(jf: Any, key: Any) -> str:
    """What sets a kernel's new compile apart from the nearest one compiled before in this
    process: "arg: before -> now" for each argument whose specialisation (dtype, 16-byte
    alignment or divisibility, == 1, a constexpr's value) differs; "first" if none was."""
    pairs = [(k, v) for cache in list(jf.device_caches.values()) for k, v in cache[1].items()]
    new = next((k for k, v in pairs if v == key), None)
    if new is None:
        return ""
    names = jf.arg_names
    best: list[str] | None = None
    for k, v in pairs:
        if v == key:
            continue
        d = [
            f"{names[i] if i < len(names) else i}: {a} -> {b}"
            for i, (a, b) in enumerate(zip(k[0], new[0]))
            if a != b
        ]
        if k[1] != new[1]:
            d.append("options")
        if best is None or len(d) < len(best):
            best = d
    return "first" if best is None else "; ".join(best)
