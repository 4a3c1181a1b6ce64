"""Per-(layer, head) attention statistics on sampled queries, in bounded memory.

(One module over 500 lines: the folds, estimators and wire format all walk the same arrays
and field lists of one class; a split would declare every field twice.)

Fused attention kernels return no probabilities, so for a bounded sample of queries capture
recomputes the softmax row against all causal keys in fp32, in chunks of ``chunk_queries``
queries (:mod:`attnprof.capture.head_rows`, the torch side), and this accumulator folds the
per-query numbers it hands over (numpy arrays) into fixed-size arrays. The sample is
stratified by position: ``n_random`` strata cover the prompt (narrower towards its end,
where more keys are seen and more windows can be tested), one uniform draw in each, plus the
last ``n_last`` queries as a census stratum. Every sampled query carries the Horvitz-
Thompson weight of its stratum (positions / draws), and every sum and histogram below is
weighted, so means and quantiles estimate the all-query values without bias (the sample is
not skewed towards the prompt's end). Entropy, top-k and output norms run on ``n_detail`` of
the sampled queries, one drawn from each of ``n_detail`` consecutive groups with probability
proportional to weight (weight: the group's total), so they too estimate all-query means.
Raw counts (``queries``, ``cov_n``, ``detail_n``) stay alongside as evidence, and ``cov_w2``
(sum of squared weights) gives the effective sample size used for sampling errors.

* sink mass for each s in ``sinks_grid``: sum_{j<s} p_ij
* coverage C(s, w) = local mass of the last w keys + sink mass, over queries that see more
  than s + w keys (shorter ones are exact under the window and would inflate coverage):
  count, sum, min and a histogram of 1 - C on fixed edges (for low quantiles)
* normalized entropy, top-k needed for ``gamma`` of the mass (log-bucketed), max weight
* how often the top-1 key lies outside sinks + window (s <= j <= i - w)
* optionally the head-output norm ||p_i V|| (when ``v`` is given), for the dormant rule
* for underused heads (:mod:`attnprof.analyze.sparsity.underused`): a histogram of each
  query's sink mass (queries that see at least ``DORMANT_MIN_SEEN`` x s keys), and on the
  detail queries the Jensen-Shannon distance between every pair of query heads of a layer
  (sum, count, and count above ``JS_FAR``): O(layers * q_heads^2)

Memory is O(layers * q_heads * |sinks| * |windows| * bins), independent of traffic; the
state merges across requests, processes and replicas (:meth:`merge`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "COVERAGE_LOSS_EDGES",
    "DEFAULT_SINKS_GRID",
    "DEFAULT_WINDOW_GRID",
    "DORMANT_MIN_SEEN",
    "JS_FAR",
    "SINK_MASS_EDGES",
    "HeadStatsAccumulator",
]

DEFAULT_SINKS_GRID = (0, 4, 16, 64, 128)
DEFAULT_WINDOW_GRID = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# Edges of 1 - C (mass outside sinks + window). 1 - tau for tau in {0.9, 0.95, 0.99} are
# edges, so "low quantile of C >= tau" is decided exactly from the histogram.
COVERAGE_LOSS_EDGES = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                       0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# Edges of a query's sink mass (dormant heads: "almost all mass on the first tokens for
# almost all queries" is read as a share of queries at or above an edge).
SINK_MASS_EDGES = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99)
DORMANT_MIN_SEEN = 4
"""A query counts in the sink-mass histogram at sinks s only when it sees >= 4 s keys:
uniform attention would put <= 1/4 of its mass on the sinks (the first s queries trivially
put all of it there)."""
JS_FAR = 0.1
"""Jensen-Shannon distance (base 2, in [0, 1]) above which a detail query counts as one
where two heads clearly differ."""
JS_CHUNK_ELEMENTS = 1 << 22
"""Head pairs x keys computed at once for the pairwise JS distances (bounds the scratch: a
few float32 buffers of this size, 16 MiB each)."""
_ENTROPY_BINS = 20
_SCHEMA = "attnprof.head_stats/2"
_OLD_SCHEMA = "attnprof.head_stats/1"  # unweighted sums: read as weight 1 per sampled query
# Sample density over a prompt's positions is proportional to position / length + this floor
# (the last stratum is 5x narrower than the first): long-range windows are tested on more
# queries, and the weights undo the tilt.
_DENSITY_FLOOR = 0.25
TAKE_PIECE_ELEMENTS = 1 << 16
"""Entries scanned (or x 8 bytes written) between two pauses of :meth:`take_chunks`: about
0.1-0.3 ms of work each on one core."""


def _tolist(a: Any, piece: int = 1 << 16) -> list[Any]:
    """``a.tolist()`` in pieces: one call on millions of entries holds the GIL for tens of
    milliseconds (an API server's event loop waits that long)."""
    out: list[Any] = []
    for i in range(0, a.size, piece):
        out += a[i:i + piece].tolist()
    return out


class _Pieces:
    """A seekable sink for ``zipfile`` that keeps each write as a buffer of its own (no
    copy, no growing buffer); zipfile's one rewrite, a local header at its own offset and
    of its own length, replaces that buffer."""

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self._starts: dict[int, int] = {}  # offset -> index in parts
        self._pos = 0
        self._size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self._pos == self._size:
            self._starts[self._pos] = len(self.parts)
            self.parts.append(data if isinstance(data, bytes) else view)
            self._size += n
        else:
            i = self._starts.get(self._pos)
            if i is None or memoryview(self.parts[i]).nbytes != n:
                raise ValueError("only a whole earlier write can be rewritten")
            self.parts[i] = bytes(view)
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1
                                             else self._size + pos)
        return self._pos

    def flush(self) -> None:
        pass


