"""vLLM's CUDA backend verdicts, as derived from vLLM's own code (``data/vllm_matrix.json``).

The data is written by ``attnprof compat --regenerate`` (:mod:`attnprof.tools.vllm_matrix`),
which runs vLLM's ``CudaPlatform.get_valid_backends`` and ``get_flash_attn_version`` under a
pinned device capability. This module only reads it: pure Python, no vLLM import.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

__all__ = ["FEATURES", "VllmCase", "cases", "feature_key", "from_derived", "load", "lookup",
           "source_line"]

# The derived grid's feature axes, in the order of their "+"-joined key.
FEATURES = ("sliding_window", "sinks", "fp8_kv")


@functools.cache
def load() -> dict[str, Any]:
    text = resources.files("attnprof.analyze").joinpath("data/vllm_matrix.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def feature_key(features: dict[str, bool] | None) -> str:
    """The data's feature column: the set features in canonical order, ``+``-joined."""
    f = features or {}
    return "+".join(k for k in FEATURES if f.get(k))


@dataclass
class VllmCase:
    """One layer shape on one capability, in vLLM's words."""

    hardware: str
    capability: tuple[int, int]
    head_size: int
    dtype: str
    features: str
    priority: list[str]
    selected: str | None
    invalid: dict[str, list[str]]
    flash_attn_version: int | None
    flash_attn_note: str | None
    source: str
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def valid(self) -> list[str]:
        return [b for b in self.priority if b not in self.invalid]

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "hardware": self.hardware,
            "capability": list(self.capability), "selected": self.selected,
            "flash_attn_version": self.flash_attn_version,
            "flash_attn_note": self.flash_attn_note, "valid": self.valid,
            "backends": [{"backend": b, "priority": i, "valid": b not in self.invalid,
                          "reasons": self.invalid.get(b, [])}
                         for i, b in enumerate(self.priority)],
            "facts": self.facts,
        }


def source_line(data: dict[str, Any] | None = None) -> str:
    d = data or load()
    return (f"derived from {d['vllm_distribution']} {d['vllm_version']}'s own selection code "
            f"(CudaPlatform.get_valid_backends, get_flash_attn_version; source digest "
            f"sha256:{d['source_digest']['combined'][:12]})")


def cases(data: dict[str, Any] | None = None) -> Iterator[VllmCase]:
    """Every case of a derived matrix (default: the shipped one), decoded: the one reader
    of its compact rows (``columns``, interned ``reasons`` and ``notes``)."""
    d = data or load()
    src = source_line(d)
    for hw, cap in d["capabilities"].items():
        for row in cap["cases"]:
            r = dict(zip(d["columns"], row, strict=True))
            yield VllmCase(
                hardware=hw, capability=(cap["capability"][0], cap["capability"][1]),
                head_size=r["head_size"], dtype=r["dtype"], features=r["features"],
                priority=list(cap["priority"]), selected=r["selected"],
                invalid={b: [d["reasons"][i] for i in ids] for b, ids in r["invalid"].items()},
                flash_attn_version=r["flash_attn_version"],
                flash_attn_note=(None if r["flash_attn_note"] is None
                                 else d["notes"][r["flash_attn_note"]]),
                source=src, facts=dict(cap["facts"]))


@functools.cache
def _index() -> dict[tuple[str, int, str, str], VllmCase]:
    return {(c.hardware, c.head_size, c.dtype, c.features): c for c in cases()}


def lookup(hardware: str, head_size: int, dtype: str,
           features: dict[str, bool] | None = None) -> VllmCase | None:
    """The derived verdicts for a case, or None when the case is outside the shipped grid
    (another head size, an fp8 compute dtype, a capability vLLM's CUDA platform was not
    derived for)."""
    return _index().get((hardware, head_size, dtype, feature_key(features)))


def from_derived(hardware: str, capability: tuple[int, int], got: dict[str, Any],
                 case: dict[str, Any]) -> VllmCase:
    """A :class:`VllmCase` from a live derivation's answer (a case outside the grid)."""
    return VllmCase(
        hardware=hardware, capability=capability, head_size=int(case["head_size"]),
        dtype=str(case["dtype"]), features="+".join(case["features"]),
        priority=list(got["priority"]), selected=case["selected"],
        invalid={b: list(r) for b, r in case["invalid"].items()},
        flash_attn_version=case["flash_attn_version"], flash_attn_note=case["flash_attn_note"],
        source=(f"derived now from the installed {got['vllm_distribution']} "
                f"{got['vllm_version']}'s own selection code "
                f"(the case is outside the shipped grid)"),
        facts=dict(got["facts"]))
