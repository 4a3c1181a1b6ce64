"""Chrome/Perfetto JSON traces of sampled steps: the one writer of ``trace.json``.

Used by the live trace (``GET /attnprof/trace``, ``attnprof trace``) and by the offline
``attnprof profile``. The format's rules this writer keeps (and ``check_trace`` verifies):

* one process track per process: a ``"M"`` ``process_name`` event (and ``thread_name`` for
  each thread that has ranges), ``pid`` the real process id;
* ``"X"`` complete events properly nested per (pid, tid): a layer's attention range lies
  inside its step's range (clamped in integer nanoseconds before conversion, so rounding can
  never make a child poke out), and step ranges of one track never overlap;
* ``"C"`` counter events carry only numeric ``args`` (one series per key);
* timestamps are microseconds from the trace's earliest event (``otherData.origin_unix_ns``
  says when that was): small numbers keep nanosecond precision in a JSON double.

Args hold shapes and timings only (backend, kernel, phase, tokens, sequence lengths, request
count): a step record has no prompt text, token ids or request ids to leak.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from attnprof.aggregate.trace import StepTrace
from attnprof.contracts.jsonsafe import CHUNK_BYTES, dumps

__all__ = ["ChromeTrace", "TraceProcess", "add_counters", "add_steps", "build_trace",
           "check_trace", "render_live_trace", "render_steps"]

STEP_TID = 1
"""The thread track of a process's model steps."""


@dataclass
class TraceProcess:
    """One process's steps (a vLLM worker, or the offline profile's own process)."""

    pid: int
    name: str
    steps: list[StepTrace] = field(default_factory=list)
    thread_name: str = "model steps"
    sort_index: int = 0


class ChromeTrace:
    """Collects events with nanosecond times; :meth:`to_json` returns the trace document and
    :meth:`chunks` writes it as text pieces.

    Each timed event is held as one tuple of atoms, its ``args`` already JSON text: a live
    trace has 150,000 of them, and as dicts (two per event) they would be millions of objects
    for the garbage collector to walk, pausing the API server's event loop for ~100 ms at a
    time; tuples of atoms and strings it does not track."""

    def __init__(self) -> None:
        self._meta: list[dict[str, Any]] = []
        # (start ns, -dur ns (-1: a counter), pid, tid, ph, name, cat, args JSON)
        self._timed: list[tuple[int, int, int, int, str, str, str, str]] = []
        self._names: set[tuple[int, int | None]] = set()

    def process(self, pid: int, name: str, sort_index: int = 0) -> None:
        """Name a process track (once per pid)."""
        if (pid, None) in self._names:
            return
        self._names.add((pid, None))
        self._meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": name}})
        self._meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                           "args": {"sort_index": sort_index}})

    def thread(self, pid: int, tid: int, name: str) -> None:
        """Name a thread track (once per pid/tid)."""
        if (pid, tid) in self._names:
            return
        self._names.add((pid, tid))
        self._meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": name}})

    def complete(self, pid: int, tid: int, name: str, start_ns: int, dur_ns: int,
                 cat: str, args: dict[str, Any]) -> None:
        """A range ("X" event); nesting is the caller's (see :func:`render_steps`)."""
        self._timed.append((int(start_ns), -max(0, int(dur_ns)), pid, tid, "X", name, cat,
                            dumps(args)))

    def counter(self, pid: int, name: str, t_ns: int, values: dict[str, float]) -> None:
        """A counter sample ("C" event): one series per key, numeric values only."""
        self._timed.append((int(t_ns), 1, pid, 0, "C", name, "",
                            dumps({k: float(v) for k, v in values.items()})))

    def _ordered(self) -> tuple[int, list[list[tuple[int, int, int, int, str, str, str, str]]]]:
        """The origin (earliest time) and each process's events by time, parents (longer)
        before the children that start with them. Sorted per process, not globally: the
        format asks for no order across tracks, and one sort of 150k events holds the GIL
        for ~100 ms (tuples compare in C)."""
        origin = min((t[0] for t in self._timed), default=0)
        by_pid: dict[int, list[tuple[int, int, int, int, str, str, str, str]]] = {}
        for item in self._timed:
            by_pid.setdefault(item[2], []).append(item)
        groups = list(by_pid.values())
        for g in groups:
            g.sort()  # (start, -dur): mostly in order already, as steps and layers ran
        return origin, groups

    @staticmethod
    def _event(ev: tuple[int, int, int, int, str, str, str, str], origin: int) -> str:
        t, negdur, pid, tid, ph, name, cat, args = ev
        head = f'{{"ph": "{ph}", "name": {json.dumps(name)}, '
        if ph == "X":
            return (f'{head}"cat": {json.dumps(cat)}, "pid": {pid}, "tid": {tid}, "args": '
                    f'{args}, "ts": {(t - origin) / 1000!r}, "dur": {-negdur / 1000!r}}}')
        return (f'{head}"pid": {pid}, "tid": {tid}, "args": {args}, '
                f'"ts": {(t - origin) / 1000!r}}}')

    def to_json(self, other: dict[str, Any] | None = None) -> dict[str, Any]:
        """The trace document (``traceEvents``, ``displayTimeUnit``, ``otherData``)."""
        doc: dict[str, Any] = json.loads("".join(self.chunks(other)))
        return doc

    def chunks(self, other: dict[str, Any] | None = None,
               target: int = CHUNK_BYTES) -> Iterator[str]:
        """The trace document as JSON text in pieces of about ``target`` characters, written
        event by event (no dict per event, no ``json.dumps`` of the whole)."""
        origin, groups = self._ordered()
        meta = dumps(self._meta)
        buf = ['{"traceEvents": [', meta[1:-1]]
        size, first = len(meta), len(self._meta) == 0
        for g in groups:
            for ev in g:
                buf.append(("" if first else ", ") + self._event(ev, origin))
                first = False
                size += len(buf[-1])
                if size >= target:
                    yield "".join(buf)
                    buf, size = [], 0
        buf.append('], "displayTimeUnit": "ms", "otherData": ')
        buf.append(dumps({"origin_unix_ns": origin, **(other or {})}))
        buf.append("}")
        yield "".join(buf)


