"""``attnprof diff --fail-on``: which checks exist, their defaults, and the parser of the
option's text. What a threshold means is decided by the comparison that reads it
(:mod:`attnprof.analyze.diff`, :mod:`attnprof.analyze.diff_time`); this module only names
and parses them, so adding a check changes here and in that comparison, nowhere else."""

from __future__ import annotations

import math

__all__ = ["DEFAULT_THRESHOLDS", "parse_fail_on"]

DEFAULT_THRESHOLDS: dict[str, float | None] = {
    "kernel": 1.0,
    "fused-drop": 0.05,
    "time": 0.10,
    "share": 0.10,
    "memory": 0.10,
    "oom": 0.10,
    "context-shift": None,
    "window": None,
}
"""--fail-on keys and defaults. kernel: 1 = any fused -> fallback (or known downgrade)
fails; fused-drop: fused fraction of calls or time down by more than this (absolute);
time: per-layer or total attention time up by more than this (relative, the whole 95%
interval beyond it and p < ALPHA); share: attention share of a phase up by more than this
(absolute); memory: peak memory up (relative); oom: predicted max length down (relative);
context-shift: KS distance of the context-length distributions above this; window: window
advice's attention-FLOP saving down by more than this (absolute). None: never fails."""


def parse_fail_on(text: str | None) -> dict[str, float | None]:
    """``"fused-drop=5%,time=10%,oom=off"`` over :data:`DEFAULT_THRESHOLDS`; ``ValueError``
    (one line) for an unknown key or a value that is not a number, a percentage or off."""
    out = dict(DEFAULT_THRESHOLDS)
    if not text:
        return out
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if key not in out:
            raise ValueError(f"--fail-on: unknown check {key[:30]!r} (one of "
                             f"{', '.join(out)})")
        raw = raw.strip().lower()
        if not sep or not raw:
            raise ValueError(f"--fail-on: {key} needs a value, e.g. {key}=10% or {key}=off")
        if raw in ("off", "none", "never"):
            out[key] = None
            continue
        if key == "kernel":
            if raw in ("on", "yes", "true", "1"):
                out[key] = 1.0
                continue
            if raw in ("0", "no", "false"):
                out[key] = None
                continue
            raise ValueError(f"--fail-on: kernel={raw[:20]!r}: use kernel=on or kernel=off")
        pct = raw.endswith("%")
        try:
            value = float(raw.removesuffix("%"))
        except ValueError:
            raise ValueError(f"--fail-on: {key}={raw[:20]!r} is not a number, a percentage "
                             f"or off") from None
        if pct:
            value /= 100
        if not math.isfinite(value) or value < 0 or value > 1000:
            raise ValueError(f"--fail-on: {key}={raw[:20]!r} must be between 0 and 1000")
        if not pct and value > 1:
            # time=10 would silently mean 1000%: a missing % sign, not a threshold.
            raise ValueError(f"--fail-on: {key}={raw[:20]!r} is ambiguous: write "
                             f"{key}={value:g}% (or a fraction such as {key}=0.1)")
        out[key] = value
    return out
