"""TensorBoard event files from a profile or from live snapshots, without TensorFlow or torch:
the protos and the event-file writer that ship with the ``tensorboard`` package (imported
only when a writer is built, so ``import attnprof.exporters.tensorboard`` stays light).

Scalar tags are a contract (README "TensorBoard"), built here and nowhere else:

- ``attention/layer_NN/time_ms/<phase>``: mean ms per attention call of layer NN (two digits,
  three for models of 100+ layers, so the dashboard sorts them);
- ``attention/fused_fraction`` / ``attention/fused_time_fraction``: the share of attention
  calls / of attention time that ran a fused kernel;
- ``attention/share/<phase>``: attention time over model time;
- ``context/p50|p90|p99|mean|max``: context length of the traffic, in tokens;
- ``window/attention_flop_saving|kv_memory_saving|exact_request_fraction|window|sinks|layers``:
  the sliding-window advice;
- ``sampler/effective_rate|self_time_fraction`` (live only).

Steps: in a profile, a series that depends on the prefill length is written at step = that
length (tokens), so TensorBoard draws it against length; the rest at step 0. Live, step is the
poll number and wall time the snapshot's time. Text ``kernel_map`` (Markdown) and images
``activation_map`` and ``scaling`` (profile only) complete it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnprof.analyze.headline import first_layers, fused_fractions, kernel_rows, step_shares
from attnprof.contracts.advice import WindowAdvice
from attnprof.contracts.profile import ProfileReport
from attnprof.contracts.snapshot import Snapshot

__all__ = [
    "EventWriter",
    "Scalar",
    "layer_tag",
    "profile_scalars",
    "snapshot_scalars",
    "write_profile_events",
]

TEXT_KERNEL_MAP = "kernel_map"
IMAGE_ACTIVATION_MAP = "activation_map"
IMAGE_SCALING = "scaling"


@dataclass(frozen=True)
class Scalar:
    """One point of one TensorBoard scalar series."""

    tag: str
    value: float
    step: int = 0


def layer_tag(layer: int, num_layers: int, phase: str) -> str:
    """``attention/layer_07/time_ms/prefill``: the index zero-padded to two digits (three from
    100 layers), so TensorBoard's alphabetical order is the layer order."""
    width = max(2, len(str(max(num_layers - 1, layer, 0))))
    return f"attention/layer_{layer:0{width}d}/time_ms/{phase}"


def _finite(items: Iterable[Scalar]) -> list[Scalar]:
    # A NaN or inf point breaks TensorBoard's axis scaling; a missing point says "unknown".
    return [s for s in items if math.isfinite(s.value)]


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _window_scalars(adv: Any) -> list[Scalar]:
    if not isinstance(adv, WindowAdvice):
        return []
    return [Scalar("window/attention_flop_saving", adv.attention_flop_saving),
            Scalar("window/kv_memory_saving", adv.kv_memory_saving),
            Scalar("window/exact_request_fraction", adv.exact_request_fraction),
            Scalar("window/window", float(adv.window)),
            Scalar("window/sinks", float(adv.sinks)),
            Scalar("window/layers", float(len(adv.layers)))]


def profile_scalars(report: ProfileReport) -> list[Scalar]:
    """Every scalar of an ``attnprof profile`` result (module docstring for the tags)."""
    out: list[Scalar] = []
    n = report.model.num_layers
    for lay in report.layers:
        for length, sec in lay.timing.median_s_by_seq_len.items():
            out.append(Scalar(layer_tag(lay.layer, n, "prefill"), sec * 1e3, int(length)))
    frac, tfrac = fused_fractions(kernel_rows(report))
    if frac is not None:
        out.append(Scalar("attention/fused_fraction", frac))
    if tfrac is not None:
        out.append(Scalar("attention/fused_time_fraction", tfrac))
    for row in report.scaling.by_seq_len:
        share = _ratio(row.attention_s, row.forward_s)
        if share is not None:
            out.append(Scalar("attention/share/prefill", share, row.seq_len))
    adv = report.window_advice
    if adv is not None:
        t = adv.traffic
        out += [Scalar(f"context/{k}", float(getattr(t, k))) for k in ("p50", "p90", "p99",
                                                                       "max")]
    out += _window_scalars(adv)
    return _finite(out)