def _step_args(s: StepTrace) -> dict[str, Any]:
    return {"phase": s.phase, "outcome": s.outcome, "tokens": s.tokens,
            "num_requests": s.num_reqs, "max_seq_len": s.max_seq_len,
            "mean_seq_len": round(s.mean_seq_len, 2), "effective_sample_rate": s.effective_rate,
            "layers": len(s.layers)}


def render_steps(processes: Iterable[TraceProcess],
                 counters: Iterable[tuple[int, str, int, dict[str, float]]] = (),
                 other: dict[str, Any] | None = None, sample_rate_counter: bool = True
                 ) -> dict[str, Any]:
    """A trace document of step records (see :func:`build_trace`)."""
    return build_trace(processes, counters, sample_rate_counter).to_json(other)


def build_trace(processes: Iterable[TraceProcess],
                counters: Iterable[tuple[int, str, int, dict[str, float]]] = (),
                sample_rate_counter: bool = True) -> ChromeTrace:
    """The trace of step records: per process a track with each step's range and its
    layers' attention ranges nested inside, an ``effective sample rate`` counter per step
    (``sample_rate_counter``), and the given extra ``counters`` (pid, name, Unix ns, values;
    e.g. KV-cache usage). Never raises for well-typed records; never reads anything else."""
    tr = ChromeTrace()
    for proc in processes:
        add_steps(tr, proc, sorted(proc.steps, key=lambda x: x.start_ns), sample_rate_counter)
    add_counters(tr, counters)
    return tr


def add_counters(tr: ChromeTrace,
                 counters: Iterable[tuple[int, str, int, dict[str, float]]]) -> None:
    for pid, name, t_ns, values in counters:
        tr.process(pid, f"process {pid}")  # a counter's track needs a name too (no-op if named)
        tr.counter(pid, name, t_ns, values)


