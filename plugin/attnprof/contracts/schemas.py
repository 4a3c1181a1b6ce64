"""The published JSON Schemas (docs/schema/*.schema.json), generated from the contract types.

``python -m attnprof.contracts`` rewrites them; ``--check`` only says whether they are
current (a test does the same in memory).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attnprof.contracts.advice import WindowAdvice
from attnprof.contracts.base import Document, Record, json_schema
from attnprof.contracts.diff import DiffReport
from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.report import Report
from attnprof.contracts.snapshot import LayerProfile, RequestStats, Snapshot
from attnprof.contracts.whatif import WhatifRun

__all__ = ["DOCUMENTS", "SCHEMA_DIR", "render", "schemas", "stale", "write"]

DOCUMENTS: dict[str, tuple[type[Record], type[Document] | None]] = {
    "snapshot.schema.json": (Snapshot, None),
    "layer_profile.schema.json": (LayerProfile, Snapshot),
    "request_stats.schema.json": (RequestStats, Snapshot),
    "window_advice.schema.json": (WindowAdvice, None),
    "profile.schema.json": (ProfileReport, None),
    "diff.schema.json": (DiffReport, None),
    "report.schema.json": (Report, None),
    "whatif.schema.json": (WhatifRun, None),
}
"""File name -> (type, the document it is part of when it has no version of its own)."""

SCHEMA_DIR = Path(__file__).resolve().parents[3] / "docs" / "schema"
"""docs/schema in a source checkout (pass another directory when installed)."""


def schemas() -> dict[str, dict[str, Any]]:
    """Every published schema, by file name."""
    return {name: json_schema(cls, part_of=part_of)
            for name, (cls, part_of) in DOCUMENTS.items()}


def render(schema: dict[str, Any]) -> str:
    """The file text of a schema (stable: indent 2, trailing newline)."""
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def stale(directory: Path = SCHEMA_DIR) -> list[str]:
    """File names in ``directory`` that are missing or differ from the generated schema."""
    out = []
    for name, schema in schemas().items():
        path = directory / name
        if not path.is_file() or path.read_text() != render(schema):
            out.append(name)
    return out


def write(directory: Path = SCHEMA_DIR) -> list[Path]:
    """Write every schema into ``directory``; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, schema in schemas().items():
        path = directory / name
        path.write_text(render(schema))
        paths.append(path)
    return paths