def snapshot_scalars(snap: Snapshot, step: int = 0) -> list[Scalar]:
    """Every scalar of one live snapshot at ``step`` (module docstring for the tags)."""
    out: list[Scalar] = []
    layers = first_layers(snap)
    n = max((lay.index + 1 for lay in layers), default=0)
    for lay in layers:
        for phase, st in lay.phases.items():
            if st.calls > 0:
                out.append(Scalar(layer_tag(lay.index, n, phase), st.mean_time_s * 1e3, step))
    frac, tfrac = fused_fractions(kernel_rows(snap))
    if frac is not None:
        out.append(Scalar("attention/fused_fraction", frac, step))
    if tfrac is not None:
        out.append(Scalar("attention/fused_time_fraction", tfrac, step))
    out += [Scalar(f"attention/share/{p}", v, step) for p, v in step_shares(snap).items()]
    req = snap.requests
    if req is not None and req.context_tokens.count > 0:
        q = req.context_tokens
        for k in ("p50", "p90", "p99", "mean", "max"):
            v = getattr(q, k)
            if v is not None:
                out.append(Scalar(f"context/{k}", float(v), step))
    out += [Scalar(s.tag, s.value, step) for s in _window_scalars(snap.window_advice)]
    sampler = next((w.sampler for w in snap.workers if w.sampler.seen > 0), None)
    if sampler is not None:
        out += [Scalar("sampler/effective_rate", sampler.effective_rate, step),
                Scalar("sampler/self_time_fraction", sampler.self_time_fraction, step)]
    return _finite(out)


def _png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header; ValueError if it is not a PNG."""
    if png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("not a PNG image")
    w, h = struct.unpack(">II", png[16:24])
    return int(w), int(h)


class EventWriter:
    """One TensorBoard event file in ``logdir`` (created by tensorboard's
    ``EventFileWriter``: ``events.out.tfevents.<time>.<host>.<pid>.<n>``). Every ``add_*`` is
    queued; :meth:`flush` puts it on disk, :meth:`close` flushes and closes. ImportError if
    the ``tensorboard`` package is missing (the CLI checks first)."""

    def __init__(self, logdir: Path, flush_secs: float = 120.0) -> None:
        from tensorboard.compat.proto import (  # type: ignore[import-untyped]
            event_pb2,
            summary_pb2,
            tensor_pb2,
            tensor_shape_pb2,
            types_pb2,
        )
        from tensorboard.plugins.text import metadata as text_metadata  # type: ignore[import-untyped]
        from tensorboard.summary.writer.event_file_writer import (  # type: ignore[import-untyped]
            EventFileWriter,
        )

        self._event, self._summary = event_pb2, summary_pb2
        self._tensor, self._shape, self._types = tensor_pb2, tensor_shape_pb2, types_pb2
        self._text_meta = text_metadata.create_summary_metadata(display_name=None,
                                                                description=None)
        before = set(logdir.glob("*tfevents*")) if logdir.is_dir() else set()
        self._w = EventFileWriter(str(logdir), max_queue_size=64, flush_secs=flush_secs)
        # The writer's file name is private; if a version renames it, the new file is it.
        name = getattr(self._w, "_file_name", None)
        self.path = Path(name) if isinstance(name, str) else max(
            set(logdir.glob("*tfevents*")) - before, key=lambda p: p.stat().st_mtime)
        """The event file this writer fills."""

    def _add(self, value: Any, step: int, wall_time: float) -> None:
        summary = self._summary.Summary(value=[value])
        self._w.add_event(self._event.Event(wall_time=wall_time, step=step, summary=summary))

    def add_scalars(self, scalars: Sequence[Scalar], wall_time: float) -> None:
        """Scalars as ``simple_value`` summaries (what EventAccumulator.Scalars reads)."""
        for s in scalars:
            self._add(self._summary.Summary.Value(tag=s.tag, simple_value=s.value), s.step,
                      wall_time)

    def add_text(self, tag: str, text: str, step: int, wall_time: float) -> None:
        """Markdown shown in TensorBoard's Text tab (a string tensor with the text plugin's
        metadata)."""
        tensor = self._tensor.TensorProto(dtype=self._types.DT_STRING,
                                          tensor_shape=self._shape.TensorShapeProto(),
                                          string_val=[text.encode()])
        self._add(self._summary.Summary.Value(tag=tag, metadata=self._text_meta,
                                              tensor=tensor), step, wall_time)

    def add_image(self, tag: str, png: bytes, step: int, wall_time: float) -> None:
        """A PNG shown in TensorBoard's Images tab; ValueError if ``png`` is not a PNG."""
        w, h = _png_size(png)
        image = self._summary.Summary.Image(height=h, width=w, colorspace=4,
                                            encoded_image_string=png)
        self._add(self._summary.Summary.Value(tag=tag, image=image), step, wall_time)

    def flush(self) -> None:
        """Write everything queued so far to the file."""
        self._w.flush()

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        self._w.close()

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_profile_events(logdir: Path, report: ProfileReport, kernel_map_md: str,
                         images: Mapping[str, bytes], wall_time: float) -> Path:
    """One event file in ``logdir`` with a profile's scalars, its kernel map as text and
    ``images`` (tag -> PNG); returns the file's path."""
    with EventWriter(logdir) as w:
        w.add_scalars(profile_scalars(report), wall_time)
        w.add_text(TEXT_KERNEL_MAP, kernel_map_md, 0, wall_time)
        for tag, png in images.items():
            w.add_image(tag, png, 0, wall_time)
        path = w.path
    return path
