"""Strings from outside (input files, servers' answers, error messages) made safe to print.

One definition for the CLI's one-line errors, the diff's renderers and the notes a server
sends: a control character from a file or a server must not drive the terminal (ANSI
escapes, ``\\r``), forge lines, or reorder what a reader sees (bidi overrides).
"""

from __future__ import annotations

import re

__all__ = ["inert"]

# C0/C1 controls (ESC, CR, LF, BEL, ...), DEL, and the Unicode line separators and bidi
# overrides that reorder what a reader sees.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029"
                      "\u202a-\u202e\u2066-\u2069]")


def inert(text: object) -> str:
    """``text`` with every control character written as its escape (``\\x1b``, ``\\r``,
    ``\\n``, ``\\u202e``): safe to print on a terminal or in a comment; never raises."""
    return _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"),
                        str(text))
