"""The `tensorfold` command line.

Subcommands are registered with `register_command(name, help, add_arguments, run)`. Either
function may be a "module:function" string: `add_arguments` is imported when the parser is
built (keep its module light), `run` only when that subcommand runs, so `tensorfold families`
never imports torch. `run(args, settings) -> int` gets the parsed arguments and the settings
with every flag whose dest names a `Settings` field applied (`--parallel` -> `parallel`).
Commands that load a model call `start_checks(settings)` first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tensorfold import __version__
from tensorfold.config.logs import configure_logging
from tensorfold.config.settings import Settings, SettingsError, check_environment
from tensorfold.family import ShardRefused, resolve
from tensorfold.family.checkpoint import CheckpointError
from tensorfold.family.plugins import (
    FamilyError,
    PluginManager,
    families,
    get_plugin_manager,
    list_plugins,
)
from tensorfold.family.profiles import ProfileError, collect_rows, render_markdown, render_table
from tensorfold.memory.kv_plan import PlanRefused

AddArguments = Callable[[argparse.ArgumentParser], None]
F = TypeVar("F", bound=Callable[..., object])
Run = Callable[[argparse.Namespace, Settings], int]


class CommandError(Exception):
    """Raised by a subcommand to print one line to stderr and exit with status 2."""


# Errors that are the user's to fix: one line on stderr, exit status 2, no traceback.
USER_ERRORS: tuple[type[Exception], ...] = (
    CommandError,
    FamilyError,
    ProfileError,
    SettingsError,
    CheckpointError,
    PlanRefused,
    ShardRefused,
)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: AddArguments | str
    run: Run | str


COMMANDS: dict[str, Command] = {}


def register_command(
    name: str, help: str, add_arguments: AddArguments | str, run: Run | str
) -> None:
    """Add a subcommand; functions may be given as "module:function" strings (see above)."""
    if name in COMMANDS:
        raise ValueError(f"subcommand {name!r} is registered twice")
    COMMANDS[name] = Command(name, help, add_arguments, run)


def add_reasoning_argument(parser: argparse.ArgumentParser) -> None:
    """--reasoning (TF_REASONING), for the commands that render chats."""
    parser.add_argument(
        "--reasoning",
        choices=["on", "off", "auto"],
        help=_setting_help(
            "thinking for chats that do not say: the template's enable_thinking, or "
            "auto: the template's own default",
            "reasoning",
        ),
    )


def add_family_arguments(parser: argparse.ArgumentParser) -> None:
    """--family and --model, shared by the subcommands that load a model."""
    parser.add_argument(
        "--family",
        metavar="NAME",
        help="model family (default: TF_FAMILY, else the one that serves --model's config.json "
        "model_type / architectures, else the only installed one, else of several the default "
        "one: lfm2_moe when installed; `tensorfold families` lists them)",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        help="checkpoint folder, e.g. a Hugging Face snapshot with config.json, *.safetensors "
        "and tokenizer.json (default: the family's demo checkpoint, built in TF_DEMO_CACHE)",
    )


def _setting_help(text: str, name: str) -> str:
    """Help for a flag that overrides a setting: its TF_* name and its default."""
    from tensorfold.config.settings import env_name
    from tensorfold.family.profiles import show_default

    default = Settings.model_fields[name].get_default(call_default_factory=True)
    return f"{text} ({env_name(name)}, default {show_default(default)})"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The memory plan's flags (each overrides its TF_* setting)."""
    parser.add_argument(
        "--parallel",
        metavar="N|auto",
        help=_setting_help("lanes: streams decoded together", "parallel"),
    )
    parser.add_argument(
        "--context",
        type=int,
        metavar="TOKENS",
        help=_setting_help("the window a stream may reach; unset: the model's maximum", "context"),
    )
    parser.add_argument(
        "--prompt-cache-gib",
        type=float,
        metavar="GIB",
        help=_setting_help("the prompt store's budget", "prompt_cache_gib"),
    )
    parser.add_argument(
        "--kv-dtype",
        metavar="auto|fp8",
        help=_setting_help("the dtype paged KV rows are stored in", "kv_dtype"),
    )
    parser.add_argument(
        "--quantization",
        metavar="auto|fp8",
        help=_setting_help("weights quantized at load: fp8 (docs/fp8.md)", "quantization"),
    )
    parser.add_argument(
        "--tp",
        type=int,
        metavar="N",
        help=_setting_help("tensor-parallel ranks on this host, one a device", "tp"),
    )
    parser.add_argument(
        "--draft",
        choices=["off", "ngram", "model", "mtp"],
        help=_setting_help(
            "drafts for every stream, verified token by token: ngram proposes what followed "
            "the stream's last tokens earlier in its prompt and output, model the family's "
            "draft checkpoint (--draft-model), mtp the checkpoint's own MTP layer",
            "draft",
        ),
    )
    parser.add_argument(
        "--draft-model",
        metavar="DIR",
        help=_setting_help("the draft checkpoint for --draft model", "draft_model"),
    )
    parser.add_argument(
        "--draft-tokens",
        type=int,
        metavar="K",
        help=_setting_help("the most drafts a stream proposes a round", "draft_tokens"),
    )
    parser.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        help=_setting_help(
            "dummy: random weights at the checkpoint's config, for benchmarks", "load_format"
        ),
    )


class HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" to a flag's help when it has a default its text does not name."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "default" not in text
            and "%(default)" not in text
            and default is not None
            and default is not False
            and default is not argparse.SUPPRESS
        ):
            text += " (default: %(default)s)"
        return text


