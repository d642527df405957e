"""The plugin host: allow-list, families, per-family managers, the CLI listings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fake_family
import pytest
from fake_family import DefaultHooks, FamiliesPlugin
from structlog.testing import capture_logs

import tensorfold
from tensorfold.cli import commands as cli
from tensorfold.config.settings import Settings
from tensorfold.engine import start
from tensorfold.family import FamilySpec, plugins
from tensorfold.family.plugins import FamilyError, PluginManager

TESTS = Path(__file__).parent


@dataclass
class Dist:
    name: str
    version: str


@dataclass
class FakeEntryPoint:
    name: str
    plugin: Any
    dist: Dist | None

    @property
    def value(self) -> str:
        return f"{self.name}_module"

    def load(self) -> Any:
        if isinstance(self.plugin, Exception):
            raise self.plugin
        return self.plugin


def entry_points() -> list[FakeEntryPoint]:
    return [
        FakeEntryPoint("alpha", FamiliesPlugin("a"), Dist("tensorfold-alpha", "1.0")),
        FakeEntryPoint("beta", FamiliesPlugin("b"), Dist("tensorfold-beta", "2.0")),
    ]


@pytest.mark.parametrize(
    "allow, loaded",
    [(None, ["alpha", "beta"]), ("", []), ("beta", ["beta"]), (" alpha,", ["alpha"])],
)
def test_allow_list(pm: PluginManager, allow: str | None, loaded: list[str]) -> None:
    plugins.load_entry_points(pm, allow, entry_points())
    assert sorted(name for name, _ in pm.list_name_plugin()) == loaded


@pytest.mark.parametrize(
    "value, loaded", [(None, ["alpha", "beta"]), ("", []), ("alpha", ["alpha"])]
)
def test_allow_list_from_environment(
    tf_env: pytest.MonkeyPatch, pm: PluginManager, value: str | None, loaded: list[str]
) -> None:
    if value is not None:
        tf_env.setenv("TF_PLUGINS", value)
    plugins.load_entry_points(pm, Settings().plugins, entry_points())
    assert sorted(name for name, _ in pm.list_name_plugin()) == loaded


def test_allow_list_warns_about_a_plugin_that_is_not_installed(pm: PluginManager) -> None:
    with capture_logs() as logs:
        plugins.load_entry_points(pm, "beta,gamma", entry_points())
    assert pm.get_plugin("beta") is not None
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert warning["plugin"] == "gamma"
    assert warning["installed"] == ["alpha", "beta"]


def test_broken_entry_point_is_named_and_the_others_still_load(pm: PluginManager) -> None:
    broken = FakeEntryPoint("broken", ImportError("no module x"), Dist("tensorfold-broken", "0.3"))
    with capture_logs() as logs:
        plugins.load_entry_points(pm, None, [broken, *entry_points()])
    assert sorted(plugins.families(pm)) == ["a", "b"]
    assert "tensorfold-broken 0.3" in pm.failures["broken"]
    [error] = [e for e in logs if e["log_level"] == "error"]
    assert error["distribution"] == "tensorfold-broken"
    with pytest.raises(FamilyError, match="'broken' failed to load.*tensorfold-broken"):
        plugins.choose_family("c", pm)


def test_an_entry_point_name_shipped_twice_loads_the_first_and_warns(pm: PluginManager) -> None:
    again = FakeEntryPoint("alpha", FamiliesPlugin("z"), Dist("tensorfold-alpha-fork", "0.1"))
    with capture_logs() as logs:
        plugins.load_entry_points(pm, None, [*entry_points(), again])
    assert sorted(plugins.families(pm)) == ["a", "b"]
    [warning] = logs
    assert (warning["loaded"], warning["ignored"]) == (
        "tensorfold-alpha 1.0",
        "tensorfold-alpha-fork 0.1",
    )


def test_cached_plugin_manager_honours_tf_plugins(no_installed_plugins: pytest.MonkeyPatch) -> None:
    pm = plugins.get_plugin_manager()
    assert pm is plugins.get_plugin_manager(Settings())
    assert pm.get_plugins() == set()


def test_families_fill_in_distribution_and_version(pm: PluginManager) -> None:
    plugins.load_entry_points(pm, None, entry_points())
    found = plugins.families(pm)
    assert list(found) == ["a", "b"]
    assert (found["b"].distribution, found["b"].version) == ("tensorfold-beta", "2.0")


def test_duplicate_family_is_refused_naming_both_distributions(pm: PluginManager) -> None:
    pm.add_plugin(FamiliesPlugin("glm5_next"), "glm", "tensorfold-glm", "1.0")
    pm.add_plugin(FamiliesPlugin("glm5_next"), "glm_fork", "tensorfold-glm-fork", "0.1")
    with pytest.raises(FamilyError) as err:
        plugins.families(pm)
    assert "'glm5_next'" in str(err.value)
    assert "tensorfold-glm 1.0" in str(err.value)
    assert "tensorfold-glm-fork 0.1" in str(err.value)


def test_unknown_family_lists_the_installed_ones(pm: PluginManager) -> None:
    pm.add_plugin(FamiliesPlugin("b", "a"), "fake")
    with pytest.raises(FamilyError, match="^unknown family 'x'; installed families: a, b$"):
        plugins.choose_family("x", pm)


def test_the_only_family_is_chosen_without_a_name(pm: PluginManager) -> None:
    with pytest.raises(FamilyError, match="no model families are installed"):
        plugins.choose_family(None, pm)
    pm.add_plugin(FamiliesPlugin("a"), "fake_a")
    assert plugins.choose_family(None, pm).name == "a"
    pm.add_plugin(FamiliesPlugin("b"), "fake_b")
    assert plugins.choose_family(None, pm).name == "a"  # of several: the first by name
    assert plugins.choose_family("b", pm).name == "b"


class RankedPlugin:
    """Families with and without a demo, in an order their names do not follow."""

    def __init__(self, *specs: FamilySpec) -> None:
        self.specs = specs

    @tensorfold.hookimpl
    def register_families(self, register) -> None:
        for s in self.specs:
            register(s)


def test_the_default_of_several_is_the_lowest_demo_rank_with_a_demo(
    tf_env: pytest.MonkeyPatch, pm: PluginManager
) -> None:
    pm.add_plugin(
        RankedPlugin(
            FamilySpec(name="a", load="x:y", build_demo=""),  # no demo: never the default
            FamilySpec(name="c", load="x:y", build_demo="x:y", demo_rank=0),
        ),
        "ranked",
    )
    pm.add_plugin(FamiliesPlugin("b"), "fake_b")
    assert plugins.choose_family(None, pm).name == "c"
    assert start.family_note(plugins.choose_family(None, pm), None, pm) == (
        "family c, the default (also installed: a, b; --family or TF_FAMILY picks one)"
    )
    assert start.family_note(plugins.choose_family("b", pm), "b", pm) == "family b"


def test_several_families_without_a_demo_ask_for_one(pm: PluginManager) -> None:
    pm.add_plugin(
        RankedPlugin(
            FamilySpec(name="a", load="x:y", build_demo=""),
            FamilySpec(name="b", load="x:y", build_demo=""),
        ),
        "ranked",
    )
    with pytest.raises(FamilyError, match=r"several families are installed \(a, b\) and none"):
        plugins.choose_family(None, pm)


def test_tf_family_names_the_family_to_open(tf_env: pytest.MonkeyPatch, pm: PluginManager) -> None:
    """TF_FAMILY is read into the settings and asked for as --family is (before any load)."""
    pm.add_plugin(FamiliesPlugin("a", "b"), "fake")
    tf_env.setenv("TF_FAMILY", "b")
    tf_env.setattr(start, "get_plugin_manager", lambda settings=None: pm)
    tf_env.setattr(
        start,
        "model_folder",
        lambda spec, *a: (_ for _ in ()).throw(FamilyError(f"chose {spec.name}")),
    )
    with pytest.raises(FamilyError, match="^chose b$"):
        start.open_served(Settings())
    with pytest.raises(FamilyError, match="^chose a$"):  # the flag wins over TF_FAMILY
        start.open_served(Settings().with_overrides(family="a"), "a")


def test_a_model_folders_config_chooses_the_family_that_serves_it(
    tf_env: pytest.MonkeyPatch, pm: PluginManager, tmp_path
) -> None:
    """Without --family, `--model DIR` opens with the family whose `serves` names DIR's
    model_type or architectures; one no installed family serves is refused, naming the plugin
    to install."""
    pm.add_plugin(
        RankedPlugin(
            FamilySpec(name="lfm", load="x:y", build_demo="x:y", demo_rank=0, serves=("lfm2_moe",)),
            FamilySpec(name="dense", load="x:y", build_demo="x:y", serves=("LlamaForCausalLM",)),
        ),
        "ranked",
    )
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    assert plugins.choose_family(None, pm, llama).name == "dense"
    assert plugins.choose_family(None, pm, {"model_type": "lfm2_moe"}).name == "lfm"
    assert plugins.choose_family("lfm", pm, llama).name == "lfm"  # a name wins
    assert plugins.choose_family(None, pm, {}).name == "lfm"  # nothing named: the default
    gemma = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"]}
    with pytest.raises(
        FamilyError,
        match=r"model_type 'gemma4' \(architectures Gemma4For.*"
        r"install tensorfold-gemma4 .*installed: dense, lfm",
    ):
        plugins.choose_family(None, pm, gemma)
    with pytest.raises(FamilyError, match="'olmo2'.*docs/plugins.md"):
        plugins.choose_family(None, pm, {"model_type": "olmo2"})
    tf_env.setattr(start, "get_plugin_manager", lambda settings=None: pm)
    tf_env.setattr(
        start,
        "model_folder",
        lambda spec, *a: (_ for _ in ()).throw(FamilyError(f"chose {spec.name}")),
    )
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(FamilyError, match="^chose dense$"):
        start.open_served(Settings(), model=tmp_path)
    spec = plugins.choose_family(None, pm, llama)
    assert start.family_note(spec, None, pm, llama) == (
        "family dense, which serves the checkpoint's model_type 'llama' "
        "(architectures LlamaForCausalLM)"
    )


def test_a_lone_family_that_declares_no_serves_still_opens_any_folder(pm: PluginManager) -> None:
    pm.add_plugin(FamiliesPlugin("a"), "fake_a")
    assert plugins.choose_family(None, pm, {"model_type": "llama"}).name == "a"


def test_per_family_hooks_reach_only_the_chosen_family(
    pm: PluginManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(TESTS))  # spec.hooks names "fake_family:hooks_a"
    for hooks in fake_family.HOOKS.values():
        hooks.calls.clear()
    pm.add_plugin(FamiliesPlugin("a", "b"), "fake")
    defaults = DefaultHooks()
    family_pm = plugins.family_plugin_manager(plugins.choose_family("a", pm), [defaults])

    # The family answers first; the default is not called.
    assert family_pm.hook.share_pool(layout=None, num_pages=4, page_rows=16, device="cpu") == "a:4"
    # The family returns None: the default answers.
    restored = family_pm.hook.snap_restore(snapshot=None, arena=None, slots=None, slot=0)
    assert restored is True
    assert fake_family.hooks_a.calls == ["share_pool", "snap_restore"]
    assert defaults.calls == ["snap_restore"]
    assert fake_family.hooks_b.calls == []

    b_pm = plugins.family_plugin_manager(plugins.choose_family("b", pm), [DefaultHooks()])
    assert b_pm.hook.share_pool(layout=None, num_pages=2, page_rows=16, device="cpu") == "b:2"
    assert fake_family.hooks_a.calls == ["share_pool", "snap_restore"]


def test_family_hooks_that_do_not_import_name_the_family() -> None:
    spec = FamilySpec(
        name="z",
        load="x:y",
        build_demo="x:y",
        hooks="no_such_module_here:hooks",
        distribution="tensorfold-z",
        version="9",
    )
    with pytest.raises(FamilyError, match="family 'z' \\(tensorfold-z 9\\): cannot import"):
        plugins.family_plugin_manager(spec, [])


def test_list_plugins(pm: PluginManager) -> None:
    pm.add_plugin(FamiliesPlugin("a"), "alpha", "tensorfold-alpha", "1.0")
    assert plugins.list_plugins(pm) == [
        ("alpha", "tensorfold-alpha", "1.0", ("profile_rows", "register_families"))
    ]


def test_cli_families_and_plugins(
    tf_env: pytest.MonkeyPatch, pm: PluginManager, capsys: pytest.CaptureFixture[str]
) -> None:
    plugins.load_entry_points(pm, None, entry_points())
    tf_env.setattr(cli, "get_plugin_manager", lambda settings=None: pm)
    assert cli.main(["families"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "DISTRIBUTION", "VERSION", "SERVES", "DESCRIPTION"]
    assert out[1].split() == ["a", "tensorfold-alpha", "1.0", "-", "fake", "family", "a"]
    assert cli.main(["plugins"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["beta", "tensorfold-beta", "2.0", "profile_rows,", "register_families"] in lines


def test_cli_family_error_is_one_line_and_exit_2(
    tf_env: pytest.MonkeyPatch, pm: PluginManager, capsys: pytest.CaptureFixture[str]
) -> None:
    pm.add_plugin(FamiliesPlugin("a"), "one", "tensorfold-one", "1")
    pm.add_plugin(FamiliesPlugin("a"), "two", "tensorfold-two", "2")
    tf_env.setattr(cli, "get_plugin_manager", lambda settings=None: pm)
    assert cli.main(["families"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("tensorfold: error: family 'a' is registered twice")


def test_loading_every_installed_plugin_does_not_import_torch() -> None:
    # TF_PLUGINS is unset on purpose: this checks every plugin installed in this environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    code = (
        "import tensorfold.family.plugins as p; pm = p.get_plugin_manager(); p.families(pm); "
        "import sys; assert 'torch' not in sys.modules, 'a plugin imported torch'; "
        "print(sorted(n for n, _ in pm.list_name_plugin()), pm.failures)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
