"""Shared CLI helpers: the user-error type, checks made before long work starts (output
files, optional packages, the model), atomic file writes, progress bars."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import secrets
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnprof.facts import durations

__all__ = [
    "MAX_LENGTH",
    "CliError",
    "StopSignals",
    "api_key_arg",
    "check_lengths",
    "check_out_file",
    "ensure_writable_dir",
    "int_in_range",
    "label_arg",
    "out_dir_arg",
    "parse_seconds",
    "price_arg",
    "progress_bar",
    "read_json",
    "require_module",
    "resolve_model",
    "write_atomic",
    "write_json",
]

MAX_LENGTH = 2**31 - 1
"""Largest context length (tokens) any parser accepts: what int32 kernels index."""


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


def check_out_file(path: Path, flag: str = "--out") -> Path:
    """Refuse an output file that cannot be written (a directory, a parent that is a file or
    not writable) before the work that produces it starts; creates nothing."""
    if path.is_dir():
        raise CliError(f"{flag} {str(path)!r} is a directory; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise CliError(f"{flag} {str(path)!r} is not writable")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the directories in between are created when writing
    if not parent.is_dir():
        raise CliError(f"{flag} {str(path)!r}: {str(parent)!r} is not a directory")
    try:  # for real: os.access says yes to root in /proc, /sys or on a read-only mount
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError:
        raise CliError(f"{flag} {str(path)!r}: output directory {str(parent)!r} is not "
                       "writable") from None
    return path


def require_module(name: str, why: str, extra: str) -> None:
    """:class:`CliError` now, not after minutes of work, when an optional package is missing."""
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise CliError(f"{why} needs {name}, which is not installed: "
                       f"pip install 'attnprof[{extra}]'")


def int_in_range(value: int, flag: str, lo: int, hi: int) -> int:
    """``value`` when ``lo <= value <= hi``; :class:`CliError` naming ``flag`` otherwise."""
    if not lo <= value <= hi:
        raise CliError(f"{flag} must be an integer in {lo}..{hi}, got {value}")
    return value


def int_arg(lo: int, hi: int) -> Callable[[str], int]:
    """argparse type of an integer in ``lo..hi`` (a usage error, one line, otherwise)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"{n} is not in {lo}..{hi}") from None
        return n

    return parse


def check_lengths(dist: Any, source: str) -> Any:
    """A :class:`LengthDistribution` whose lengths and weights a cost model can use:
    :class:`CliError` for a length above :data:`MAX_LENGTH` or a weight that is not finite."""
    import math

    if dist.lengths and max(dist.lengths) > MAX_LENGTH:
        raise CliError(f"{source}: a context length of {max(dist.lengths)} tokens is above "
                       f"the maximum {MAX_LENGTH}")
    if not all(math.isfinite(w) for w in dist.weights) or not math.isfinite(
            sum(dist.weights)):
        raise CliError(f"{source}: request counts must be finite numbers")
    return dist


def resolve_model(spec: str) -> Path:
    """``smollm2`` (the verified cache) or a local checkpoint directory; :class:`CliError`
    (one line) when missing, not a checkpoint, or the cache's manifest is damaged."""
    from attnprof.config import ConfigError
    from attnprof.tools import models

    try:
        return models.resolve_model(spec)
    except models.ModelCacheError as err:
        raise CliError(str(err)) from None
    except ConfigError:  # a bad ATTNPROF_HOME, said as such (not as a corrupt cache)
        raise
    except (AttributeError, TypeError, ValueError) as err:
        # A manifest of the wrong shape (e.g. "files": [] where an object is expected).
        raise CliError(f"the model cache for {spec!r} is corrupt ({type(err).__name__} "
                       f"reading its {models.MANIFEST}): {models.FETCH_HINT}") from None


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write via a temp file + rename so a crash never leaves half a file. The temp file is
    created with mode 0666 and exclusively (a random name, O_EXCL), so the kernel applies the
    umask and the directory's default ACL exactly as for a plain open()."""
    ensure_writable_dir(path.parent)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o666)
    except OSError as err:  # a directory root may create but not write in (/sys)
        raise CliError(f"cannot write {str(path)!r}: {err.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):  # a full disk, a quota: one line, not a traceback
            raise CliError(f"cannot write {str(path)!r}: {err.strerror or err}") from None
        raise


def read_json(path: Path) -> Any:
    """A JSON file's content, or :class:`CliError` (one line) when unreadable or malformed."""
    try:
        return json.loads(path.read_text())
    except OSError as err:
        raise CliError(f"cannot read {str(path)!r}: {err.strerror}") from None
    except (ValueError, RecursionError):  # RecursionError: nested too deep to read
        raise CliError(f"{path}: malformed JSON") from None


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def progress_bar(total: int, desc: str, unit: str = "it") -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=True)


