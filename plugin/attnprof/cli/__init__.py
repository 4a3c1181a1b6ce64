"""The ``attnprof`` command line.

Every subcommand lives in its own module with ``add_parser(subparsers)``; errors a user can
cause (bad paths, bad numbers, unreachable URLs) end as one ``attnprof: error: ...`` line
and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from attnprof._text import inert
from attnprof.cli._common import CliError

__all__ = ["CliError", "main"]

# Module names under attnprof.cli, in --help order.
SUBCOMMANDS = ("model", "serve", "demo", "snapshot", "trace", "env", "profile", "compat",
               "suggest", "validate", "validate_heads", "tensorboard", "record", "diff", "probe",
               "report", "whatif", "container_start")


def _one_line(message: str) -> str:
    """An error is one printable line, whatever value or file name it quotes."""
    return inert(message)


class _Parser(argparse.ArgumentParser):
    """Usage errors (an unknown flag, ``--port abc``) are one line too, naming ``--help``;
    subcommand parsers are of this class as well (argparse reuses the parent's)."""

    def error(self, message: str) -> NoReturn:
        msg = _one_line(" ".join(message.split()))
        self.exit(2, f"attnprof: error: {msg} (see {self.prog} --help)\n")

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # Python < 3.13 drops an option's value that is exactly "--" (``--steps=--``) and
        # hands the command an empty list, a TypeError later: take it as the value, as 3.13.
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)


def build_parser() -> argparse.ArgumentParser:
    from attnprof import __version__

    parser = _Parser(
        prog="attnprof", description="Attention profiler for LLM serving (vLLM, transformers).")
    parser.add_argument("--version", action="version", version=f"attnprof {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"attnprof.cli.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from attnprof.config import ConfigError

    try:
        rc = args.func(args)
    except (CliError, ConfigError) as err:  # ConfigError: a bad ATTNPROF_* the command read
        # One line, whatever a message quotes (a file's key, a server's answer, a path).
        print(f"attnprof: error: {_one_line(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnprof: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
