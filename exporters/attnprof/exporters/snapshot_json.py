"""The snapshot document's JSON body (``GET /attnprof/snapshot``), bounded in size.

NaN-safe, and encoded in pieces so an event loop waiting on the rendering thread keeps the
GIL (megabytes of head statistics). Past ``max_bytes`` the head statistics are left out
first, then the per-layer data, and ``truncated`` says which and why.
"""

from __future__ import annotations

import dataclasses

from attnprof.contracts.jsonsafe import dumps, dumps_yielding
from attnprof.contracts.snapshot import Snapshot

__all__ = ["snapshot_body"]


def snapshot_body(snap: Snapshot, max_bytes: int) -> bytes:
    """``snap`` as UTF-8 JSON of at most about ``max_bytes`` (``snap`` is trimmed in place
    to fit; its worker snapshots are replaced by copies, never changed)."""
    body = dumps_yielding(snap.to_json()).encode()
    if len(body) > max_bytes and snap.head_stats is not None:
        snap.head_stats = None
        snap.truncated = (f"head_stats left out: the body would be {len(body)} bytes, "
                          f"over ATTNPROF_SNAPSHOT_MAX_BYTES={max_bytes}")
        body = dumps(snap.to_json()).encode()
    if len(body) > max_bytes:
        # Copies: the cached worker snapshots serve later (smaller) answers too.
        snap.workers = [dataclasses.replace(w, layers=[], kernel_map=[])
                        for w in snap.workers]
        snap.truncated = (f"per-layer data left out: the body would be over "
                          f"ATTNPROF_SNAPSHOT_MAX_BYTES={max_bytes}")
        body = dumps(snap.to_json()).encode()
    return body
