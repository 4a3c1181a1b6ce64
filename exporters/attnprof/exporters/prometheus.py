"""Prometheus rendering of the export boundary's samples.

Two ways out, one per prometheus_client mode:

* Under ``PROMETHEUS_MULTIPROC_DIR`` (set by ``attnprof serve``) values must be in
  prometheus_client's per-process files, which vLLM's ``/metrics`` merges (so worker-side
  metrics appear on the API server's endpoint). Only prometheus_client's own metric classes
  write those files, and a collector in a worker is never asked: the sink keeps one
  ``Counter``/``Gauge``/``Histogram`` per catalog metric (created on its first sample) and a
  child per label set, and drives them through ``inc``/``set``. A histogram's bucket-count
  deltas have no public setter (``observe`` takes one value, and the sink only has counts and
  a sum), so a histogram child is :class:`_MultiprocessHistogram`: the per-bucket and sum
  values made as prometheus_client's ``Histogram`` makes them (``values.ValueClass``, the same
  file keys), added to through their own ``inc``; no private field is written.
* Otherwise the sink writes to a registry (default: the global one, which vLLM serves in
  single-process mode) through one :class:`RegistryCollector` per registry, whose
  ``collect()`` yields Counter/Gauge/HistogramMetricFamily from the values the sinks hold:
  no prometheus_client internals, and the same exposition text as its metric classes
  (``_created`` series included).
"""

from __future__ import annotations

import glob
import os
import re
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from attnprof._safety import pid_alive
from attnprof.aggregate.histogram import HistogramState
from attnprof.exporters.catalog import CATALOG, MetricSpec
from attnprof.exporters.samples import HistogramSample, Labels, MetricSample, Sample

__all__ = ["PrometheusSink", "RegistryCollector", "multiprocess_enabled", "sweep_dead"]

SWEEP_INTERVAL_S = 5.0
_LIVE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db$")


def multiprocess_enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def sweep_dead(path: str | None = None) -> list[int]:
    """Drop the live-gauge files of processes that are gone, and return their pids.

    vLLM's worker and engine processes end with ``os._exit``, so no ``atexit`` hook ever
    marks them dead: without this sweep, ``attnprof_plugin_processes`` would count them for
    ever and their last gauge values would keep alerts firing. Counters stay (a dead
    process's work still happened). Any process may sweep; a race only finds a file gone."""
    from prometheus_client import multiprocess

    path = path or os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return []
    pids = set()
    for f in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        m = _LIVE_FILE.search(f)
        if m:
            pids.add(int(m.group(1)))
    dead = sorted(p for p in pids if p != os.getpid() and not pid_alive(p))
    for pid in dead:
        try:
            multiprocess.mark_process_dead(pid, path)
        except OSError:
            pass  # another process swept it first
    return dead


@dataclass
class _Series:
    """One label set of one metric, as prometheus_client's metric classes keep it."""

    value: float = 0.0
    counts: list[float] = field(default_factory=list)
    """Histograms: per-bucket (not cumulative) counts, the last one +Inf."""
    created: float = field(default_factory=lambda: time.time())


@dataclass
class _Family:
    metric: MetricSpec
    bounds: tuple[float, ...] = ()
    series: dict[Labels, _Series] = field(default_factory=dict)


