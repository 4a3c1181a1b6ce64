"""Context-length distributions from files, live snapshots, sketches and Prometheus.

Every parser raises :class:`InputError` with a one-line message; the CLI turns it into
``attnprof: error: ...``. Bucketed inputs (Prometheus histograms) are spread evenly inside
each bucket, so costs are approximate there and ``LengthDistribution.exact`` is False;
fractions of requests at or below a bucket edge stay exact.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attnprof.aggregate.quantiles import QuantileEstimator
from attnprof.analyze.sparsity.savings import LengthDistribution

__all__ = [
    "PROMETHEUS_QUERY",
    "InputError",
    "from_buckets",
    "from_prometheus_response",
    "from_sketch",
    "from_snapshot",
    "head_stats_from_snapshot",
    "parse_lengths_text",
    "read_lengths_file",
    "strata_from_snapshot",
]

PROMETHEUS_QUERY = "sum by (le) ({metric}_bucket{selector})"
_SUB_POINTS = 8  # points per histogram bucket


class InputError(ValueError):
    """Malformed or empty input; ``str(err)`` is one line."""


def from_buckets(buckets: Sequence[tuple[float, float]], source: str = "") -> LengthDistribution:
    """Cumulative ``(le, count)`` pairs (Prometheus style, +Inf allowed) -> distribution.

    Requests in (lo, hi] are spread over 8 evenly spaced lengths; the +Inf bucket sits just
    above the last finite edge (a lower bound: its savings are understated).
    """
    pts = sorted((float(le), float(c)) for le, c in buckets)
    if not pts:
        raise InputError(f"{source or 'histogram'}: no buckets")
    lengths: list[int] = []
    weights: list[float] = []
    prev_le, prev_c = 0.0, 0.0
    for le, c in pts:
        n = c - prev_c
        if n < -1e-9:
            raise InputError(f"{source or 'histogram'}: bucket counts are not cumulative")
        if n > 0:
            if math.isinf(le):
                lengths.append(int(prev_le) + 1)
                weights.append(n)
            else:
                lo, hi = prev_le, le
                k = max(1, min(_SUB_POINTS, int(hi - lo)))
                for j in range(1, k + 1):
                    lengths.append(max(1, round(lo + (hi - lo) * j / k)))
                    weights.append(n / k)
        if not math.isinf(le):
            prev_le = le
        prev_c = max(prev_c, c)
    if sum(weights) <= 0:
        raise InputError(f"{source or 'histogram'}: the distribution is empty (no requests)")
    return LengthDistribution.from_lengths(lengths, source, weights, exact=False)


def from_sketch(d: Mapping[str, Any], source: str = "") -> LengthDistribution:
    """A :meth:`QuantileEstimator.to_dict` (or an attnprof 0.1 ``QuantileSketch.to_dict``)
    -> distribution: the exact lengths while the estimator kept them, else the sketch's
    buckets (within its rel_err; ``exact`` False). Its quantiles are the estimator's."""
    try:
        est = QuantileEstimator.from_dict(d)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise InputError(f"{source or 'sketch'}: not a quantile sketch") from None
    if est.count == 0:
        raise InputError(f"{source or 'sketch'}: the distribution is empty (no requests)")
    pairs = est.distribution()
    if not est.sketch.integral:  # lengths are integers; only non-token data gets here
        pairs = [(max(1, round(v)), n) for v, n in pairs]
    exact = est.exact or est.sketch.min == est.sketch.max
    return LengthDistribution.from_lengths([int(v) for v, _ in pairs], source,
                                           [float(n) for _, n in pairs], exact=exact)


def from_snapshot(snap: Mapping[str, Any], source: str = "") -> LengthDistribution:
    """Context lengths of an ``attnprof.snapshot/*`` dict (``fetch_snapshot(url)``)."""
    req = snap.get("requests")
    sketch = ((req or {}).get("context_tokens") or {}).get("sketch") \
        if isinstance(req, Mapping) else None
    if not isinstance(sketch, Mapping):
        raise InputError(f"{source or 'snapshot'}: no finished requests recorded yet "
                         "(requests.context_tokens.sketch is missing)")
    return from_sketch(sketch, source)


def head_stats_from_snapshot(snap: Mapping[str, Any]) -> Any:
    """Merged head statistics of the prompts (the strata's ``total("prefill")``) from a
    snapshot (top level or per worker), or None."""
    strata = strata_from_snapshot(snap)
    return None if strata is None else strata.total("prefill")


def strata_from_snapshot(snap: Mapping[str, Any]) -> Any:
    """Every stratum of the head statistics of a snapshot (top level or per worker, merged),
    as a ``HeadStatsStrata``, or None (data of a version before strata is the one stratum
    ("prefill", 0))."""
    from attnprof.aggregate.head_strata import HeadStatsStrata

    found: list[Mapping[str, Any]] = []
    if isinstance(snap.get("head_stats"), Mapping):
        found.append(snap["head_stats"])
    for w in snap.get("workers") or []:
        if isinstance(w, Mapping) and isinstance(w.get("head_stats"), Mapping):
            found.append(w["head_stats"])
    out = None
    for d in found:
        try:
            one = HeadStatsStrata.load(d)
        except (KeyError, TypeError, ValueError):
            continue
        if out is None:
            out = one
        else:
            out.merge(one)
    return out