def add_steps(tr: ChromeTrace, proc: TraceProcess, steps: Iterable[StepTrace],
              sample_rate_counter: bool = True) -> int:
    """Add ``proc``'s track and ``steps`` (in time order; ``proc.steps`` is not read), each
    step's layers nested inside it; returns how many steps were added. ``steps`` may be a
    generator: nothing of a step is kept but its events."""
    tr.process(proc.pid, proc.name, proc.sort_index)
    tr.thread(proc.pid, STEP_TID, proc.thread_name)
    last_end = None
    n = 0
    for s in steps:
        n += 1
        start = s.start_ns if last_end is None else max(s.start_ns, last_end)
        end = max(start, s.start_ns + s.dur_ns)
        last_end = end
        tr.complete(proc.pid, STEP_TID, s.label or f"step ({s.phase})", start, end - start,
                    "step", _step_args(s))
        if sample_rate_counter:
            tr.counter(proc.pid, "effective sample rate", start, {"rate": s.effective_rate})
        child_end = start
        for r in sorted(s.layers, key=lambda x: x.offset_ns):
            # Clamp into the step and after the previous layer (same track, no overlap).
            c0 = min(max(s.start_ns + r.offset_ns, child_end), end)
            c1 = min(max(c0, s.start_ns + r.offset_ns + r.dur_ns), end)
            child_end = c1
            tr.complete(proc.pid, STEP_TID, f"attn::L{r.layer}::{r.backend}", c0, c1 - c0,
                        "attention",
                        {"layer": r.layer, "backend": r.backend, "kernel": r.kernel,
                         "phase": r.phase, "tokens": r.tokens, "num_requests": r.num_reqs,
                         "max_seq_len": r.max_seq_len,
                         "mean_seq_len": round(r.mean_seq_len, 2)})
    return n


def check_trace(doc: Any) -> list[str]:
    """Every way ``doc`` breaks the format's rules as this writer promises them (empty: none):
    the document shape, metadata names for every pid (and tid with ranges), numeric counter
    args, non-negative durations, and proper nesting of "X" events per (pid, tid)."""
    problems: list[str] = []
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    named_p: set[Any] = set()
    named_t: set[tuple[Any, Any]] = set()
    tracks: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    pids: set[Any] = set()
    eps = 1e-6  # microseconds: JSON doubles of ns/1000
    for i, ev in enumerate(doc["traceEvents"]):
        ph = ev.get("ph") if isinstance(ev, dict) else None
        if ph == "M":
            if ev.get("name") == "process_name" and isinstance(ev.get("args", {}).get("name"),
                                                               str):
                named_p.add(ev.get("pid"))
            elif ev.get("name") == "thread_name":
                named_t.add((ev.get("pid"), ev.get("tid")))
            continue
        if ph not in ("X", "C"):
            problems.append(f"event {i}: phase {ph!r} (this writer emits M, X and C)")
            continue
        if not isinstance(ev.get("ts"), (int, float)) or not isinstance(ev.get("name"), str):
            problems.append(f"event {i}: missing ts or name")
            continue
        pids.add(ev.get("pid"))
        if ph == "C":
            args = ev.get("args")
            if not isinstance(args, dict) or not args or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool)
                    for v in args.values()):
                problems.append(f"event {i}: counter {ev['name']!r} args are not all numbers")
            continue
        dur = ev.get("dur")
        if not isinstance(dur, (int, float)) or dur < 0:
            problems.append(f"event {i}: X event without a non-negative dur")
            continue
        tracks.setdefault((ev.get("pid"), ev.get("tid")), []).append(
            (float(ev["ts"]), float(ev["ts"]) + float(dur), ev["name"]))
    for pid in pids - named_p:
        problems.append(f"pid {pid}: no process_name metadata event")
    for (pid, tid), spans in tracks.items():
        if (pid, tid) not in named_t:
            problems.append(f"pid {pid} tid {tid}: no thread_name metadata event")
        stack: list[tuple[float, float, str]] = []
        for s0, s1, name in sorted(spans, key=lambda x: (x[0], -(x[1] - x[0]))):
            while stack and s0 >= stack[-1][1] - eps:
                stack.pop()
            if stack and s1 > stack[-1][1] + eps:
                problems.append(f"pid {pid} tid {tid}: {name!r} [{s0}, {s1}] overlaps "
                                f"{stack[-1][2]!r} [{stack[-1][0]}, {stack[-1][1]}] without "
                                "nesting inside it")
            stack.append((s0, s1, name))
    return problems


