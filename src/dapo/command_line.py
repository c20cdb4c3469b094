"""The frame of the ``dapo`` command (its commands are ``dapo.cli``'s): the registry commands join, the parser built
from it (``--version``, ``did you mean`` for a misspelt command, each command's help with its settings and their
defaults), and the line an error a user can fix becomes."""

from __future__ import annotations

import argparse
import difflib
import subprocess
from pathlib import Path

from dapo.config import PRESET_DIR
from dapo.config.summary import settings_summary

# each command's name, handler, one-line help, its own arguments and parser keywords, in the order of `dapo --help`;
# build_parser adds --verbose to each, and to those that take key=value overrides the settings of the config tree
# (a command's "settings" keyword: the function that says them, settings_summary by default)
COMMANDS: dict[str, tuple] = {}


def arg(*names, **kw) -> tuple:
    return names, kw


def command(name: str, help: str, *arguments, **parser_kw):
    """Register the decorated function as ``dapo NAME``; an argument is an ``arg`` or a function that adds some."""

    def register(func):
        COMMANDS[name] = (func, help, arguments, parser_kw)
        return func

    return register


def version_line() -> str:
    """``dapo 0.1.0``, with the commit of the source tree it runs from where that is a git checkout."""
    from dapo import __version__

    root = Path(__file__).resolve().parents[2]
    commit = ""
    if (root / ".git").exists():
        try:
            found = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            )
            commit = f" (commit {found.stdout.strip()})" if found.returncode == 0 and found.stdout.strip() else ""
        except (OSError, subprocess.SubprocessError):  # no git on this machine: the version alone
            pass
    return f"dapo {__version__}{commit}"


class _Version(argparse.Action):
    """``--version``: the version line, asked for only when given (the commit takes a call to git)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the version (and the commit) and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default (none for flags and options without one)."""

    def _fill_text(self, text, width, indent):  # the settings come wrapped, one section a line
        return text if "\n" in text else super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        if any(action.default is x for x in (None, False, argparse.SUPPRESS)) or "default" in (action.help or ""):
            return action.help
        if action.nargs in ("*", "?") and action.option_strings == []:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from dapo import ablate

    parser = argparse.ArgumentParser(prog="dapo", description="DAPO reinforcement learning for language models")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--verbose",
        action="store_true",
        help="show every library message (vLLM, Ray, transformers) and the traceback of an error",
    )
    rows = len(ablate.find_rows(PRESET_DIR / "ablation"))
    ablate_command = (
        ablate.main_args,
        "the paper's ablation: every row x seed trained, evaluated and reported",
        (ablate.add_arguments,),
        {
            "description": f"The paper's ablation: every row (configs/ablation/<k>_<name>.yaml) x seed is one "
            f"training run, then evaluated and reported. Bare, it runs all {rows} rows x 5 seeds "
            f"({5 * rows} runs and one base-model evaluation) into runs/ablation: about 30 minutes on "
            "2 CPU cores (docs/ablation.md). A quick look: dapo ablate --rows grpo no_overlong_filtering --seeds 1"
        },
    )
    for name, (func, help, arguments, parser_kw) in {**COMMANDS, "ablate": ablate_command}.items():
        takes_settings = any(callable(a) or a[0] in (("overrides",), ("items",)) for a in arguments)  # key=value
        kw = dict(parser_kw)
        says = kw.pop("settings", settings_summary)
        p = sub.add_parser(
            name,
            help=help,
            parents=[common],
            **{"formatter_class": _Help, "epilog": says() if takes_settings else None, **kw},
        )
        for a in arguments:
            a(p) if callable(a) else p.add_argument(*a[0], **a[1])
        p.set_defaults(func=func)
    return parser


def misspelt_command(argv: list[str]) -> str | None:
    """The error for a first argument that is no command (``dapo trian``): the commands it is closest to."""
    if not argv or argv[0].startswith("-") or argv[0] in COMMANDS or argv[0] == "ablate":
        return None
    names = [*COMMANDS, "ablate"]
    close = difflib.get_close_matches(argv[0], names, n=2, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"unknown command {argv[0]!r}; {hint}the commands are {', '.join(names)} (dapo --help)"


# errors a user causes (config, data, paths, checkpoints) and whose message says what to change
ONE_LINE = (
    "ConfigError",
    "DataError",
    "GenerationCapError",
    "CheckpointError",
    "FileNotFoundError",
    "FileExistsError",
    "NotADirectoryError",
    "IsADirectoryError",
    "PermissionError",
    "RewardFnError",  # a reward function (reward.function's) that returned no score
)


def user_error(err: BaseException) -> str | None:
    """The one line ``error: ...`` for an error the user can fix, or None for a fault to show in full.
    A ValueError, RuntimeError or ImportError counts when this package raised it (its messages name
    the setting and the fix); from inside a library it is a fault. An error listing several things (a data file's
    bad rows: its ``lines``) keeps one line each under its first."""
    known = any(t.__name__ in ONE_LINE for t in type(err).__mro__)
    maybe_ours = isinstance(err, (ValueError, RuntimeError, ImportError)) and not isinstance(err, NotImplementedError)
    if not known and maybe_ours:
        from dapo.runtime.libraries import raised_outside

        known = not raised_outside(err)
    if not known:
        return None
    lines = getattr(err, "lines", None)
    if lines and len(lines) > 1 and getattr(err, "header", None):
        return "\n  ".join(["error: " + " ".join(err.header.split()), *(" ".join(line.split()) for line in lines)])
    return "error: " + (" ".join(str(err).split()) or type(err).__name__)
