"""The plugin host: loads entry points of group "tensorfold" (allow-list TF_PLUGINS), collects
families, and builds the chosen family's own plugin manager for the per-family hooks.

Loading a plugin imports only its entry-point module; families' heavy code (torch, triton)
is imported through `tensorfold.family.resolve` once a family is chosen.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any, NamedTuple, Protocol

import pluggy

from tensorfold.config.logs import get_logger
from tensorfold.config.settings import Settings
from tensorfold.family import FamilySpec, hookspecs, resolve

GROUP = "tensorfold"
log = get_logger("tensorfold.plugins")


class FamilyError(Exception):
    """The family asked for is not installed, cannot load, or two plugins claim its name."""


class Origin(NamedTuple):
    distribution: str
    version: str


class PluginInfo(NamedTuple):
    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...]


class EntryPointLike(Protocol):
    name: str
    value: str

    @property
    def dist(self) -> Any: ...

    def load(self) -> Any: ...


class PluginManager(pluggy.PluginManager):
    """pluggy's manager with tensorfold's hookspecs, remembering where each plugin came from."""

    def __init__(self) -> None:
        super().__init__(GROUP)
        self.add_hookspecs(hookspecs)
        self.origins: dict[str, Origin] = {}  # plugin name -> its distribution and version
        self.failures: dict[str, str] = {}  # entry-point name -> why it did not load

    def add_plugin(
        self, plugin: object, name: str, distribution: str = "", version: str = ""
    ) -> None:
        """Register `plugin` under `name`, recording the distribution that ships it."""
        self.register(plugin, name=name)
        self.origins[name] = Origin(distribution or name, version)


def load_entry_points(
    pm: PluginManager, allow: str | None, entry_points: Iterable[EntryPointLike] | None = None
) -> None:
    """Load the installed plugins that the allow-list admits into `pm`.

    allow: None loads every installed plugin; "" none; "a,b" only those entry-point names
    (a name that is not installed warns). A plugin that fails to import or register is logged
    with its distribution and recorded in `pm.failures`; the others still load.
    """
    wanted = None if allow is None else {n.strip() for n in allow.split(",") if n.strip()}
    if entry_points is None:
        entry_points = metadata.entry_points(group=GROUP)
    installed: dict[str, Origin] = {}
    for ep in entry_points:
        shipped = Origin(ep.dist.name, ep.dist.version) if ep.dist else Origin(ep.value, "")
        if ep.name in installed:
            if installed[ep.name] != shipped:  # not just one distribution seen twice on sys.path
                log.warning(
                    "two distributions name the same plugin; the first is loaded",
                    plugin=ep.name,
                    loaded=" ".join(installed[ep.name]),
                    ignored=" ".join(shipped),
                )
            continue
        installed[ep.name] = shipped
        if wanted is not None and ep.name not in wanted:
            continue
        try:
            pm.add_plugin(ep.load(), ep.name, *shipped)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            pm.failures[ep.name] = f"{shipped.distribution} {shipped.version}: {reason}".strip()
            log.error(
                "plugin failed to load",
                plugin=ep.name,
                distribution=shipped.distribution,
                version=shipped.version,
                entry_point=ep.value,
                error=reason,
            )
    for name in sorted((wanted or set()) - set(installed)):
        log.warning(
            "TF_PLUGINS names a plugin that is not installed",
            plugin=name,
            installed=sorted(installed),
        )


def build_plugin_manager(allow: str | None) -> PluginManager:
    """A fresh manager with the installed plugins that `allow` (TF_PLUGINS) admits."""
    pm = PluginManager()
    load_entry_points(pm, allow)
    return pm


@functools.cache
def _cached_plugin_manager(allow: str | None) -> PluginManager:
    return build_plugin_manager(allow)


def get_plugin_manager(settings: Settings | None = None) -> PluginManager:
    """The process's plugin manager for these settings' TF_PLUGINS (built once, then cached)."""
    return _cached_plugin_manager((settings or Settings()).plugins)


def reset_plugin_manager() -> None:
    """Forget the cached manager (tests that change TF_PLUGINS or installed plugins)."""
    _cached_plugin_manager.cache_clear()


def origin(pm: pluggy.PluginManager, plugin_name: str) -> Origin | None:
    """The distribution and version that ship a registered plugin, when known."""
    known = getattr(pm, "origins", {}).get(plugin_name)
    if known is not None:
        return known
    for plugin, dist in pm.list_plugin_distinfo():  # managers that used pluggy's own loader
        if pm.get_name(plugin) == plugin_name:
            return Origin(dist.project_name, dist.version)
    return None


def call_per_plugin(
    pm: pluggy.PluginManager, hook_name: str, register_for: Callable[[str], Callable[..., None]]
) -> None:
    """Call a collection hook `hook_name(register=...)` one plugin at a time, so that whatever a
    plugin registers can be attributed to it: `register_for(plugin_name)` makes its callback."""
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        if impl.hookwrapper or impl.wrapper:
            continue
        others = [p for p in pm.get_plugins() if p is not impl.plugin]
        caller = pm.subset_hook_caller(hook_name, remove_plugins=others)
        caller(register=register_for(impl.plugin_name))


def families(pm: pluggy.PluginManager) -> dict[str, FamilySpec]:
    """Every family the plugins in `pm` register, by name, with distribution and version filled
    in. Raises FamilyError when two registrations claim one name, naming both distributions."""
    found: dict[str, FamilySpec] = {}

    def register_for(plugin_name: str) -> Callable[[FamilySpec], None]:
        def register(spec: FamilySpec) -> None:
            if not isinstance(spec, FamilySpec):
                raise FamilyError(f"plugin {plugin_name!r} registered {spec!r}, not a FamilySpec")
            shipped = origin(pm, plugin_name)
            if shipped is None:  # registered by hand, not from an entry point
                shipped = Origin(spec.distribution or plugin_name, spec.version)
            spec = dataclasses.replace(spec, distribution=shipped[0], version=shipped[1])
            if spec.name in found:
                raise FamilyError(
                    f"family {spec.name!r} is registered twice: by {_label(found[spec.name])} and "
                    f"by {_label(spec)}; uninstall one, or pick plugins with TF_PLUGINS"
                )
            found[spec.name] = spec

        return register

    call_per_plugin(pm, "register_families", register_for)
    return dict(sorted(found.items()))


def _label(spec: FamilySpec) -> str:
    return f"{spec.distribution} {spec.version}".strip()


# The plugins this project ships, by the model_type / architectures they serve: what a start
# names to install when no installed family serves a checkpoint.
KNOWN_PLUGINS = {
    "lfm2_moe": "tensorfold-lfm2-moe",
    "Lfm2MoeForCausalLM": "tensorfold-lfm2-moe",
    "gemma4": "tensorfold-gemma4",
    "gemma4_text": "tensorfold-gemma4",
    "Gemma4ForConditionalGeneration": "tensorfold-gemma4",
    "Gemma4ForCausalLM": "tensorfold-gemma4",
    "glm5_next": "tensorfold-glm",
    "glm5_next_text": "tensorfold-glm",
    "Glm5NextForConditionalGeneration": "tensorfold-glm",
}


def model_names(config: dict[str, Any]) -> list[str]:
    """The names a config.json gives its model: its model_type, then its architectures."""
    archs = config.get("architectures")
    names = [config.get("model_type"), *(archs if isinstance(archs, list) else [])]
    return [n for n in names if isinstance(n, str)]


def served_by(config: dict[str, Any]) -> str:
    """How a config.json names its model: "model_type 'x' (architectures A, B)"."""
    archs = config.get("architectures")
    listed = f" (architectures {', '.join(map(str, archs))})" if isinstance(archs, list) else ""
    return f"model_type {config.get('model_type')!r}{listed}"


def choose_family(
    name: str | None, pm: pluggy.PluginManager, config: dict[str, Any] | None = None
) -> FamilySpec:
    """The family `--family name` (or TF_FAMILY) asks for; with no name, the one that serves
    `config` (a --model folder's config.json: FamilySpec.serves, of several the lowest
    demo_rank), else the only installed family, or of several the default one
    (`default_family`). A config that names a model_type or architectures no installed family
    serves is refused, naming the plugin to install where one is known; one that names
    neither, or an installed family alone that declares no `serves`, falls back to the
    default."""
    found = families(pm)
    failed = "".join(
        f"; plugin {ep!r} failed to load ({why})" for ep, why in getattr(pm, "failures", {}).items()
    )
    installed = ", ".join(found) or "none"
    if name is None:
        if not found:
            raise FamilyError(f"no model families are installed{failed}")
        if config is not None:
            serving = [s for s in found.values() if s.serves_config(config)]
            if serving:
                return min(serving, key=lambda s: (s.demo_rank, s.name))
            lone = len(found) == 1 and not next(iter(found.values())).serves
            if not lone and model_names(config):
                raise FamilyError(_none_serves(config, installed, failed))
        chosen = default_family(found)
        if chosen is None:
            raise FamilyError(
                f"several families are installed ({installed}) and none has a demo checkpoint; "
                "choose one with --family or TF_FAMILY"
            )
        return chosen
    if name not in found:
        raise FamilyError(f"unknown family {name!r}; installed families: {installed}{failed}")
    return found[name]


def _none_serves(config: dict[str, Any], installed: str, failed: str) -> str:
    known = sorted({KNOWN_PLUGINS[n] for n in model_names(config) if n in KNOWN_PLUGINS})
    if known:
        hint = f"install {' or '.join(known)} (pip install {known[0]})"
    else:
        hint = "no plugin of this project serves it: docs/plugins.md shows how to write one"
    return (
        f"no installed family serves this checkpoint's {served_by(config)}; {hint}, or name a "
        f"family with --family / TF_FAMILY (installed: {installed}){failed}"
    )


def default_family(found: dict[str, FamilySpec]) -> FamilySpec | None:
    """The family chosen when none is named: the only one, or of several the first with a demo
    checkpoint by (demo_rank, name), a stable order whatever order the plugins loaded in."""
    if len(found) == 1:
        return next(iter(found.values()))
    with_demo = [spec for spec in found.values() if spec.build_demo]
    return min(with_demo, key=lambda s: (s.demo_rank, s.name), default=None)


def family_plugin_manager(spec: FamilySpec, defaults: list[object]) -> PluginManager:
    """A fresh manager for one family's per-family hooks: the `defaults` (core adapters) first,
    then the family's `hooks` object, so the family's implementation is called first."""
    pm = PluginManager()
    for default in defaults:
        pm.register(default)
    if spec.hooks:
        try:
            hooks = resolve(spec.hooks)
        except Exception as exc:
            raise FamilyError(
                f"family {spec.name!r} ({_label(spec)}): cannot import its hooks {spec.hooks!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        pm.add_plugin(hooks, f"{spec.name}.hooks", spec.distribution, spec.version)
    return pm


def list_plugins(pm: pluggy.PluginManager) -> list[PluginInfo]:
    """The plugins registered in `pm`: name, distribution, version and the hooks each implements."""
    infos = []
    for name, plugin in pm.list_name_plugin():
        shipped = origin(pm, name) or Origin("", "")
        hooks = tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or []))
        infos.append(PluginInfo(name, shipped.distribution, shipped.version, hooks))
    return sorted(infos)
