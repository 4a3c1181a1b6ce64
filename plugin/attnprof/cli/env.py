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


def _run(args: argparse.Namespace) -> int:
    from attnprof.config import Config, ConfigError
    from attnprof.contracts.redact import is_secret_name, redact_value
    from attnprof.environment_variables import VARIABLES, markdown_table

    if args.markdown:
        print(markdown_table())
        return 0
    for v in VARIABLES:
        cur = os.environ.get(v.name)
        # A credential (ATTNPROF_API_KEY) is never printed; other values lose URL secrets.
        if cur is not None:
            cur = "(set, not shown)" if is_secret_name(v.name) else redact_value(cur)
        print(f"{v.name:30} {('=' + cur) if cur is not None else '(default ' + v.default + ')'}")
    try:
        Config.from_env()
    except ConfigError as err:
        print(f"invalid: {err}")
        return 1
    return 0