class RegistryCollector:
    """The values of every :class:`PrometheusSink` writing to one registry, exposed at each
    collection as metric families (a ``prometheus_client.registry.Collector``).

    Families appear in the order of their first sample and only once they have one (as
    prometheus_client's labelled metrics do once a child exists, and its label-free ones
    from creation); values accumulate exactly as its ``inc``/``set`` would."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[MetricSpec, _Family] = {}

    def describe(self) -> list[Any]:
        return []  # families come and go with samples: never checked at registration

    def ensure(self, metric: MetricSpec, bounds: tuple[float, ...] = ()) -> None:
        """A label-free metric at zero, so it shows up before its first sample."""
        with self._lock:
            fam = self._family(metric, bounds)
            if not metric.labels and () not in fam.series:
                fam.series[()] = self._new(fam)

    def add(self, metric: MetricSpec, labels: Labels, delta: float) -> None:
        with self._lock:
            self._series(metric, labels).value += float(delta)

    def set(self, metric: MetricSpec, labels: Labels, value: float) -> None:
        with self._lock:
            self._series(metric, labels).value = float(value)

    def advance(self, metric: MetricSpec, labels: Labels, state: HistogramState,
                last: HistogramState | None) -> None:
        """Add a histogram state's bucket-count and sum deltas since ``last``."""
        with self._lock:
            ser = self._series(metric, labels, state.bounds)
            prev = last.counts if last is not None else (0,) * len(state.counts)
            # The family keeps the bounds of its first sample, as a prometheus_client
            # Histogram does; a state with other bounds is a bug (zip raises).
            for i, (new, old) in enumerate(zip(state.counts, prev, strict=True)):
                if new > old:
                    ser.counts[i] += new - old
            ser.value += state.sum - (last.sum if last is not None else 0.0)

    def _family(self, metric: MetricSpec, bounds: tuple[float, ...] = ()) -> _Family:
        fam = self._families.get(metric)
        if fam is None:
            fam = self._families[metric] = _Family(metric, bounds)
        return fam

    def _series(self, metric: MetricSpec, labels: Labels,
                bounds: tuple[float, ...] = ()) -> _Series:
        fam = self._family(metric, bounds)
        ser = fam.series.get(labels)
        if ser is None:
            ser = fam.series[labels] = self._new(fam)
        return ser

    @staticmethod
    def _new(fam: _Family) -> _Series:
        return _Series(counts=[0.0] * (len(fam.bounds) + 1)
                       if fam.metric.kind == "histogram" else [])

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        from prometheus_client.utils import floatToGoString

        created = _created_series_enabled()
        with self._lock:
            fams = [(f.metric, f.bounds, [(lab, ser.value, list(ser.counts), ser.created)
                                          for lab, ser in f.series.items()])
                    for f in self._families.values()]
        for m, bounds, rows in fams:
            if not rows:
                continue
            name = m.base_name
            out: Any
            if m.kind == "counter":
                out = CounterMetricFamily(name, m.help, labels=m.labels)
            elif m.kind == "gauge":
                out = GaugeMetricFamily(name, m.help, labels=m.labels)
            else:
                out = HistogramMetricFamily(name, m.help, labels=m.labels)
            edges = [floatToGoString(b) for b in (*bounds, float("inf"))]
            with_sum = (*bounds, 0.0)[0] >= 0  # no sum with negative buckets (as Histogram)
            # Sample by sample in the order prometheus_client's metric classes emit them.
            for lab, value, counts, t0 in rows:
                d = dict(lab)
                d = {k: d[k] for k in m.labels}  # catalog order, as .labels() keeps them
                if m.kind == "counter":
                    out.add_sample(name + "_total", d, value)
                elif m.kind == "gauge":
                    out.add_sample(name, d, value)
                else:
                    acc = 0.0
                    for le, n in zip(edges, counts, strict=True):
                        acc += n
                        out.add_sample(name + "_bucket", {**d, "le": le}, acc)
                    out.add_sample(name + "_count", d, acc)
                    if with_sum:
                        out.add_sample(name + "_sum", d, value)
                if created and m.kind != "gauge":
                    out.add_sample(name + "_created", d, t0)
            yield out


def _created_series_enabled() -> bool:
    """Whether prometheus_client emits ``_created`` series now (its
    ``PROMETHEUS_DISABLE_CREATED_SERIES`` and ``disable_created_metrics()``), asked through
    its public API: does an unregistered counter expose one?"""
    from prometheus_client import Counter

    fam = next(iter(Counter("attnprof_probe", "probe", registry=None).collect()))
    return any(smp.name.endswith("_created") for smp in fam.samples)


_COLLECTORS: weakref.WeakKeyDictionary[Any, RegistryCollector] = weakref.WeakKeyDictionary()
_COLLECTORS_LOCK = threading.Lock()


def _collector_for(registry: Any) -> RegistryCollector:
    """The one collector of ``registry`` (every sink of a process that writes there shares
    it: a plugin loaded twice adds to the same series instead of failing to register)."""
    with _COLLECTORS_LOCK:
        col = _COLLECTORS.get(registry)
        if col is None:
            col = _COLLECTORS[registry] = RegistryCollector()
            registry.register(col)
        return col


