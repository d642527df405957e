"""Profile rows: the core rows, plugins' rows, the registry's refusals, docs/profiles.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_family import FamiliesPlugin

from tensorfold.cli import commands as cli
from tensorfold.config.settings import Settings, env_name
from tensorfold.family.plugins import PluginManager, get_plugin_manager, reset_plugin_manager
from tensorfold.family.profiles import (
    COMMAND,
    ProfileError,
    ProfileRegistry,
    ProfileRow,
    collect_rows,
    core_rows,
    render_markdown,
)

DOCS = Path(__file__).parents[1] / "docs" / "profiles.md"
ROW = ProfileRow("TF_GLM_INDEXER", "on, off", "on", ("glm5_next",), "Use the sparse indexer.")


def test_core_rows_come_from_the_settings_fields() -> None:
    rows = {row.setting: row for row in core_rows()}
    assert set(rows) == {env_name(name) for name in Settings.model_fields}
    for name, field in Settings.model_fields.items():
        assert rows[env_name(name)].meaning == field.description
    assert rows["TF_KV_PAGES"].values == "auto, on, off, 0"
    assert (rows["TF_KV_PAGES"].default, rows["TF_KV_POISON"].default) == ("auto", "0")
    assert rows["TF_CONTEXT"].default == "unset"


def test_plugin_rows_are_collected(pm: PluginManager) -> None:
    pm.add_plugin(FamiliesPlugin("glm5_next", rows=(ROW,)), "glm", "tensorfold-glm", "1.0")
    rows = collect_rows(pm)
    assert ROW in rows
    assert [r.setting for r in rows] == sorted(r.setting for r in rows)


def test_a_setting_registered_twice_with_different_text_is_refused(pm: PluginManager) -> None:
    other = ProfileRow("TF_GLM_INDEXER", "on, off", "off", ("glm5_next",), "Something else.")
    pm.add_plugin(FamiliesPlugin(rows=(ROW,)), "glm", "tensorfold-glm", "1.0")
    pm.add_plugin(FamiliesPlugin(rows=(other,)), "fork", "tensorfold-fork", "0.1")
    with pytest.raises(ProfileError) as err:
        collect_rows(pm)
    message = str(err.value)
    assert message.startswith("TF_GLM_INDEXER is registered twice with different text")
    assert "tensorfold-glm 1.0" in message and "tensorfold-fork 0.1" in message


def test_a_plugin_may_not_redefine_a_core_setting(pm: PluginManager) -> None:
    row = ProfileRow("TF_KV_SHARE", "on, off", "off", ("glm5_next",), "Not the core's text.")
    pm.add_plugin(FamiliesPlugin(rows=(row,)), "glm", "tensorfold-glm", "1.0")
    with pytest.raises(ProfileError, match="TF_KV_SHARE is registered twice.*by tensorfold \\("):
        collect_rows(pm)


def test_same_text_is_accepted_and_families_merge() -> None:
    registry = ProfileRegistry()
    registry.register(ROW, "a")
    registry.register(ROW, "b")
    registry.register(ProfileRow(ROW.setting, ROW.values, ROW.default, ("gemma4",), ROW.meaning))
    [row] = registry.rows()
    assert row.families == ("glm5_next", "gemma4")


@pytest.mark.parametrize(
    "setting, families",
    [("GLM_X", ("all",)), ("TF_glm_x", ("all",)), ("TF_X", ()), ("TF_X", "all")],
)
def test_malformed_rows_are_refused(setting: str, families: tuple[str, ...]) -> None:
    with pytest.raises(ProfileError):
        ProfileRow(setting, "on, off", "on", families, "x")


def test_render_markdown() -> None:
    retired = ProfileRow("TF_A_OLD", "a | b", "0", ("x", "y"), "Old.", replaced_by="TF_KV_SHARE")
    text = render_markdown([ROW, retired])
    lines = text.splitlines()
    assert lines[0] == "# Profiles"
    assert f"`{COMMAND}`" in text
    assert lines[-2] == "| `TF_A_OLD` | a \\| b | `0` | x, y | Retired: use `TF_KV_SHARE`. Old. |"
    assert lines[-1].startswith("| `TF_GLM_INDEXER` |")
    assert text.endswith("\n")


def test_cli_profiles_markdown_prints_the_rendered_page(
    tf_env: pytest.MonkeyPatch, pm: PluginManager, capsys: pytest.CaptureFixture[str]
) -> None:
    pm.add_plugin(FamiliesPlugin("glm5_next", rows=(ROW,)), "glm", "tensorfold-glm", "1.0")
    tf_env.setattr(cli, "get_plugin_manager", lambda settings=None: pm)
    assert cli.main(["profiles", "--markdown"]) == 0
    assert capsys.readouterr().out == render_markdown(collect_rows(pm))
    assert cli.main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["SETTING", "DEFAULT", "VALUES", "FAMILIES"]
    assert "TF_GLM_INDEXER" in out and "    Use the sparse indexer." in out


def test_docs_profiles_md_is_current(tf_env: pytest.MonkeyPatch) -> None:
    # Every installed plugin (TF_PLUGINS unset), as `tensorfold profiles --markdown` sees them.
    reset_plugin_manager()
    try:
        pm = get_plugin_manager(Settings())
        expected = render_markdown(collect_rows(pm))
    finally:
        reset_plugin_manager()
    documented = DOCS.read_text()
    # the rows of the plugins that loaded are checked first, then a plugin that did not load fails
    missing = [line for line in expected.splitlines() if line not in documented.splitlines()]
    assert not missing, (
        f"docs/profiles.md lacks or misstates: {missing}; regenerate it with: {COMMAND}"
    )
    assert not pm.failures, f"plugins failed to load, so their rows are unchecked: {pm.failures}"
    assert documented == expected, (
        f"docs/profiles.md is stale; regenerate it with: {COMMAND} > docs/profiles.md"
    )