def parse_seconds(text: str, flag: str) -> float:
    """A local duration (:func:`attnprof.facts.durations.seconds`: ``10s``, ``500ms``, ``2m``,
    ``1h``, ``1.5``) in seconds; :class:`CliError` (one line) otherwise."""
    try:
        return durations.seconds(text, flag)
    except durations.DurationError as err:
        raise CliError(str(err)) from None


def price_arg(text: str) -> float:
    """argparse type of a price: a finite number >= 0 (a usage error otherwise)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number (e.g. 2.50)") from None
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: a price must be a finite number "
                                         ">= 0") from None
    return x


def api_key_arg(text: str) -> str:
    """argparse type of ``--api-key``: a token an HTTP header can carry. Empty is refused (a
    variable that was not set, not "use the environment's key"); the message never repeats
    the key."""
    if not text:
        raise argparse.ArgumentTypeError("the API key is empty")
    if not all(0x20 < ord(c) < 0x7F for c in text):
        raise argparse.ArgumentTypeError("the API key contains spaces, control or non-ASCII "
                                         "characters; an HTTP header cannot carry it")
    return text


def label_arg(text: str) -> str:
    """argparse type of a model label to select series by: not empty (which would select
    every model), no control characters, nothing undecodable (bytes that are not UTF-8)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty model label (leave the flag out for every "
                                         "model)")
    if any(ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF for c in text):
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: control characters or bytes that "
                                         "are not UTF-8 in a label")
    return text


def out_dir_arg(text: str) -> Path:
    """argparse type of an output directory: an empty value (an unset variable) would
    otherwise be the current directory."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (give a directory)")
    return Path(text)


class StopSignals:
    """Ctrl-C, SIGTERM (and any other signals named) ask a long-running command to stop by
    raising a flag its loop reads, never by raising from the handler: an exception raised
    from a handler lands wherever the interpreter happens to be, and inside a weakref or
    ``__del__`` callback Python prints it as "Exception ignored" and carries on, so the stop
    is lost (it was, in CI). SIGINT is installed explicitly since a background job inherits
    it ignored. The previous handlers come back on exit."""

    def __init__(self, *extra: signal.Signals) -> None:
        self.signals = (signal.SIGINT, signal.SIGTERM, *extra)
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self._old = {s: signal.signal(s, self._handler) for s in self.signals}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handler(self, signum: int, frame: Any) -> None:
        self.received.append(signum)

    @property
    def requested(self) -> bool:
        return bool(self.received)

    def nap(self, seconds: float) -> bool:
        """Sleep up to ``seconds`` in 0.1 s slices, so a stop is acted on within 0.1 s
        (``time.sleep`` resumes after a handler that does not raise); True if asked to stop."""
        end = time.monotonic() + seconds
        while not self.received and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))
        return self.requested


def check_out_dir(out: Path, flag: str = "--out") -> None:
    """Refuse an --out that cannot become a writable directory, creating nothing (the
    report is written only once all of it is rendered)."""
    import tempfile

    def writable(d: Path) -> bool:  # for real: os.access says yes to root in /proc, /sys
        try:
            with tempfile.TemporaryFile(dir=d):
                return True
        except OSError:
            return False

    if out.exists():
        if not out.is_dir():
            raise CliError(f"{flag} {str(out)!r} is a file; give a directory")
        if not writable(out):
            raise CliError(f"{flag} {str(out)!r} is not writable")
        return
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not writable(parent):
        raise CliError(f"{flag} {str(out)!r} cannot be created ({str(parent)!r} is not a "
                       "writable directory)")