class PrometheusSink:
    """Renders samples: counter totals become increments (exactly once, whoever calls),
    gauges are set, histogram bucket counts and sums advance by their deltas."""

    name = "prometheus"

    def __init__(self, registry: Any = "default") -> None:
        import prometheus_client

        self._pc = prometheus_client
        if registry == "default":
            # In multiprocess mode the values live in files; registering in the global
            # registry too would only duplicate them on single-process scrapes.
            registry = None if multiprocess_enabled() else prometheus_client.REGISTRY
        self.registry = registry
        self._collector = _collector_for(registry) if registry is not None else None
        # Multiprocess mode: prometheus_client metric objects and their children, each built
        # once (on its first sample), never looked up by name.
        self._metrics: dict[MetricSpec, Any] = {}
        self._children: dict[tuple[MetricSpec, Labels], Any] = {}
        self._totals: dict[tuple[MetricSpec, Labels], Any] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._swept = 0.0

    def export(self, samples: Iterable[MetricSample]) -> None:
        if self._pid != os.getpid():
            self._forked()
        now = time.monotonic()
        if now - self._swept >= SWEEP_INTERVAL_S and multiprocess_enabled():
            self._swept = now
            sweep_dead()
        with self._lock:
            for smp in samples:
                if isinstance(smp, HistogramSample):
                    self._histogram(smp)
                else:
                    self._scalar(smp)

    def _forked(self) -> None:
        """A forked child: its multiprocess values live in its own, empty files, so a gauge
        equal to the parent's last value must still be written (the livesum would miss this
        process). Counter and histogram baselines stay: the child's sources inherited the
        parent's totals, and only what it adds after the fork is its own. The lock may have
        been held by a parent thread at the fork."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._totals = {k: v for k, v in self._totals.items() if k[0].kind != "gauge"}

    def _scalar(self, smp: Sample) -> None:
        # Most series do not change between flushes: compare first, touch prometheus_client
        # (file write in multiprocess mode) only for the ones that did.
        m = smp.metric
        key = (m, smp.labels)
        last = self._totals.get(key)
        counter = m.kind == "counter"
        if last is not None and (smp.value <= last if counter else smp.value == last):
            return  # unchanged (counters: running totals never go backwards)
        col = self._collector
        if col is not None:
            if counter:
                col.add(m, smp.labels, smp.value - (last or 0.0))
            else:
                col.set(m, smp.labels, smp.value)
        elif counter:
            self._child(m, smp.labels).inc(smp.value - (last or 0.0))
        else:
            self._child(m, smp.labels).set(smp.value)
        self._totals[key] = smp.value

    def _histogram(self, smp: HistogramSample) -> None:
        st = smp.state
        key = (smp.metric, smp.labels)
        last = self._totals.get(key)
        if last is not None and last.count == st.count:
            return  # unchanged: as for scalars, no file write
        if self._collector is not None:
            self._collector.advance(smp.metric, smp.labels, st, last)
        else:
            hist = self._children.get((smp.metric, smp.labels))
            if hist is None:
                hist = self._children[(smp.metric, smp.labels)] = _MultiprocessHistogram(
                    smp.metric, smp.labels, st.bounds)
            hist.advance(st, last)
        self._totals[key] = st

    def _child(self, m: MetricSpec, labels: Labels) -> Any:
        child = self._children.get((m, labels))
        if child is None:
            metric = self._metrics.get(m)
            if metric is None:
                metric = self._metrics[m] = self._create(m)
            child = metric.labels(**dict(labels)) if labels else metric
            self._children[(m, labels)] = child
        return child

    def _create(self, s: MetricSpec) -> Any:
        """A counter's or gauge's prometheus_client object (histograms:
        :class:`_MultiprocessHistogram`)."""
        pc = self._pc
        kw: dict[str, Any] = {"labelnames": s.labels, "registry": None}
        if s.kind == "counter":
            return pc.Counter(s.base_name, s.help, **kw)
        return pc.Gauge(s.base_name, s.help, multiprocess_mode=s.multiprocess_mode, **kw)

    def create_all(self) -> None:
        """Create every label-free catalog metric so it shows up (at zero) before traffic."""
        for s in CATALOG:
            if not s.labels and s.kind != "histogram":
                if self._collector is not None:
                    self._collector.ensure(s)
                else:
                    self._child(s, ())

    def mark_process_dead(self, pid: int) -> None:
        """Drop a leaving process's live gauges (multiprocess mode only)."""
        if multiprocess_enabled():
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid)


class _MultiprocessHistogram:
    """Multiprocess mode: one histogram child's values, made exactly as prometheus_client's
    ``Histogram`` makes them (``values.ValueClass`` per bucket, one per bound and +Inf, and one
    for the sum: the same keys in the same ``histogram_<pid>.db`` file, so
    ``MultiProcessCollector`` reads them alike). The sink adds the bucket-count and sum deltas
    of a :class:`HistogramState`, which ``Histogram.observe`` (one value at a time) cannot."""

    def __init__(self, s: MetricSpec, labels: Labels, bounds: tuple[float, ...]) -> None:
        from prometheus_client import values
        from prometheus_client.utils import floatToGoString

        names = tuple(s.labels)
        given = dict(labels)
        vals = tuple(str(given[n]) for n in names)
        self.buckets = [values.ValueClass("histogram", s.base_name, s.base_name + "_bucket",
                                          (*names, "le"), (*vals, floatToGoString(b)), s.help)
                        for b in (*bounds, float("inf"))]
        self.sum = values.ValueClass("histogram", s.base_name, s.base_name + "_sum", names,
                                     vals, s.help)

    def advance(self, st: HistogramState, last: HistogramState | None) -> None:
        prev = last.counts if last is not None else (0,) * len(st.counts)
        for value, new, old in zip(self.buckets, st.counts, prev, strict=True):
            if new > old:
                value.inc(new - old)
        self.sum.inc(st.sum - (last.sum if last is not None else 0.0))


