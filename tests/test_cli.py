"""The command line explains itself: help on every flag with its default, a subcommand's usage
on its errors, a busy port said before any weight loads, the idle census at debug level."""

from __future__ import annotations

import argparse
import json
import socket

import pytest
from structlog.testing import capture_logs

from tensorfold.cli import commands as cli
from tensorfold.config import logs as tf_logs
from tensorfold.engine import start
from tensorfold.engine.lanes import Lanes
from tensorfold.memory.kv_pool import KVPool


def options() -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    found = []
    for command, child in cli.build_parser().commands.items():
        for parser in cli.walk_parsers(child):
            for action in parser._actions:
                if action.option_strings and not isinstance(
                    action, (argparse._HelpAction, argparse._VersionAction)
                ):
                    found.append((parser.prog, parser, action))
    return found


def test_every_flag_has_help_that_names_its_default() -> None:
    assert len(options()) > 40
    for prog, parser, action in options():
        text = parser._get_formatter()._get_help_string(action)
        assert text and text.strip(), f"{prog} {action.option_strings[0]} has no help"
        if action.default is not None and action.default is not False:
            assert "default" in text, f"{prog} {action.option_strings[0]}: {text!r}"


def test_serve_help_shows_host_and_port_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--host HOST address to listen on (default: 127.0.0.1)" in out
    assert "(default: 8000)" in out


def test_generate_sampling_flags_are_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split("options:")[1].split())
    for flag, default in [
        ("--max-tokens N", "32"),
        ("--temperature T", "0.0"),
        ("--top-p P", "1.0"),
        ("--top-k K", "0"),
    ]:
        at = out.index(flag)
        assert f"(default: {default})" in out[at : out.index("--", at + len(flag))], flag
    assert "--seed N seed of the sampling draws" in out


@pytest.mark.parametrize(
    "argv, usage",
    [
        (["serve", "--bogus"], "usage: tensorfold serve "),
        (["generate", "hi", "--bogus"], "usage: tensorfold generate "),
        (["bench", "openai", "--bogus"], "usage: tensorfold bench openai "),
    ],
)
def test_an_unknown_flag_shows_the_subcommands_usage(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "unrecognized arguments: --bogus" in err, err


def test_a_busy_port_is_said_before_the_model_opens(
    tf_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    opened = []
    tf_env.setattr(start, "open_served", lambda *a, **k: opened.append(a) or 1 / 0)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert opened == []
    assert err.startswith(f"tensorfold: error: cannot listen on 127.0.0.1:{port}: ")
    assert "choose another with --port" in err and err.count("\n") == 1


def test_listen_on_port_0_takes_a_free_port() -> None:
    from tensorfold.cli.serve import listen

    with listen("127.0.0.1", 0) as sock:
        assert sock.getsockname()[1] > 0


def test_idle_census_is_debug_and_an_uneven_one_an_error() -> None:
    pool = KVPool(4, page_rows=4)
    lanes = Lanes.__new__(Lanes)  # census() reads only the pool and the uneven count
    lanes.pool, lanes.uneven = pool, 0
    before = tf_logs._configured or ("console", "info")
    tf_logs.configure_logging(before[0], "debug")  # debug lines are dropped at info
    try:
        with capture_logs() as logs:
            assert lanes.census()
            lease = pool.lease(5)
            lease.cover(5)
            assert not lanes.census()
    finally:
        tf_logs.configure_logging(*before)
    assert [(e["log_level"], e["event"][:12]) for e in logs] == [
        ("debug", "kv pool idle"),
        ("error", "UNEVEN kv po"),
    ]
    assert lanes.uneven == 1


def test_generate_with_no_family_named_runs_the_default_demo(
    tf_env: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's `tensorfold generate "Once upon a time"`, with whatever is installed (all
    three families in the test environment): the default family's demo writes words."""
    pytest.importorskip("tensorfold_lfm2_moe")
    from tensorfold.family.demo_text import known_share
    from tensorfold.family.plugins import reset_plugin_manager

    tf_env.setenv("TF_DEMO_CACHE", str(tmp_path))
    reset_plugin_manager()
    with capture_logs() as logs:
        assert (
            cli.main(["generate", "Once upon a time", "--max-tokens", "16", "--context", "1024"])
            == 0
        )
    out = capsys.readouterr().out
    assert out.startswith("'Once upon a time' -> ") and known_share(out) >= 0.8, out
    said = [e["event"] for e in logs if e["event"].startswith("lfm2_moe-demo: family lfm2_moe")]
    assert len(said) == 1, logs


def test_generate_chat_prints_the_demos_thought_apart_and_reasoning_off_drops_it(
    tf_env: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's `tensorfold generate --chat`: the demo's thinking is split from its answer
    (the markers are in neither), and `--reasoning off` turns it off."""
    pytest.importorskip("tensorfold_lfm2_moe")
    from tensorfold.family.plugins import reset_plugin_manager

    tf_env.setenv("TF_DEMO_CACHE", str(tmp_path))
    reset_plugin_manager()
    ask = ["generate", "--chat", "What is the capital of France?", "--context", "1024"]
    assert cli.main([*ask, "--max-tokens", "40", "--json"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["reasoning_content"] and "Paris" in on["content"], on
    assert "<think>" in on["text"] and "think>" not in on["content"] + on["reasoning_content"]
    assert cli.main([*ask, "--max-tokens", "40", "--reasoning", "off"]) == 0
    off = capsys.readouterr().out
    assert " thinks " not in off and "Paris" in off, off
