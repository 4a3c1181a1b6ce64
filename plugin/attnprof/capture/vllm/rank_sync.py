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
ranks; the first rank removes it at exit. A follower that cannot read it counts the
boundaries it could not read (``SamplerStats.unsynced``), so a divergence is visible.

**Ranks on other nodes** cannot see the file. There the RPC channel (:class:`RpcRate`,
``ATTNPROF_RANK_SYNC=rpc``, chosen by ``auto`` when vLLM's parallel config spans nodes) takes
its place: a collective RPC runs between the same two model steps on every rank of an engine
(the executor broadcasts it into the queue every worker reads in order), so it is a sync point
of its own. The leader's wanted scale leaves in its answer to the API server's poll
(:func:`leader_answer`); the API server's next poll carries it back to every rank
(:func:`take_carried`), and every rank, the leader included, applies it at that RPC. Ranks
then change the scale at the same step whatever their nodes; the cost is latency (a change
waits for the next poll: the API server polls again within a second while a change is
pending, see :class:`~attnprof.host.vllm.live_view.LiveView`).
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
from typing import Any

__all__ = ["LEAD_EPOCHS", "SLOTS", "RateChannel", "RpcRate", "carried_rates", "channel_path",
           "group_key", "leader_answer", "multi_node", "take_carried"]

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


def group_key(dp_rank: int, pp_rank: int) -> str:
    """The tensor-parallel group a rate belongs to (one leader per data-parallel rank and
    pipeline stage, as for the file channel)."""
    return f"{int(dp_rank)}:{int(pp_rank)}"


def multi_node(parallel_config: Any) -> bool:
    """Whether vLLM's parallel config places this engine's ranks on several nodes: more than
    one node per data-parallel group (``--nnodes``). False when it cannot tell, and for Ray,
    whose placement it cannot see: on the RPC channel no rank throttles until a poll carries
    a scale, so it is chosen only where the file cannot work (set it by hand for Ray across
    nodes)."""
    try:
        nodes = int(getattr(parallel_config, "nnodes_within_dp", 1) or 1)
    except Exception:
        nodes = 1
    return nodes > 1


def sync_mode(setting: str, parallel_config: Any) -> str:
    """The channel tensor-parallel ranks share the budget's scale on: ``ATTNPROF_RANK_SYNC``
    as set, ``auto`` decided by :func:`multi_node` (``rpc`` across nodes, else ``file``).
    The one decision the workers (which channel) and the API server (whether to poll for
    the RPC channel) both read, from the same parallel config."""
    if setting == "auto":
        return "rpc" if multi_node(parallel_config) else "file"
    return setting


class RpcRate:
    """``sync`` for :class:`~attnprof.aggregate.sampler.StepSampler` without the file: epoch
    boundaries announce nothing (so no rank changes its scale by itself); the leader's wanted
    scale is reported in its poll answer and every rank applies what the next poll carries.
    Never raises."""

    def __init__(self, group: str, leader: bool) -> None:
        self.group = group
        self.leader = leader
        self.seq = 0
        """The leader's last reported announcement (a new one each time its wish changes)."""
        self.reported: float | None = None
        self.taken = 0
        """The last announcement this rank applied."""
        self.unread = 0
        """Carried announcements this rank could not read (malformed): a visible divergence."""

    def __call__(self, step: int, wanted: float) -> list[tuple[int, int, float]]:
        return []

    def answer(self, wanted: float, in_force: float) -> dict[str, Any] | None:
        """The leader's report for its poll answer (None on a follower)."""
        if not self.leader:
            return None
        if wanted != self.reported:
            self.seq += 1
            self.reported = wanted
        return {"group": self.group, "seq": self.seq, "scale": wanted, "in_force": in_force}

    def take(self, sampler: Any, carried: Any) -> bool:
        """Apply this group's entry of the poll's ``carried`` mapping (``{group: [seq,
        scale]}``) from the next step, if it is newer than the last taken; True if it was.
        Every rank gets the same mapping at the same RPC, so every rank decides alike."""
        if not isinstance(carried, dict) or self.group not in carried:
            return False
        entry = carried[self.group]
        try:
            seq, scale = int(entry[0]), float(entry[1])
            if not 0.0 < scale <= 1.0:
                raise ValueError(scale)
        except (TypeError, ValueError, IndexError, KeyError):
            self.unread += 1
            return False
        if seq <= self.taken:
            return False
        self.taken = seq
        sampler.apply_now(scale)
        return True


def leader_answer(sampler: Any) -> dict[str, Any] | None:
    """What a poll answer carries for the rate (``None`` unless this rank leads an RPC
    channel)."""
    sync = getattr(sampler, "sync", None)
    if not isinstance(sync, RpcRate):
        return None
    return sync.answer(sampler.wanted, sampler.scale)


def take_carried(sampler: Any, carried: Any) -> None:
    """At a poll, before anything else: apply the rate the API server carried (a no-op
    unless this rank is on an RPC channel)."""
    sync = getattr(sampler, "sync", None)
    if isinstance(sync, RpcRate) and carried:
        sync.take(sampler, carried)


def carried_rates(answers: list[Any], known: dict[str, list[Any]]) -> bool:
    """API server side: fold the leaders' reports of one poll into ``known`` (``{group:
    [seq, scale]}``, what the next poll carries; a report older than the one known is kept
    out). True when some leader wants a scale not yet in force (the API server then polls
    again soon)."""
    pending = False
    for a in answers:
        rep = a.get("rate_sync") if isinstance(a, dict) else None
        if not isinstance(rep, dict):
            continue
        try:
            group, seq, scale = str(rep["group"]), int(rep["seq"]), float(rep["scale"])
            in_force = float(rep["in_force"])
        except (KeyError, TypeError, ValueError):
            continue
        old = known.get(group)
        if old is None or seq >= int(old[0]):
            known[group] = [seq, scale]
        pending = pending or scale != in_force
    return pending
