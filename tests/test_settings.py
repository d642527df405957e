"""Settings: TF_* parsing, flag overrides, the environment check, logging set-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_family import FamiliesPlugin
from structlog.testing import capture_logs

from tensorfold.cli import commands as cli
from tensorfold.config.logs import configure_logging, get_logger
from tensorfold.config.settings import Settings, SettingsError, check_environment
from tensorfold.family.plugins import PluginManager
from tensorfold.family.profiles import ProfileRow

RETIRED = ProfileRow(
    "TF_GLM_KV_SHARE",
    "an integer",
    "0",
    ("glm5_next",),
    "Old prompt store switch.",
    replaced_by="TF_KV_SHARE",
)
GLM_ROW = ProfileRow("TF_GLM_INDEXER", "on, off", "on", ("glm5_next",), "Sparse indexer.")


def test_defaults(tf_env: pytest.MonkeyPatch) -> None:
    s = Settings()
    assert (s.plugins, s.kv_pages, s.kv_poison, s.kv_share) == (None, "auto", False, None)
    assert (s.parallel, s.context, s.prompt_cache_gib, s.memory_limit_gib) == (1, None, 16.0, None)
    assert (s.device, s.dtype, s.log_format, s.log_level) == ("auto", "auto", "console", "info")
    assert s.demo_cache == Path("~/.cache/tensorfold/demo").expanduser()


def test_values_from_the_environment(tf_env: pytest.MonkeyPatch) -> None:
    for name, value in {
        "TF_KV_PAGES": "0",
        "TF_KV_POISON": "1",
        "TF_KV_SHARE": "16",
        "TF_PARALLEL": "auto",
        "TF_CONTEXT": "131072",
        "TF_MEMORY_LIMIT_GIB": "40.5",
        "TF_DEVICE": "cpu",
    }.items():
        tf_env.setenv(name, value)
    s = Settings()
    assert (s.kv_pages, s.paging, s.kv_poison, s.kv_share) == ("0", "off", True, 16)
    assert (s.parallel, s.context, s.memory_limit_gib, s.device) == ("auto", 131072, 40.5, "cpu")
    tf_env.setenv("TF_PARALLEL", "8")
    assert Settings().parallel == 8


def test_empty_means_unset_except_for_tf_plugins(tf_env: pytest.MonkeyPatch) -> None:
    for name in ("TF_KV_SHARE", "TF_CONTEXT", "TF_KV_PAGES", "TF_PLUGINS", "TF_PARALLEL"):
        tf_env.setenv(name, "")
    s = Settings()
    assert (s.kv_share, s.context, s.kv_pages, s.parallel) == (None, None, "auto", 1)
    assert s.plugins == ""


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        ("TF_KV_PAGES", "maybe", "auto, on, off, 0"),
        ("TF_PARALLEL", "0", "auto, an integer > 0"),
        ("TF_KV_SHARE", "-1", "an integer >= 0"),
        ("TF_DEVICE", "tpu", "auto, cpu, cuda"),
    ],
)
def test_invalid_value_names_the_variable_and_the_accepted_values(
    tf_env: pytest.MonkeyPatch, name: str, value: str, accepted: str
) -> None:
    tf_env.setenv(name, value)
    with pytest.raises(SettingsError) as err:
        Settings()
    assert str(err.value) == f"{name}={value} is not valid; accepted values: {accepted}"


def test_flags_override_and_none_is_ignored(tf_env: pytest.MonkeyPatch) -> None:
    tf_env.setenv("TF_PARALLEL", "4")
    s = Settings()
    assert s.with_overrides(parallel=None, context=None) is s
    t = s.with_overrides(parallel=2, context=4096)
    assert (t.parallel, t.context, s.parallel) == (2, 4096, 4)
    with pytest.raises(SettingsError, match="^--parallel=0 is not valid"):
        s.with_overrides(parallel=0)
    with pytest.raises(TypeError, match="not settings: host"):
        s.with_overrides(host="0.0.0.0")


def test_plugin_value(tf_env: pytest.MonkeyPatch) -> None:
    tf_env.setenv("TF_GLM_INDEXER", "off")
    s = Settings()
    assert s.plugin_value("TF_GLM_INDEXER") == "off"
    assert s.plugin_value("TF_GLM_OTHER") is None
    with pytest.raises(ValueError):
        s.plugin_value("GLM_INDEXER")


@pytest.mark.parametrize("value", [None, "0", ""])
def test_retired_setting_unset_zero_or_empty_starts(
    tf_env: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is not None:
        tf_env.setenv("TF_GLM_KV_SHARE", value)
    assert check_environment(Settings(), [RETIRED]) == []


@pytest.mark.parametrize("value", ["16", "yes"])
def test_retired_setting_with_a_value_is_refused_naming_the_replacement(
    tf_env: pytest.MonkeyPatch, value: str
) -> None:
    tf_env.setenv("TF_GLM_KV_SHARE", value)
    with pytest.raises(SettingsError) as err:
        check_environment(Settings(), [RETIRED])
    assert str(err.value) == (
        f"TF_GLM_KV_SHARE is retired; use TF_KV_SHARE instead (found TF_GLM_KV_SHARE={value})"
    )


def test_unknown_tf_names_warn(tf_env: pytest.MonkeyPatch) -> None:
    tf_env.setenv("TF_KV_SHAER", "16")
    tf_env.setenv("TF_GLM_INDEXER", "off")  # a plugin's row knows it
    tf_env.setenv("TF_KV_SHARE", "16")
    with capture_logs() as logs:
        unknown = check_environment(Settings(), [GLM_ROW])
    assert unknown == ["TF_KV_SHAER"]
    [warning] = logs
    assert warning["log_level"] == "warning" and warning["names"] == ["TF_KV_SHAER"]


def test_start_checks_refuse_a_retired_setting_from_a_plugin_row(
    tf_env: pytest.MonkeyPatch, pm: PluginManager
) -> None:
    pm.add_plugin(FamiliesPlugin("glm5_next", rows=(RETIRED,)), "glm", "tensorfold-glm", "1")
    tf_env.setenv("TF_GLM_KV_SHARE", "16")
    with pytest.raises(SettingsError, match="use TF_KV_SHARE instead"):
        cli.start_checks(Settings(), pm)
    tf_env.setenv("TF_GLM_KV_SHARE", "0")
    assert cli.start_checks(Settings(), pm) is pm


def test_cli_invalid_setting_is_one_line_and_exit_2(
    no_installed_plugins: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    no_installed_plugins.setenv("TF_KV_PAGES", "sometimes")
    assert cli.main(["families"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "tensorfold: error: TF_KV_PAGES=sometimes is not valid; accepted values: auto, on, off, 0\n"
    )


def test_json_logs(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        configure_logging("json", "info")
        configure_logging("json", "info")  # idempotent
        get_logger("tensorfold.test").warning("pool uneven", free=3)
        get_logger("tensorfold.test").debug("not shown")
        [line] = capsys.readouterr().err.splitlines()
        event = json.loads(line)
        assert event["event"] == "pool uneven" and event["free"] == 3
        assert event["level"] == "warning" and event["logger"] == "tensorfold.test"
    finally:
        configure_logging()