def start_checks(settings: Settings, pm: PluginManager | None = None) -> PluginManager:
    """Run before anything loads: checks the TF_* environment against the core's and every
    plugin's profile rows (unknown names warn; a retired setting raises SettingsError).
    Returns the plugin manager, for `choose_family`."""
    pm = pm or get_plugin_manager(settings)
    check_environment(settings, collect_rows(pm))
    return pm


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The TF_* settings with the flags given on the command line applied over them."""
    flags = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    return Settings().with_overrides(**flags)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; `parser.commands` maps each subcommand to its own parser."""
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: absent unless given, so the option works before or after the subcommand.
    common.add_argument(
        "--log-format",
        choices=["console", "json"],
        default=argparse.SUPPRESS,
        help="readable lines or JSON lines (default: TF_LOG_FORMAT, else console)",
    )
    common.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error", "critical"],
        default=argparse.SUPPRESS,
        help="lowest level logged (default: TF_LOG_LEVEL, else info)",
    )
    parser = argparse.ArgumentParser(
        prog="tensorfold",
        parents=[common],
        description="Serve large language models.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tensorfold {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    children = {}
    for command in COMMANDS.values():
        child = sub.add_parser(
            command.name,
            parents=[common],
            help=command.help,
            description=command.help,
            formatter_class=HelpFormatter,
        )
        _function(command.add_arguments)(child)
        for nested in walk_parsers(child):  # nested subcommands (`bench openai`) alike
            nested.formatter_class = HelpFormatter
        children[command.name] = child
    parser.commands = children  # type: ignore[attr-defined]
    return parser


def walk_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser` and every subcommand parser under it, at any depth."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += walk_parsers(child)
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; a flag a subcommand does not know is reported with that
    subcommand's usage (argparse alone would show the top-level one)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        child = parser.commands[args.command]  # type: ignore[attr-defined]
        while True:  # down to the innermost subcommand given (`bench openai`)
            nested = [a for a in child._actions if isinstance(a, argparse._SubParsersAction)]
            if not nested or getattr(args, nested[0].dest, None) not in nested[0].choices:
                break
            child = nested[0].choices[getattr(args, nested[0].dest)]
        child.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _function(ref: F | str) -> F:
    return resolve(ref) if isinstance(ref, str) else ref


def main(argv: list[str] | None = None) -> int:
    """The `tensorfold` console script."""
    args = parse_args(argv)
    try:
        settings = settings_from_args(args)
        configure_logging(settings.log_format, settings.log_level)
        status = _function(COMMANDS[args.command].run)(args, settings)
    except USER_ERRORS as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"tensorfold: error: {message}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if not getattr(exc, "fatal", False):  # a tensor-parallel rank was lost: said in one line
            raise
        print(f"tensorfold: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return int(status or 0)


# Built-in subcommands. Others register from here with strings, so nothing heavy is imported
# until they run, e.g.:
#   register_command("serve", "serve a model over HTTP (OpenAI API)",
#                    "tensorfold.cli.serve:add_arguments", "tensorfold.cli.serve:run")


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def _print_columns(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])


def _run_families(args: argparse.Namespace, settings: Settings) -> int:
    found = families(get_plugin_manager(settings))
    if not found:
        print("no model families are installed")
        return 0
    rows = [("NAME", "DISTRIBUTION", "VERSION", "SERVES", "DESCRIPTION")]
    rows += [
        (s.name, s.distribution, s.version, ",".join(s.serves) or "-", s.description)
        for s in found.values()
    ]
    _print_columns(rows)
    return 0


def _add_profiles_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--markdown", action="store_true", help="print docs/profiles.md as it must read"
    )


def _run_profiles(args: argparse.Namespace, settings: Settings) -> int:
    rows = collect_rows(get_plugin_manager(settings))
    sys.stdout.write(render_markdown(rows) if args.markdown else render_table(rows))
    return 0


def _run_plugins(args: argparse.Namespace, settings: Settings) -> int:
    pm = get_plugin_manager(settings)
    rows = [("NAME", "DISTRIBUTION", "VERSION", "HOOKS")]
    rows += [(p.name, p.distribution, p.version, ", ".join(p.hooks)) for p in list_plugins(pm)]
    rows += [(name, "", "", f"FAILED TO LOAD: {why}") for name, why in pm.failures.items()]
    if len(rows) == 1:
        print("no plugins are loaded")
        return 0
    _print_columns(rows)
    return 0


register_command("families", "list the installed model families", _no_arguments, _run_families)
register_command(
    "profiles", "list every TF_* setting (core and plugins)", _add_profiles_arguments, _run_profiles
)
register_command("plugins", "list the loaded plugins and their hooks", _no_arguments, _run_plugins)
register_command(
    "generate",
    "complete prompts offline, through the lanes",
    "tensorfold.cli.generate:add_arguments",
    "tensorfold.cli.generate:run",
)
register_command(
    "serve",
    "serve a model over HTTP (OpenAI API)",
    "tensorfold.cli.serve:add_arguments",
    "tensorfold.cli.serve:run",
)  # noqa: E501
register_command(
    "bench",
    "benchmark a running server",
    "tensorfold.cli.bench:add_arguments",
    "tensorfold.cli.bench:run",
)  # noqa: E501
register_command(
    "exact",
    "record and compare token hashes",
    "tensorfold.cli.exact:add_arguments",
    "tensorfold.cli.exact:run",
)  # noqa: E501


if __name__ == "__main__":
    sys.exit(main())