def _kbins(max_k: int = 1 << 20) -> tuple[int, ...]:
    out, k = [], 1
    while k <= max_k:
        out.append(k)
        k *= 2
    return tuple(out)


class HeadStatsAccumulator:
    """Bounded, mergeable attention statistics per (layer, query head).

    Decisions are made per KV head by :mod:`attnprof.analyze.sparsity.classify` (a KV head's
    window is the max over the ``group_size`` query heads that share it).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, group_size: int,
                 sinks_grid: Sequence[int] = DEFAULT_SINKS_GRID,
                 window_grid: Sequence[int] = DEFAULT_WINDOW_GRID, *,
                 n_last: int = 0, n_random: int = 64, n_detail: int = 2,
                 chunk_queries: int = 16, mass_gamma: float = 0.9, seed: int = 0) -> None:
        if num_layers <= 0 or num_kv_heads <= 0 or group_size <= 0:
            raise ValueError("num_layers, num_kv_heads and group_size must be positive")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.group_size = group_size
        self.sinks_grid = tuple(sorted({0, *(int(s) for s in sinks_grid)}))
        self.window_grid = tuple(sorted({int(w) for w in window_grid}))
        if not self.window_grid or self.window_grid[0] < 1 or self.sinks_grid[0] < 0:
            raise ValueError("window_grid needs positive windows, sinks_grid non-negative sinks")
        self.n_last = n_last
        self.n_random = n_random
        self.n_detail = n_detail
        self.chunk_queries = max(1, chunk_queries)
        self.mass_gamma = mass_gamma
        self.seed = seed
        self.k_edges = _kbins()
        lh = (num_layers, self.num_q_heads)
        sw = (len(self.sinks_grid), len(self.window_grid))
        self.queries = np.zeros(lh)  # sampled queries (raw count)
        self.detail_n = np.zeros(lh)  # detail queries (raw count)
        self.weight_sum = np.zeros(lh)  # sum of weights: estimated queries in the population
        self.detail_w = np.zeros(lh)
        self.requests = np.zeros(num_layers)  # request shares: a piece of a prompt counts part
        # requests counted whole, once each: a prompt on the piece holding its last position,
        # a decode sequence on its first fold of the stratum (what "N requests folded" says)
        self.requests_seen = np.zeros(num_layers)
        self.sink_sum = np.zeros((*lh, len(self.sinks_grid)))
        self.entropy_sum = np.zeros(lh)
        self.entropy_hist = np.zeros((*lh, _ENTROPY_BINS))
        self.maxw_sum = np.zeros(lh)
        self.topk_frac_sum = np.zeros(lh)
        self.topk_hist = np.zeros((*lh, len(self.k_edges)))
        self.cov_n = np.zeros((*lh, *sw))  # eligible sampled queries (raw count)
        self.cov_w = np.zeros((*lh, *sw))  # their weights: sum, sum of squares
        self.cov_w2 = np.zeros((*lh, *sw))
        self.cov_sum = np.zeros((*lh, *sw))
        self.cov_sq = np.zeros((*lh, *sw))  # weighted sum of C^2 (standard errors)
        self.cov_min = np.ones((*lh, *sw))
        self.cov_hist = np.zeros((*lh, *sw, len(COVERAGE_LOSS_EDGES)))
        self.top1_out = np.zeros((*lh, *sw))
        self.out_norm_sum = np.zeros(lh)
        self.out_norm_n = np.zeros(lh)  # weighted
        # underused heads: sink-mass histogram per sinks grid value, pairwise JS per layer
        self.sink_hist = np.zeros((*lh, len(self.sinks_grid), len(SINK_MASS_EDGES)))
        self.sink_n = np.zeros((*lh, len(self.sinks_grid)))  # eligible queries (raw count)
        hh = (num_layers, self.num_q_heads, self.num_q_heads)
        self.js_sum = np.zeros(hh)  # weighted, like js_n and js_far
        self.js_n = np.zeros(hh)
        self.js_far = np.zeros(hh)
        self.js_k = np.zeros(hh)  # detail queries per pair (raw count)
        # rows whose coverage statistics (``_COV_FIELDS``) come from every query of the
        # prompts, weight 1 (:meth:`set_exact`): their failing share has no sampling error
        self.exact: Any = np.zeros(lh, dtype=bool)

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group_size

    # ------------------------------------------------------------------ sampling
    def _rng(self, num_queries: int, q_start: int, salt: str) -> np.random.Generator:
        h = hashlib.blake2b(f"{self.seed}:{num_queries}:{q_start}:{salt}".encode(),
                            digest_size=8)
        return np.random.default_rng(int.from_bytes(h.digest(), "little"))

    def sample_plan(self, num_queries: int, q_start: int) -> tuple[Any, Any]:
        """(indices into the request's queries, sorted; their weights).

        The last ``n_last`` queries are a census stratum (weight 1); the others are split
        into ``n_random`` position strata whose density grows with position (one uniform
        draw each, weight = the stratum's width). Sum of weights = ``num_queries``.
        Deterministic per (seed, length, start), so every layer of one request samples the
        same positions."""
        n = max(0, int(num_queries))
        n_last = min(max(0, self.n_last), n)
        rest = n - n_last
        k = min(max(0, self.n_random), rest)
        picked: Any
        if k >= rest:
            picked = np.arange(rest, dtype=np.int64)
            widths = np.ones(rest)
        elif k == 0:  # census of the last queries only (weights then cover just those)
            picked = np.zeros(0, dtype=np.int64)
            widths = np.zeros(0)
        else:
            a = _DENSITY_FLOOR
            f = np.arange(k + 1) / k
            u = -a + np.sqrt(a * a + f * (1 + 2 * a))  # inverse CDF of density u + a on [0, 1]
            # k strata of width >= 1 covering [0, rest) exactly
            edges = np.round(u * (rest - k)).astype(np.int64) + np.arange(k + 1)
            widths_i = np.diff(edges)
            draw = self._rng(n, q_start, "q").random(k)
            picked = edges[:-1] + np.minimum((draw * widths_i).astype(np.int64), widths_i - 1)
            widths = widths_i.astype(np.float64)
        idx = np.concatenate([picked, np.arange(rest, n, dtype=np.int64)])
        return idx, np.concatenate([widths, np.ones(n_last)])

    def detail_subset(self, num_sampled: int, weights: Any = None, q_start: int = 0
                      ) -> list[tuple[int, float]]:
        """(position in the sorted sample, weight) of the queries that also get entropy, top-k
        and output norms: the sample is cut into ``n_detail`` groups of consecutive queries,
        and one query per group is drawn with probability proportional to its weight; it
        carries the group's total weight (unbiased for all-query means, equal weights)."""
        nd = min(self.n_detail, num_sampled)
        if nd <= 0:
            return []
        w = np.ones(num_sampled) if weights is None else np.asarray(weights, dtype=np.float64)
        draws = self._rng(num_sampled, q_start, f"d{float(w.sum())}").random(nd)
        out: list[tuple[int, float]] = []
        for grp, r in zip(np.array_split(np.arange(num_sampled), nd), draws, strict=True):
            cw = np.cumsum(w[grp])
            j = min(int(np.searchsorted(cw, r * cw[-1], side="right")), len(grp) - 1)
            out.append((int(grp[j]), float(cw[-1])))
        return out

    # ------------------------------------------------------------------ updates
    # Capture computes the softmax rows (:mod:`attnprof.capture.head_rows`, torch) and hands
    # over per-query numbers as numpy arrays; the folds below only count them.
    def fold_rows(self, layer: int, pos: Any, sink_m: Any, local: Any, top1: Any, maxw: Any,
                  wts: Any = None) -> None:
        """Fold one chunk of sampled queries at ``layer``: ``pos`` [c] their positions,
        ``sink_m`` [c, hq, S] their mass on the first s keys, ``local`` [c, hq, W] on the last
        w keys, ``top1`` [c, hq] the position of their largest weight, ``maxw`` [c, hq] that
        weight, ``wts`` [c] their Horvitz-Thompson weights (default 1). Numpy only."""
        self._fold(layer, pos, sink_m, local, top1, maxw, wts)
        self._fold_sinks(layer, pos, sink_m, wts)

    def fold_detail(self, layer: int, n: int, entropy: Any, topk: Any, js: Any,
                    out_norm: Any = None, weight: float = 1.0) -> None:
        """Fold one detail query at ``layer`` that sees ``n`` keys: per query head its
        normalized ``entropy``, ``topk`` (keys needed for ``mass_gamma`` of the mass), the
        upper triangle ``js`` of its pairwise Jensen-Shannon distances (row-major, as
        ``np.triu_indices``; None below two heads) and optionally its output norm, all
        weighted by ``weight``."""
        L = layer
        hq = self.num_q_heads
        self.detail_n[L] += 1
        self.detail_w[L] += weight
        self.entropy_sum[L] += weight * entropy
        eb = np.clip((entropy * _ENTROPY_BINS).astype(np.int64), 0, _ENTROPY_BINS - 1)
        self.entropy_hist[L, np.arange(hq), eb] += weight
        self.topk_frac_sum[L] += weight * topk / n
        kb = np.clip(np.searchsorted(self.k_edges, topk, side="left"), 0,
                     len(self.k_edges) - 1)
        self.topk_hist[L, np.arange(hq), kb] += weight
        if js is not None:
            self.fold_pairs(L, js, weight)
        if out_norm is not None:
            self.out_norm_sum[L] += weight * out_norm
            self.out_norm_n[L] += weight

    def fold_pairs(self, layer: int, js: Any, weight: float = 1.0) -> None:
        """Add one detail query's Jensen-Shannon distances ``js`` between every pair of query
        heads (the upper triangle, row-major as ``np.triu_indices``) at ``layer``."""
        iu = np.triu_indices(self.num_q_heads, 1)
        self.js_sum[layer][iu] += weight * js
        self.js_n[layer][iu] += weight
        self.js_far[layer][iu] += weight * (js > JS_FAR)
        self.js_k[layer][iu] += 1

    def count_request(self, layer: int) -> None:
        """One more request folded at ``layer``."""
        self.requests[layer] += 1
        self.requests_seen[layer] += 1

    def _fold(self, layer: int, pos: Any, sink_m: Any, local: Any, top1: Any, maxw: Any,
              wts: Any = None) -> None:
        """Weighted sums and histograms of one chunk (``wts``: [c] Horvitz-Thompson weights,
        default 1); raw counts of sampled and eligible queries alongside."""
        c = top1.shape[0]
        wq = np.ones(c) if wts is None else np.asarray(wts, dtype=np.float64)
        sinks = np.asarray(self.sinks_grid)
        wins = np.asarray(self.window_grid)
        posn = np.asarray(pos)
        nseen = posn + 1.0
        cov = np.minimum(local[:, :, None, :] + sink_m[..., None], 1.0)  # [c, hq, S, W]
        elig = nseen[:, None, None] > (sinks[:, None] + wins[None, :])[None]  # [c, S, W]
        e = np.broadcast_to(elig[:, None], cov.shape).astype(np.float64)
        out = ((top1[..., None, None] >= sinks[None, None, :, None])
               & (top1[..., None, None] <= (posn[:, None, None, None] - wins[None, None, None, :])))
        L = layer
        ew = e * wq[:, None, None, None]
        self.queries[L] += c
        self.weight_sum[L] += wq.sum()
        self.sink_sum[L] += (sink_m * wq[:, None, None]).sum(0)
        self.maxw_sum[L] += (maxw * wq[:, None]).sum(0)
        self.cov_n[L] += e.sum(0)
        self.cov_w[L] += ew.sum(0)
        self.cov_w2[L] += (ew * wq[:, None, None, None]).sum(0)
        self.cov_sum[L] += (cov * ew).sum(0)
        self.cov_sq[L] += (cov * cov * ew).sum(0)
        self.cov_min[L] = np.minimum(self.cov_min[L], np.where(e > 0, cov, 1.0).min(0))
        self.top1_out[L] += (out * ew).sum(0)
        nb = len(COVERAGE_LOSS_EDGES)
        cb = np.clip(np.searchsorted(COVERAGE_LOSS_EDGES, 1.0 - cov, side="right") - 1, 0,
                     nb - 1)
        # one-hot add per eligible (query, head, s, w): bounded by the sample size
        flat = (cb + nb * np.arange(cb[0].size).reshape(cb.shape[1:])[None]).ravel()
        counts = np.bincount(flat, weights=ew.ravel(), minlength=cb[0].size * nb)
        self.cov_hist[L] += counts.reshape(*cb.shape[1:], nb)

    def _fold_sinks(self, layer: int, pos: Any, sink_m: Any, weight: Any = None) -> None:
        """Histogram of each sampled query's sink mass per [q head, s] (``sink_m``: [c, hq,
        S]); only queries that see >= ``DORMANT_MIN_SEEN`` * s keys count at s. ``weight``:
        per-query weights [c] (default 1 each)."""
        posn = np.asarray(pos, dtype=np.float64)
        w = np.ones(len(posn)) if weight is None else np.asarray(weight, dtype=np.float64)
        sinks = np.asarray(self.sinks_grid)
        elig = ((posn[:, None] + 1) >= DORMANT_MIN_SEEN * sinks[None, :]) & (sinks[None, :] > 0)
        ew = elig * w[:, None]  # [c, S]
        nb = len(SINK_MASS_EDGES)
        b = np.clip(np.searchsorted(SINK_MASS_EDGES, sink_m, side="right") - 1, 0, nb - 1)
        onehot = b[..., None] == np.arange(nb)  # [c, hq, S, E]
        self.sink_hist[layer] += (onehot * ew[:, None, :, None]).sum(0)
        self.sink_n[layer] += elig.sum(0)[None, :]

    def js_mean(self) -> Any:
        """Mean JS distance per [layer, head a, head b] (symmetric; NaN: no pair data)."""
        n = self.js_n + self.js_n.transpose(0, 2, 1)
        s = self.js_sum + self.js_sum.transpose(0, 2, 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, s / np.maximum(n, 1e-300), np.nan)

    def sink_share_at_least(self, mass: float, sinks: int) -> tuple[Any, Any]:
        """(all-query share (weighted) of the queries that see >= ``DORMANT_MIN_SEEN`` x
        ``sinks`` keys whose mass on the first ``sinks`` keys is >= ``mass``, the raw count
        of sampled queries behind it) per [layer, q head]; ``mass`` must be an edge of
        :data:`SINK_MASS_EDGES` so the share is exact."""
        if mass not in SINK_MASS_EDGES or sinks not in self.sinks_grid or sinks == 0:
            raise ValueError(f"mass must be one of {SINK_MASS_EDGES} and sinks a positive "
                             f"value of {self.sinks_grid}")
        si = self.sinks_grid.index(sinks)
        h = self.sink_hist[:, :, si]
        n = h.sum(-1)
        at = h[..., SINK_MASS_EDGES.index(mass):].sum(-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, at / np.maximum(n, 1e-300), np.nan), self.sink_n[:, :, si]

    # ------------------------------------------------------------------ read-out
    def coverage_quantile(self, q: float = 0.05, z: float = 0.0) -> Any:
        """Conservative low quantile of C(s, w) per [layer, q head, s, w] (NaN: no evidence).

        Walks the weighted 1 - C histogram from its top; the bin holding the (1-q) quantile
        of 1 - C gives C's q quantile as 1 - its upper edge (never overstated by the
        binning). ``z`` > 0 makes it a lower confidence bound: a bin's share from the top
        counts as p + z * sqrt(p (1 - p) / n_eff) (Kish's effective sample size), so the
        result is >= tau only when the share of queries below tau is <= q with that margin.
        """
        hist = self.cov_hist
        n = hist.sum(-1)
        from_top = np.cumsum(hist[..., ::-1], axis=-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = from_top / np.maximum(n, 1e-300)[..., None]
            if z > 0:
                neff = self.n_eff()[..., None]
                margin = z * np.sqrt(share * (1 - share) / np.maximum(neff, 1e-300))
                share = share + np.where(self._exact4()[..., None], 0.0, margin)
        # first bin from the top where the share from the top exceeds q
        k = np.argmax(share > q * (1 + 1e-12), axis=-1)
        bin_idx = hist.shape[-1] - 1 - k
        upper = np.asarray((*COVERAGE_LOSS_EDGES[1:], 1.0))[bin_idx]
        # a value of exactly 0 loss sits in bin 0 whose upper edge is 0.001: treat as exact
        upper = np.where(bin_idx == 0, np.minimum(upper, 1 - np.minimum(self.cov_min, 1.0)),
                         upper)
        out = 1.0 - upper
        return np.where(n > 0, out, np.nan)

    def n_eff(self) -> Any:
        """Effective sample size (sum w)^2 / sum w^2 per [layer, q head, s, w] (0: none).
        Exact rows (every query, weight 1) read as their query count; their errors are 0."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.cov_w2 > 0, self.cov_w ** 2 / np.maximum(self.cov_w2, 1e-300),
                            0.0)

    def _exact4(self) -> Any:
        return self.exact[:, :, None, None]

    def coverage_mean(self) -> Any:
        """All-query mean of C(s, w) (weighted), per [layer, q head, s, w]."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.cov_w > 0, self.cov_sum / np.maximum(self.cov_w, 1e-300),
                            np.nan)

    def coverage_se(self) -> Any:
        """Standard error of :meth:`coverage_mean`: weighted spread / sqrt(n_eff), a
        stratified sample's error is at most this (NaN below 2 sampled queries)."""
        mean = self.coverage_mean()
        with np.errstate(invalid="ignore", divide="ignore"):
            var = np.maximum(self.cov_sq / np.maximum(self.cov_w, 1e-300) - mean ** 2, 0.0)
            neff = self.n_eff()
            se = np.where(self.cov_n >= 2, np.sqrt(var / np.maximum(neff - 1, 1e-300)),
                          np.nan)
        return np.where(self._exact4() & (self.cov_n > 0), 0.0, se)

    def fail_share(self, tau: float) -> tuple[Any, Any]:
        """(estimated share of all eligible queries with C < ``tau``, its standard error)
        per [layer, q head, s, w]; 1 - ``tau`` must be an edge of the loss histogram."""
        edge = 1.0 - tau
        idx = int(np.argmin(np.abs(np.asarray(COVERAGE_LOSS_EDGES) - edge)))
        if abs(COVERAGE_LOSS_EDGES[idx] - edge) > 1e-9:
            raise ValueError(f"1 - tau = {edge:g} is not an edge of the coverage histogram")
        n = self.cov_hist.sum(-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            p = np.where(n > 0, self.cov_hist[..., idx:].sum(-1) / np.maximum(n, 1e-300),
                         np.nan)
            se = np.sqrt(p * (1 - p) / np.maximum(self.n_eff(), 1e-300))
        se = np.where(self._exact4(), 0.0, se)
        return p, np.where(n > 0, se, np.nan)

    def fail_share_range(self, tau: float) -> tuple[Any, Any]:
        """(share of eligible queries surely below ``tau``, share possibly below it) per
        [layer, q head, s, w], weighted (NaN: none). Equal when 1 - ``tau`` is an edge of
        the loss histogram; otherwise the bin holding 1 - tau counts only in the second."""
        edges = np.asarray(COVERAGE_LOSS_EDGES)
        edge = 1.0 - tau
        lo = int(np.searchsorted(edges, edge + 1e-9, side="right")) - 1  # edge <= 1 - tau
        hi = int(np.searchsorted(edges, edge - 1e-9, side="left"))  # edge >= 1 - tau
        lo, hi = max(lo, 0), min(hi, len(edges) - 1)
        n = self.cov_hist.sum(-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            sure = self.cov_hist[..., hi:].sum(-1) / np.maximum(n, 1e-300)
            maybe = self.cov_hist[..., lo:].sum(-1) / np.maximum(n, 1e-300)
        return np.where(n > 0, sure, np.nan), np.where(n > 0, maybe, np.nan)

    def per_head_means(self) -> dict[str, Any]:
        """All-query means (weighted): sink mass [L, Hq, S], entropy, max weight, top-k
        fraction, top-1 outside sinks + window [L, Hq, S, W], output norm."""
        qn = np.maximum(self.weight_sum, 1e-300)
        dn = np.where(self.detail_w > 0, self.detail_w, np.nan)
        return {
            "sink_mass": self.sink_sum / qn[..., None],
            "entropy": self.entropy_sum / dn,
            "max_weight": self.maxw_sum / qn,
            "topk_fraction": self.topk_frac_sum / dn,
            "top1_outside": self.top1_out / np.maximum(self.cov_w, 1e-300),
            "output_norm": self.out_norm_sum / np.where(self.out_norm_n > 0, self.out_norm_n,
                                                        np.nan),
        }

    def topk_quantile(self, q: float = 0.5) -> Any:
        """Upper bucket edge of the q quantile of top-k-for-gamma per [layer, q head]."""
        cum = np.cumsum(self.topk_hist, -1)
        n = cum[..., -1]
        idx = np.argmax(cum >= np.maximum(q * n, 1e-9)[..., None], axis=-1)
        return np.where(n > 0, np.asarray(self.k_edges, dtype=float)[idx], np.nan)

    # ------------------------------------------------------------------ merge / serialize
    def _check_compatible(self, other: HeadStatsAccumulator) -> None:
        same = (self.num_layers, self.num_kv_heads, self.group_size, self.sinks_grid,
                self.window_grid) == (other.num_layers, other.num_kv_heads, other.group_size,
                                      other.sinks_grid, other.window_grid)
        if not same:
            raise ValueError("cannot merge head statistics with different shapes or grids")

    _SUM_FIELDS = ("queries", "detail_n", "requests", "requests_seen", "sink_sum", "entropy_sum",
                   "entropy_hist", "maxw_sum", "topk_frac_sum", "topk_hist", "cov_n", "cov_sum",
                   "cov_hist", "top1_out", "out_norm_sum", "out_norm_n", "sink_hist", "sink_n",
                   "js_sum", "js_n", "js_far", "js_k", "weight_sum", "detail_w", "cov_w", "cov_w2",
                   "cov_sq")
    _PAIR_FIELDS = ("js_sum", "js_n", "js_far", "js_k")  # [layer, q head, q head]
    _RAW_FIELDS = ("queries", "detail_n", "requests", "requests_seen", "cov_n", "sink_n", "js_k")
    """Raw counts of sampled queries and requests: evidence, never reweighted."""
    _SQUARED_FIELDS = ("cov_w2",)
    """Sums of squared weights: scale by factor^2."""

    def scaled(self, factor: float) -> HeadStatsAccumulator:
        """A copy whose every weight is multiplied by ``factor`` (> 0): weighted sums and
        histograms x factor, sums of squared weights x factor^2, raw counts (``queries``,
        ``cov_n``, ``requests``, ...) and ``cov_min`` unchanged.

        Post-stratification to the traffic's distribution: merging strata each scaled by
        (traffic share / sampled share) gives means and shares weighted as the traffic is.
        A stratum's own estimates and effective sample size (sum w)^2 / sum w^2 do not
        change; a merge of strata at unequal factors has Kish's n_eff of the reweighted
        sample, (sum_b f_b W_b)^2 / sum_b f_b^2 W2_b, at most the unweighted one (the
        design effect of weighting), so standard errors stay honest. Never modifies ``self``.
        """
        f = float(factor)
        if not f > 0 or not np.isfinite(f):
            raise ValueError(f"scale factor must be positive and finite, not {factor!r}")
        out = self.empty_like()
        for name in self._SUM_FIELDS:
            a = getattr(self, name)
            if name in self._RAW_FIELDS:
                getattr(out, name)[...] = a
            elif name in self._SQUARED_FIELDS:
                getattr(out, name)[...] = a * (f * f)
            else:
                getattr(out, name)[...] = a * f
        out.cov_min[...] = self.cov_min
        out.exact[...] = self.exact  # still every query of its prompts, at one weight
        return out

    def merge(self, other: HeadStatsAccumulator) -> HeadStatsAccumulator:
        self._check_compatible(other)
        for f in self._SUM_FIELDS:
            getattr(self, f).__iadd__(getattr(other, f))
        self.cov_min = np.minimum(self.cov_min, other.cov_min)
        # a sum of an exact census and anything else is a census of neither: sampled again
        self.exact[...] = False
        return self

    _COV_FIELDS = ("cov_n", "cov_w", "cov_w2", "cov_sum", "cov_sq", "cov_min", "cov_hist",
                   "top1_out")
    """Per-(layer, q head, s, w) statistics behind window decisions: what :meth:`set_exact`
    replaces."""

    def set_exact(self, other: HeadStatsAccumulator, layers: Iterable[int]) -> None:
        """Replace the coverage statistics of every query head of ``layers`` by ``other``'s,
        which must hold every query of the same prompts at weight 1 (``update(...,
        sample=all)``), and mark those rows exact. Other statistics (entropy, sink mass,
        pairs) stay sampled."""
        self._check_compatible(other)
        ls = sorted({int(x) for x in layers})
        if any(not 0 <= x < self.num_layers for x in ls):
            raise ValueError(f"layers must be in 0..{self.num_layers - 1}")
        for f in self._COV_FIELDS:
            getattr(self, f)[ls] = getattr(other, f)[ls]
        self.exact[ls] = True

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe state; arrays are stored sparsely (most histogram bins are empty)."""
        arrays: dict[str, Any] = {}
        for f in (*self._SUM_FIELDS, "cov_min"):
            a = getattr(self, f)
            fill = 1.0 if f == "cov_min" else 0.0
            nz = np.flatnonzero(a != fill)
            arrays[f] = {"shape": list(a.shape), "index": _tolist(nz),
                         "value": _tolist(a.ravel()[nz])}
        return {
            "schema": _SCHEMA, "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads, "group_size": self.group_size,
            "sinks_grid": list(self.sinks_grid), "window_grid": list(self.window_grid),
            "n_last": self.n_last, "n_random": self.n_random, "n_detail": self.n_detail,
            "mass_gamma": self.mass_gamma,
            "coverage_loss_edges": list(COVERAGE_LOSS_EDGES), "arrays": arrays,
            "exact": np.flatnonzero(self.exact).tolist(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HeadStatsAccumulator:
        old = d.get("schema") == _OLD_SCHEMA
        if d.get("schema") != _SCHEMA and not old:
            raise ValueError(f"not {_SCHEMA} data")
        if list(d.get("coverage_loss_edges", [])) != list(COVERAGE_LOSS_EDGES):
            raise ValueError("coverage histogram edges differ from this version")
        acc = cls(int(d["num_layers"]), int(d["num_kv_heads"]), int(d["group_size"]),
                  d["sinks_grid"], d["window_grid"], n_last=int(d["n_last"]),
                  n_random=int(d["n_random"]), n_detail=int(d.get("n_detail", 2)),
                  mass_gamma=float(d["mass_gamma"]))
        for f, spec in d["arrays"].items():
            if f not in (*cls._SUM_FIELDS, "cov_min"):
                continue
            a = getattr(acc, f)
            if list(a.shape) != list(spec["shape"]):
                raise ValueError(f"head statistics field {f} has the wrong shape")
            flat = a.reshape(-1)
            flat[np.asarray(spec["index"], dtype=np.int64)] = np.asarray(spec["value"],
                                                                          dtype=np.float64)
        ex = np.asarray(d.get("exact") or [], dtype=np.int64)
        if ex.size and (ex.min() < 0 or ex.max() >= acc.exact.size):
            raise ValueError("head statistics exact rows out of range")
        acc.exact.reshape(-1)[ex] = True
        if old:  # unweighted sums: every sampled query had weight 1
            acc.weight_sum[...] = acc.queries
            acc.detail_w[...] = acc.detail_n
            acc.cov_w[...] = acc.cov_n
            acc.cov_w2[...] = acc.cov_n
            mid = 1.0 - (np.asarray(COVERAGE_LOSS_EDGES) + np.asarray(
                (*COVERAGE_LOSS_EDGES[1:], 1.0))) / 2  # C^2 from the histogram's bin middles
            acc.cov_sq[...] = (acc.cov_hist * mid ** 2).sum(-1)
        return acc

    # ------------------------------------------------------------------ deltas (live)
    def _meta(self) -> dict[str, Any]:
        return {"schema": _SCHEMA, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "group_size": self.group_size,
                "sinks_grid": list(self.sinks_grid), "window_grid": list(self.window_grid),
                "n_last": self.n_last, "n_random": self.n_random, "n_detail": self.n_detail,
                "mass_gamma": self.mass_gamma,
                "coverage_loss_edges": list(COVERAGE_LOSS_EDGES)}

    def take_bytes(self, pause: Callable[[], None] | None = None,
                   piece: int = TAKE_PIECE_ELEMENTS) -> bytes:
        """Everything gathered since the last take, as compact bytes (an ``.npz`` of the
        non-default entries: index + value per field), and restart from zero. A worker sends
        these deltas between model steps; the API server merges them (:meth:`add_at`). Not
        compressed: zlib would triple the time the engine waits, to save wire bytes on a
        local socket. ``b"".join`` of :meth:`take_chunks`."""
        return b"".join(self.take_chunks(pause, piece))

    def take_chunks(self, pause: Callable[[], None] | None = None,
                    piece: int = TAKE_PIECE_ELEMENTS) -> list[Any]:
        """:meth:`take_bytes`'s bytes as a list of buffers, never copied into one: the drain
        writes them to a file one by one (a 25 MB join or an in-memory file's growth would
        hold the GIL for milliseconds).

        The work goes in pieces of at most ``piece`` entries (scan, zeroing) or
        ``piece`` x 8 bytes (writing), with ``pause()`` between two pieces: the drain thread
        passes :func:`attnprof.aggregate.background.yield_gil`, so the engine's thread never
        waits long for the GIL. The bytes are those of ``np.savez`` whatever the pieces."""
        import json
        import zipfile

        def step() -> None:
            if pause is not None:
                pause()

        piece = max(1, int(piece))
        # (name, dtype, parts): each field is scanned and zeroed a piece at a time and
        # written a part at a time, never joined into one large array (a copy under the GIL)
        arrays: list[tuple[str, Any, list[Any]]] = [
            ("meta", np.dtype(np.uint8),
             [np.frombuffer(json.dumps(self._meta()).encode(), dtype=np.uint8)])]
        for f in (*self._SUM_FIELDS, "cov_min"):
            a = getattr(self, f)
            fill = 1.0 if f == "cov_min" else 0.0
            flat = a.reshape(-1)  # a view: the fields are contiguous
            idx: list[Any] = []
            val: list[Any] = []
            for i in range(0, flat.size, piece):
                part = flat[i:i + piece]
                nz = np.flatnonzero(part != fill)
                idx.append(nz + i)
                val.append(part[nz])
                part.fill(fill)
                step()
            arrays.append((f + ".i", np.dtype(np.uint32 if a.size < 1 << 32 else np.uint64),
                           idx))
            arrays.append((f + ".v", a.dtype, val))
        arrays.append(("exact.i", np.dtype(np.uint32),
                       [np.flatnonzero(self.exact).astype(np.uint32)]))
        self.exact.fill(False)
        # np.savez's own layout (stored, zip64 entries, a version-1.0 .npy header each),
        # each array's data written part by part instead of in 16 MiB copies.
        buf = _Pieces()
        step_bytes = piece * 8
        sink: Any = buf  # zipfile's stubs want a real file; it uses write/tell/seek/flush
        with zipfile.ZipFile(sink, mode="w", compression=zipfile.ZIP_STORED,
                             allowZip64=True) as zf:
            for name, dtype, parts in arrays:
                npy = np.lib.format
                header = npy.header_data_from_array_1_0(  # type: ignore[no-untyped-call]
                    np.empty(0, dtype))
                header["shape"] = (sum(len(x) for x in parts),)
                with zf.open(name + ".npy", "w", force_zip64=True) as fid:
                    npy.write_array_header_1_0(fid, header)  # type: ignore[no-untyped-call]
                    for x in parts:
                        data = memoryview(np.ascontiguousarray(x, dtype=dtype)).cast("B")
                        for i in range(0, len(data), step_bytes):
                            fid.write(data[i:i + step_bytes])
                            step()
        return buf.parts

    @classmethod
    def from_bytes(cls, data: bytes) -> HeadStatsAccumulator:
        """The accumulator :meth:`take_bytes` wrote (no pickle: arrays and a JSON header).
        Raises ``ValueError`` for anything else."""
        import io
        import json

        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                acc = cls.from_dict({**meta, "arrays": {}})
                for f in (*cls._SUM_FIELDS, "cov_min"):
                    if f + ".i" not in z.files:  # a field this delta's writer did not have
                        continue
                    flat = getattr(acc, f).reshape(-1)
                    flat[z[f + ".i"].astype(np.int64)] = z[f + ".v"]
                if "exact.i" in z.files:  # absent in deltas of earlier versions
                    acc.exact.reshape(-1)[z["exact.i"].astype(np.int64)] = True
        except (OSError, EOFError, KeyError, IndexError, TypeError, ValueError) as err:
            raise ValueError(f"not a head-statistics delta: {err!r}") from None
        return acc

    def add_at(self, other: HeadStatsAccumulator, q_offset: int = 0,
               count_requests: bool = True) -> HeadStatsAccumulator:
        """Merge ``other`` (one tensor-parallel rank's heads, or one pipeline stage's layers)
        into this global accumulator: its query heads go to ``q_offset ..``, its layers to
        the same global indices. Shapes and grids are checked, never broadcast. Requests are
        counted once per prompt, so ranks other than the first pass ``count_requests=False``."""
        if (self.sinks_grid, self.window_grid) != (other.sinks_grid, other.window_grid):
            raise ValueError("cannot merge head statistics with different grids")
        hq = other.num_q_heads
        if other.num_layers > self.num_layers or q_offset < 0 or q_offset + hq > self.num_q_heads:
            raise ValueError(f"head statistics of {other.num_layers} layers x {hq} heads at "
                             f"head {q_offset} do not fit {self.num_layers} x "
                             f"{self.num_q_heads}")
        lay, heads = slice(0, other.num_layers), slice(q_offset, q_offset + hq)
        for f in self._SUM_FIELDS:
            if f in ("requests", "requests_seen"):
                if count_requests:
                    getattr(self, f)[lay] += getattr(other, f)
                continue
            if f in self._PAIR_FIELDS:  # pairs across ranks stay unmeasured (count 0)
                getattr(self, f)[lay, heads, heads] += getattr(other, f)
                continue
            getattr(self, f)[lay, heads] += getattr(other, f)
        self.cov_min[lay, heads] = np.minimum(self.cov_min[lay, heads], other.cov_min)
        self.exact[lay, heads] = False  # merged: see merge
        return self

    @classmethod
    def for_config(cls, cfg: Any, **kw: Any) -> HeadStatsAccumulator:
        """Shape from a Hugging Face config (dict or object), read by
        :class:`attnprof.facts.shape.AttentionShape`."""
        from attnprof.facts.shape import AttentionShape

        shape = AttentionShape.from_config(cfg)
        return cls(shape.num_layers, shape.num_kv_heads, shape.group_size, **kw)

    def empty_like(self) -> HeadStatsAccumulator:
        """A zeroed accumulator with this one's shape, grids and sampling settings."""
        return type(self)(self.num_layers, self.num_kv_heads, self.group_size,
                          self.sinks_grid, self.window_grid, n_last=self.n_last,
                          n_random=self.n_random, n_detail=self.n_detail,
                          chunk_queries=self.chunk_queries, mass_gamma=self.mass_gamma,
                          seed=self.seed)

    def layers_with_data(self) -> Iterable[int]:
        return (i for i in range(self.num_layers) if self.queries[i].sum() > 0)

