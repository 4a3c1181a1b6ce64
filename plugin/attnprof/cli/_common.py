"""Shared CLI helpers: the user-error type, atomic file writes, progress bars."""

from __future__ import annotations

import json
import os
import tempfile
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


def _umask() -> int:
    """The process umask, read without changing it where Linux says it (os.umask can only
    be read by setting it, which would race with any other thread creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write via a temp file + rename so a crash never leaves half a file."""
    ensure_writable_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        # mkstemp makes 0600; give the file the mode a plain open() would (umask applied).
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
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
