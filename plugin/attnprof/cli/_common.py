"""Shared CLI helpers: the user-error type, atomic file writes, progress bars."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

__all__ = ["CliError", "progress_bar", "read_json", "write_atomic", "write_json"]


class CliError(Exception):
    """A user-caused error: printed as one line, exit code 2."""


def ensure_writable_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cannot create output directory {str(path)!r}: {exc.strerror}") from None
    if not os.access(path, os.W_OK):
        raise CliError(f"output directory {str(path)!r} is not writable")
    return path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write via a temp file + rename so a crash never leaves half a file. The temp file is
    created with mode 0666 and exclusively (a random name, O_EXCL), so the kernel applies the
    umask and the directory's default ACL exactly as for a plain open()."""
    ensure_writable_dir(path.parent)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path) -> Any:
    """A JSON file's content, or :class:`CliError` (one line) when unreadable or malformed."""
    try:
        return json.loads(path.read_text())
    except OSError as err:
        raise CliError(f"cannot read {str(path)!r}: {err.strerror}") from None
    except ValueError:
        raise CliError(f"{path}: malformed JSON") from None


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def progress_bar(total: int, desc: str, unit: str = "it") -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=True)