def from_prometheus_response(obj: Any, source: str = "prometheus") -> LengthDistribution:
    """Parse ``/api/v1/query`` JSON for ``sum by (le) (..._bucket)`` (instant vector)."""
    if not isinstance(obj, Mapping) or obj.get("status") != "success":
        err = obj.get("error") if isinstance(obj, Mapping) else None
        raise InputError(f"{source}: query failed: {err or 'not a Prometheus API response'}")
    data = obj.get("data")
    if not isinstance(data, Mapping) or data.get("resultType") != "vector":
        raise InputError(f"{source}: expected an instant vector result")
    buckets: list[tuple[float, float]] = []
    for r in data.get("result") or []:
        try:
            le = float(r["metric"]["le"])  # "+Inf" parses to inf
            val = float(r["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            raise InputError(f"{source}: a series has no 'le' label or value") from None
        if not math.isnan(val):
            buckets.append((le, val))
    if not buckets:
        raise InputError(f"{source}: no attnprof_request_context_tokens_bucket series "
                         "(is Prometheus scraping attnprof?)")
    return from_buckets(buckets, source)


def _positive_int(tok: str, where: str) -> int:
    try:
        v = float(tok)
    except ValueError:
        raise InputError(f"{where}: {tok[:40]!r} is not an integer length") from None
    if not v.is_integer() or v <= 0:
        raise InputError(f"{where}: {tok[:40]!r} is not a positive integer length")
    return int(v)


def parse_lengths_text(text: str, source: str) -> LengthDistribution:
    """One integer per line, a JSON list/object, or CSV with a header.

    JSON: a list of lengths; ``{"lengths": [...]}``; ``{"buckets": [{"le", "count"}]}``;
    a quantile sketch dict; an attnprof snapshot; a Prometheus query response.
    CSV: columns ``length`` (or ``context_tokens``) with optional ``count``, or ``le,count``.
    """
    stripped = text.strip()
    if not stripped:
        raise InputError(f"{source}: the file is empty (no lengths)")
    if stripped[0] in "[{":
        try:
            obj = json.loads(stripped)
        except ValueError as err:
            raise InputError(f"{source}: malformed JSON ({err})"
                             ) from None
        return _from_json(obj, source)
    first = stripped.splitlines()[0]
    if "," in first or first.strip().lower() in ("length", "context_tokens", "tokens"):
        return _from_csv(stripped, source)
    lengths = []
    for n, line in enumerate(stripped.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            lengths.append(_positive_int(line.strip(), f"{source} line {n}"))
    if not lengths:
        raise InputError(f"{source}: no lengths")
    return LengthDistribution.from_lengths(lengths, source)


def _from_json(obj: Any, source: str) -> LengthDistribution:
    if isinstance(obj, list):
        if not obj:
            raise InputError(f"{source}: the list of lengths is empty")
        return LengthDistribution.from_lengths(
            [_positive_int(str(x), f"{source} item {i}") for i, x in enumerate(obj)], source)
    if not isinstance(obj, Mapping):
        raise InputError(f"{source}: expected a JSON list or object")
    if "lengths" in obj:
        return _from_json(list(obj["lengths"] or []), source)
    if "buckets" in obj and isinstance(obj["buckets"], list):
        try:
            pairs = [(float(b["le"]), float(b["count"])) for b in obj["buckets"]]
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{source}: buckets need 'le' and 'count'") from None
        return from_buckets(pairs, source)
    if "rel_err" in obj and "buckets" in obj:
        return from_sketch(obj, source)
    if str(obj.get("schema_version", "")).startswith("attnprof.snapshot/"):
        return from_snapshot(obj, source)
    if "status" in obj and "data" in obj:
        return from_prometheus_response(obj, source)
    raise InputError(f"{source}: unrecognized JSON (expected a list of lengths, "
                     "'lengths', 'buckets', a sketch or a snapshot)")


def _from_csv(text: str, source: str) -> LengthDistribution:
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows or not rows[0]:
        raise InputError(f"{source}: CSV has no rows")
    cols = {c.strip().lower(): c for c in rows[0] if c}
    if "le" in cols and "count" in cols:
        try:
            pairs = [(float(r[cols["le"]]), float(r[cols["count"]])) for r in rows]
        except (TypeError, ValueError):
            raise InputError(f"{source}: CSV le/count values must be numbers") from None
        return from_buckets(pairs, source)
    key = cols.get("length") or cols.get("context_tokens") or cols.get("tokens")
    if key is None:
        raise InputError(f"{source}: CSV needs a 'length' column or 'le,count' columns")
    lengths = [_positive_int(str(r[key]).strip(), f"{source} row {i}")
               for i, r in enumerate(rows, 2)]
    weights = None
    if "count" in cols:
        try:
            weights = [float(r[cols["count"]]) for r in rows]
        except (TypeError, ValueError):
            raise InputError(f"{source}: CSV counts must be numbers") from None
    return LengthDistribution.from_lengths(lengths, source, weights)


def read_lengths_file(path: Path) -> LengthDistribution:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read {str(path)!r}: "
                         f"{getattr(err, 'strerror', None) or err}") from None
    try:
        return parse_lengths_text(text, str(path))
    except ValueError as err:  # LengthDistribution raises plain ValueError on all-zero input
        if isinstance(err, InputError):
            raise
        raise InputError(f"{path}: {err}") from None
