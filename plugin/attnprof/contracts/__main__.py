"""``python -m attnprof.contracts [--check] [--out DIR]``: regenerate docs/schema/."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnprof.contracts.schemas import SCHEMA_DIR, stale, write


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnprof.contracts",
                                description="Write the JSON Schema of every attnprof document.")
    p.add_argument("--out", type=Path, default=SCHEMA_DIR,
                   help=f"directory to write (default {SCHEMA_DIR})")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 and name the files that are not current")
    args = p.parse_args(argv)
    if args.check:
        old = stale(args.out)
        for name in old:
            print(f"{args.out / name} is not current: run python -m attnprof.contracts",
                  file=sys.stderr)
        return 1 if old else 0
    for path in write(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
