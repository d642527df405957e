"""tensorfold: serve large language models from Python.

docs/architecture.md has a request's path through these modules, the rooms (config, family, ops,
memory, adapters, engine, server, cli) and their module map, and the exactness rules;
docs/plugins.md and docs/reference.md are for family authors.

The modules lived flat in this package before they had rooms: each old path (`tensorfold.family.model`,
`tensorfold.engine.runner`, ...) still imports, as the same module object as its new home."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

from tensorfold.family.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl", "LLM", "SamplingParams"]

# old flat path -> its home (engine, server, cli and family are packages now: their modules
# are engine.engine, server.app, cli.commands, family.spec, and each package exports its names)
MOVED = {
    "tensorfold.demo_train": "tensorfold.family.demo_train",
    "tensorfold.settings": "tensorfold.config.settings",
    "tensorfold.logs": "tensorfold.config.logs",
    "tensorfold.progress": "tensorfold.config.progress",
    "tensorfold.model": "tensorfold.family.model",
    "tensorfold.forward_pass": "tensorfold.family.forward_pass",
    "tensorfold.checkpoint": "tensorfold.family.checkpoint",
    "tensorfold.tokenizer": "tensorfold.family.tokenizer",
    "tensorfold.chat_template": "tensorfold.family.chat_template",
    "tensorfold.content_specials": "tensorfold.family.content_specials",
    "tensorfold.tool_calls": "tensorfold.family.tool_calls",
    "tensorfold.plugins": "tensorfold.family.plugins",
    "tensorfold.hookspecs": "tensorfold.family.hookspecs",
    "tensorfold.profiles": "tensorfold.family.profiles",
    "tensorfold.demo_build": "tensorfold.family.demo_build",
    "tensorfold.demo_text": "tensorfold.family.demo_text",
    "tensorfold.kv_pool": "tensorfold.memory.kv_pool",
    "tensorfold.kv_plan": "tensorfold.memory.kv_plan",
    "tensorfold.kv_dtype": "tensorfold.memory.kv_dtype",
    "tensorfold.prompt_radix": "tensorfold.memory.prompt_radix",
    "tensorfold.prompt_share": "tensorfold.memory.prompt_share",
    "tensorfold.host_tier": "tensorfold.memory.host_tier",
    "tensorfold.requests": "tensorfold.engine.requests",
    "tensorfold.lanes": "tensorfold.engine.lanes",
    "tensorfold.runner": "tensorfold.engine.runner",
    "tensorfold.cpu_threads": "tensorfold.engine.cpu_threads",
    "tensorfold.cuda_graphs": "tensorfold.engine.cuda_graphs",
    "tensorfold.sampling": "tensorfold.engine.sampling",
    "tensorfold.choices": "tensorfold.engine.choices",
    "tensorfold.stops": "tensorfold.engine.stops",
    "tensorfold.structured": "tensorfold.engine.structured",
    "tensorfold.tool_schemas": "tensorfold.engine.tool_schemas",
    "tensorfold.status_snapshot": "tensorfold.engine.status_snapshot",
    "tensorfold.warm_up": "tensorfold.engine.warm_up",
    "tensorfold.dummy_draws": "tensorfold.engine.dummy_draws",
    "tensorfold.tensor_parallel": "tensorfold.engine.tensor_parallel",
    "tensorfold.start": "tensorfold.engine.start",
    "tensorfold.openai_api": "tensorfold.server.openai_api",
    "tensorfold.openai_replies": "tensorfold.server.openai_replies",
    "tensorfold.request_checks": "tensorfold.server.request_checks",
    "tensorfold.request_limits": "tensorfold.server.request_limits",
    "tensorfold.request_prepare": "tensorfold.server.request_prepare",
    "tensorfold.tool_request": "tensorfold.server.tool_request",
    "tensorfold.prompt_work": "tensorfold.server.prompt_work",
    "tensorfold.prompt_workers": "tensorfold.server.prompt_workers",
    "tensorfold.connections": "tensorfold.server.connections",
    "tensorfold.cors": "tensorfold.server.cors",
    "tensorfold.api_key": "tensorfold.server.api_key",
    "tensorfold.metrics": "tensorfold.server.metrics",
    "tensorfold.shutdown": "tensorfold.server.shutdown",
    "tensorfold.status_page": "tensorfold.server.status_page",
    "tensorfold.status_feed": "tensorfold.server.status_feed",
    "tensorfold.serve_cli": "tensorfold.cli.serve",
    "tensorfold.generate_cli": "tensorfold.cli.generate",
    "tensorfold.bench": "tensorfold.cli.bench",
    "tensorfold.bench_cache": "tensorfold.cli.bench_cache",
    "tensorfold.exact": "tensorfold.cli.exact",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as its new home's module object (imported when first asked for)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system sets the old path's spec on it
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__
        assert alias is not None
        module.__spec__ = alias.loader_state  # its own again; the new home ran already


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())


def __getattr__(name: str):  # the offline API loads torch, so only when asked for
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tensorfold' has no attribute {name!r}")
