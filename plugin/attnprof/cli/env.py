"""``attnprof env``: every ATTNPROF_* variable and its current value."""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("env", help="list ATTNPROF_* variables (--markdown: the README table)")
    p.add_argument("--markdown", action="store_true", help="print the README configuration table")
    p.set_defaults(func=_run)


def _secret(name: str) -> bool:
    """A variable holding a credential (ATTNPROF_API_KEY): its value is never printed."""
    return name.endswith(("_KEY", "_TOKEN", "_SECRET", "_PASSWORD"))


def _run(args: argparse.Namespace) -> int:
    from attnprof.config import Config, ConfigError
    from attnprof.environment_variables import VARIABLES, markdown_table

    if args.markdown:
        print(markdown_table())
        return 0
    for v in VARIABLES:
        cur = os.environ.get(v.name)
        if cur is not None and _secret(v.name):
            cur = "(set, not shown)"
        print(f"{v.name:30} {('=' + cur) if cur is not None else '(default ' + v.default + ')'}")
    try:
        Config.from_env()
    except ConfigError as err:
        print(f"invalid: {err}")
        return 1
    return 0
