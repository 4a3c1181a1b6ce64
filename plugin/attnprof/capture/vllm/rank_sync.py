"""The tensor-parallel ranks' agreement on the sampler's scale: a node-local announcement.

Every rank of a tensor-parallel group must sample the same steps (a rank sampling alone is
slower and makes the others wait at the next collective; per-head statistics of a prompt
need every rank's heads). The sampler's decisions are a pure function of (seed, step index,
rate in force) (:mod:`attnprof.aggregate.sampler`), so the ranks agree as long as the scale
the overhead budget applies changes at the same step on every rank. The first rank decides:
at each epoch boundary it writes its wanted scale for a step two epochs ahead into a small
shared file; the other ranks read it at their next boundary (they run in lockstep, a step or
so apart) and apply it at that same step.

The file holds the last ``SLOTS`` announcements, not only the latest: a follower that reaches a
boundary a moment before the leader reads nothing new there, and by its next boundary the
leader may have announced twice (a single slot lost the first of the two, and the ranks then
sampled different steps between the two changes: seen in CI as a follower missing the change
at step 192). A follower takes every announcement newer than the last it took, in order.

The file (``SLOTS`` x 32 bytes, mmap'd) lives in ``ATTNPROF_RUN_DIR`` or the temporary
directory, named from the server's instance id and the group's data- and pipeline-parallel
ranks; the first rank removes it at exit. Ranks on other nodes (multi-node tensor
parallelism) cannot see it: they keep the scale they start with and count the boundaries they
could not read (``SamplerStats.sync``), so a divergence is visible rather than silent.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import mmap
import os
import struct
import tempfile
from pathlib import Path

__all__ = ["LEAD_EPOCHS", "SLOTS", "RateChannel", "channel_path"]

_FMT = struct.Struct("<QqdQ")  # sequence, at step, scale, sequence again (torn-read check)
SLOTS = 8
"""Announcements kept (announcement ``n`` lives in slot ``n % SLOTS``): a follower misses one
only when it falls this many boundaries behind the leader."""
_SIZE = _FMT.size * SLOTS
LEAD_EPOCHS = 2
"""How many epochs ahead the first rank announces a change (followers read one epoch later)."""


def channel_path(instance: str, dp_rank: int, pp_rank: int, where: Path | None = None) -> Path:
    """The group's channel file: one per (server instance, data-parallel rank, pipeline
    stage), so groups and concurrent servers never share one."""
    key = hashlib.blake2b(f"{instance}:{dp_rank}:{pp_rank}".encode(), digest_size=8).hexdigest()
    return Path(where or tempfile.gettempdir()) / f"attnprof-rate-{key}.bin"


class RateChannel:
    """``sync`` for :class:`~attnprof.aggregate.sampler.StepSampler`: the leader publishes,
    followers read. Never raises (an I/O error reads as "nothing announced")."""

    def __init__(self, path: Path, leader: bool, epoch: int) -> None:
        self.path = path
        self.leader = leader
        self.lead = LEAD_EPOCHS * epoch
        self.seq = 0
        self.published: float | None = None
        self.unread = 0
        """Boundaries at which a follower found no readable announcement file."""
        self._mm: mmap.mmap | None = None
        if leader:
            self._open(create=True)
            atexit.register(self.close)

    def _open(self, create: bool) -> None:
        """The leader makes a fresh file (a stale one, from a server killed before it could
        remove it, is replaced); a follower opens it read-only, and only if it is this user's
        and nobody else may write it (a file planted in a shared /tmp is not obeyed)."""
        try:
            if create:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             0o600)
            else:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            if create:
                os.ftruncate(fd, _SIZE)
                self._mm = mmap.mmap(fd, _SIZE)
            else:
                st = os.fstat(fd)
                if (st.st_uid != os.getuid() or st.st_mode & 0o022
                        or st.st_size < _SIZE):
                    return
                self._mm = mmap.mmap(fd, _SIZE, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            self._mm = None
        finally:
            os.close(fd)

    def __call__(self, step: int, wanted: float) -> list[tuple[int, int, float]]:
        """The announcements in the file, oldest first (the leader: the one it just made)."""
        try:
            if self.leader:
                return self._publish(step, wanted)
            return self._read()
        except (OSError, ValueError, struct.error):
            return []

    def _publish(self, step: int, wanted: float) -> list[tuple[int, int, float]]:
        if wanted == self.published or self._mm is None:
            return []
        self.seq += 1
        self.published = wanted
        at = step + self.lead
        off = (self.seq % SLOTS) * _FMT.size
        self._mm[off:off + _FMT.size] = _FMT.pack(self.seq, at, wanted, self.seq)
        return [(self.seq, at, wanted)]

    def _read(self) -> list[tuple[int, int, float]]:
        if self._mm is None:
            self._open(create=False)
            if self._mm is None:
                self.unread += 1
                return []
        got = []
        for slot in range(SLOTS):
            seq, at, scale, check = _FMT.unpack_from(self._mm, slot * _FMT.size)
            # Empty, or being written (the sequence's two copies differ): the slot is read
            # again at the next boundary.
            if seq != 0 and seq == check:
                got.append((seq, at, scale))
        return sorted(got)

    def close(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(Exception):
                mm.close()
        if self.leader:
            with contextlib.suppress(OSError):
                self.path.unlink()