def render_live_trace(taken: list[dict[str, Any]], kv: list[tuple[int, float]],
                      meta: dict[str, Any], max_bytes: int,
                      on_error: Callable[[Exception], None] | None = None) -> list[bytes]:
    """The live trace's body from the workers' records (``GET /attnprof/trace``), as byte
    chunks of about :data:`~attnprof.contracts.jsonsafe.CHUNK_BYTES` each, to be streamed
    as they are: no step of the encoding holds the GIL for long, the body is never one
    contiguous copy, and each record is parsed only as its events are written (150,000
    parsed layer ranges kept at once would be seconds of garbage collection). ``taken``: one
    dict per worker (``pid``, ``process``, ``rank``, ``steps`` as :meth:`StepTrace.to_json`,
    ``truncated``: why that worker's records stop early, if they do); ``kv``: (Unix ns,
    usage) samples of the API server. Over ``max_bytes`` the later steps of each worker are
    left out and ``otherData.attnprof.truncated`` says so. A malformed step record is
    skipped and handed to ``on_error``."""
    truncated = meta.get("truncated")
    answers = sorted((a for a in taken if "error" not in a),  # errors are listed in meta
                     key=lambda a: ((a.get("rank") or {}).get("tp_rank", 0),
                                    int(a.get("pid") or 0)))
    for a in answers:
        if a.get("truncated") and not truncated:
            truncated = str(a["truncated"]) if isinstance(a["truncated"], str) else (
                "a worker reached its bound on layer ranges "
                "(ATTNPROF_TRACE_MAX_RANGES_PER_WORKER)")

    def parsed(raws: list[Any]) -> Iterator[StepTrace]:
        for raw in raws:
            try:
                yield StepTrace.from_json(raw)
            except (KeyError, TypeError, ValueError) as exc:
                if on_error is not None:
                    on_error(exc)

    def by_start(a: dict[str, Any]) -> list[Any]:
        raws = [r for r in a.get("steps") or () if isinstance(r, dict)]
        try:
            raws.sort(key=lambda r: int(r["start_ns"]))
        except (KeyError, TypeError, ValueError):
            pass  # a malformed one is reported when parsed; order as sent
        return raws

    api = int(meta.get("api_pid") or 0)
    info = {k: v for k, v in meta.items() if k not in ("api_pid", "truncated")}
    keep: int | None = None
    while True:
        tr = ChromeTrace()
        tr.process(api, "vLLM API server", 0)
        tr.thread(api, STEP_TID, "scheduler")
        per_worker: dict[str, int] = {}
        for i, a in enumerate(answers):
            r = a.get("rank") or {}
            pid = int(a.get("pid") or 0)
            name = (f"{a.get('process') or 'vLLM worker'} (tp {r.get('tp_rank', 0)}/"
                    f"{r.get('tp_size', 1)}, pp {r.get('pp_rank', 0)}, "
                    f"dp {r.get('dp_rank', 0)})")
            steps = parsed(by_start(a))
            per_worker[str(pid)] = add_steps(
                tr, TraceProcess(pid, name, sort_index=i + 1),
                steps if keep is None else itertools.islice(steps, keep))
        add_counters(tr, [(api, "KV cache usage", t, {"usage": u}) for t, u in kv])
        chunks = [c.encode() for c in tr.chunks({"attnprof": {
            **info, "kind": "attnprof.trace", "steps_per_worker": per_worker,
            "complete": bool(per_worker) and all(n >= info["requested_steps"]
                                                 for n in per_worker.values()),
            "truncated": truncated}})]
        size = sum(len(c) for c in chunks)
        most = max(per_worker.values(), default=0)
        if size <= max_bytes or most <= 1:
            return chunks
        keep = max(1, int(most * max_bytes / size * 0.9))
        truncated = (f"steps after the first {keep} per worker left out: the body would be "
                     f"over ATTNPROF_SNAPSHOT_MAX_BYTES={max_bytes}")
