"""What a what-if run reads from a vLLM server's log: its own KV capacity figure and, when it
would not start, the one line that says why.

vLLM 0.32 logs ``CPU KV cache size: 23,296 tokens, Maximum concurrency ...`` (``GPU`` on a
GPU) once the engine has sized its cache; a refused configuration ends the process with a
pydantic ``Value error, ...``, an argparse ``error: ...`` or an exception line.
"""

from __future__ import annotations

import re

__all__ = ["kv_capacity_tokens", "startup_failure"]

_KV = re.compile(r"\b(?:[A-Z]+ )?KV cache size: ([\d,]+) tokens")
_PREFIX = re.compile(r"^\((?:\w+) pid=\d+\)\s*")
_LEVEL = re.compile(r"^(?:ERROR|WARNING|INFO|CRITICAL)\s+\d\d-\d\d [\d:]+ \[[^\]]*\]\s*")
_VALUE_ERROR = re.compile(r"Value error, (.*?)(?: \[type=.*)?$")
_ARGPARSE = re.compile(r"^\S+: error: (.+)$")
_EXC = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")


def kv_capacity_tokens(log_text: str) -> int | None:
    """vLLM's own KV capacity in tokens (the last such line: one engine per server here)."""
    found = _KV.findall(log_text)
    return int(found[-1].replace(",", "")) if found else None


def _short(text: str, limit: int) -> str:
    """One line of at most ``limit`` characters, cut after a sentence where one ends."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    end = text.rfind(". ", 0, limit)
    return text[:end + 1] if end > 40 else text[:limit - 3] + "..."


def _clean(line: str) -> str:
    return _LEVEL.sub("", _PREFIX.sub("", line.strip()))


def startup_failure(log_text: str, limit: int = 300) -> str:
    """The one line saying why vLLM would not start, from its log; a generic line naming the
    log's last words when no known form is found."""
    lines = [_clean(x) for x in log_text.splitlines() if x.strip()]
    for pattern in (_VALUE_ERROR, _ARGPARSE):
        for line in reversed(lines):
            m = pattern.search(line)
            if m:
                return _short(m.group(1), limit)
    for line in reversed(lines):
        m = _EXC.match(line)
        if m and not m.group(2).startswith("1 validation error"):
            return _short(f"{m.group(1)}: {m.group(2)}", limit)
    tail = lines[-1] if lines else "no log output"
    return f"vLLM exited before it was ready (last log line: {tail[:200]})"
