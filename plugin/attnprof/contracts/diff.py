"""``attnprof diff BASE NEW --json``: what changed between two profiles or two snapshots,
which changes are regressions under the thresholds given, and why.

Exit codes of the command follow ``regression``: 0 none, 1 at least one (2: the inputs
could not be compared; no document is written then).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from attnprof.contracts.base import Document, Record

__all__ = ["Change", "DiffReport", "DiffSide", "Finding", "Severity"]

Severity = Literal["regression", "improvement", "info"]


@dataclass
class DiffSide(Record):
    """One input file, as the report names it."""

    file: str
    kind: str
    """attnprof.profile or attnprof.snapshot (a record is a snapshot with a window)."""
    schema_version: str
    model: str
    time_iso: str | None = None
    git_revision: str | None = None
    git_dirty: bool | None = None
    window_s: float | None = None
    """The window a record covers (null: cumulative since the server started)."""


@dataclass
class Finding(Record):
    """One comparison: what it measured on each side and whether it is a regression."""

    kind: str
    """kernel, fused_fraction_calls, fused_fraction_time, attention_share, layer_time,
    attention_time, memory, oom, kv_cache, window_advice, context_shift."""
    severity: Severity
    title: str
    """One line, e.g. "layers 12-16: flash_cpu -> math: dropout_p 0.0 -> 0.1"."""
    layers: list[int] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)
    """The attention sites' labels (``L3``, ``encoder.L3``, ``decoder.L3.cross``): ``layers``
    alone merges an encoder-decoder's encoder, decoder and cross layers of one index."""
    base: Any = None
    new: Any = None
    change: float | None = None
    """new/base - 1 for times and sizes; new - base for fractions."""
    threshold: str | None = None
    """The --fail-on key that judged it (null: never fails on its own)."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """Test statistics: p-value, confidence interval, sample sizes, distances."""


@dataclass
class Change(Record):
    """A provenance field that differs between the two inputs."""

    field: str
    base: Any
    new: Any


@dataclass
class DiffReport(Document):
    KIND = "attnprof.diff"
    VERSION = (1, 0)

    base: DiffSide
    new: DiffSide
    regression: bool
    thresholds: dict[str, float | None]
    """The --fail-on values used (null: that check never fails)."""
    findings: list[Finding] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    git_log: list[str] | None = None
    """Always null since issue 30: diff runs no git (a repository named in an input file could
    run code); kept so the 1.0 schema stays valid. The notes name the two revisions."""
    notes: list[str] = field(default_factory=list)
    """What could not be compared and why (a field one side lacks)."""
