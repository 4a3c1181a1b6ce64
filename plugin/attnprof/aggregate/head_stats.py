"""Per-(layer, head) attention statistics on sampled queries, in bounded memory.

Fused attention kernels return no probabilities, so for a bounded sample of queries (the
last ``n_last`` of the prompt plus ``n_random`` stratified random positions, as MInference
and FlexPrefill estimate patterns) we recompute the softmax row against all causal keys in
fp32, in chunks of ``chunk_queries`` queries, and fold it into fixed-size arrays:

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
import math
from collections.abc import Iterable, Mapping, Sequence
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
_ENTROPY_BINS = 20
_BLOCK = 32  # keys per block for range sums
_SCHEMA = "attnprof.head_stats/1"


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
                 n_last: int = 32, n_random: int = 32, n_detail: int = 2,
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
        self.queries = np.zeros(lh)
        self.detail_n = np.zeros(lh)
        self.requests = np.zeros(num_layers)
        self.sink_sum = np.zeros((*lh, len(self.sinks_grid)))
        self.entropy_sum = np.zeros(lh)
        self.entropy_hist = np.zeros((*lh, _ENTROPY_BINS))
        self.maxw_sum = np.zeros(lh)
        self.topk_frac_sum = np.zeros(lh)
        self.topk_hist = np.zeros((*lh, len(self.k_edges)))
        self.cov_n = np.zeros((*lh, *sw))
        self.cov_sum = np.zeros((*lh, *sw))
        self.cov_min = np.ones((*lh, *sw))
        self.cov_hist = np.zeros((*lh, *sw, len(COVERAGE_LOSS_EDGES)))
        self.top1_out = np.zeros((*lh, *sw))
        self.out_norm_sum = np.zeros(lh)
        self.out_norm_n = np.zeros(lh)
        # underused heads: sink-mass histogram per sinks grid value, pairwise JS per layer
        self.sink_hist = np.zeros((*lh, len(self.sinks_grid), len(SINK_MASS_EDGES)))
        self.sink_n = np.zeros((*lh, len(self.sinks_grid)))  # eligible queries (raw count)
        hh = (num_layers, self.num_q_heads, self.num_q_heads)
        self.js_sum = np.zeros(hh)  # weighted, like js_n and js_far
        self.js_n = np.zeros(hh)
        self.js_far = np.zeros(hh)
        self.js_k = np.zeros(hh)  # detail queries per pair (raw count)

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group_size

    # ------------------------------------------------------------------ sampling
    def sample_queries(self, num_queries: int, q_start: int) -> Any:
        """Indices into the request's queries: the last ``n_last`` plus ``n_random``
        stratified random ones among the rest. Deterministic per (seed, length, start) so
        every layer of one request samples the same positions."""
        import torch

        n = num_queries
        last = list(range(max(0, n - self.n_last), n))
        rest = n - len(last)
        picked: list[int] = []
        if rest > 0 and self.n_random > 0:
            k = min(self.n_random, rest)
            h = hashlib.blake2b(f"{self.seed}:{n}:{q_start}".encode(), digest_size=8)
            gen = torch.Generator().manual_seed(int.from_bytes(h.digest(), "little") >> 1)
            # one uniform draw inside each of k integer strata of [0, rest) (none empty)
            bounds = torch.linspace(0, rest, k + 1).round().long()
            widths = bounds[1:] - bounds[:-1]
            u = torch.rand(k, generator=gen)
            picked = (bounds[:-1] + (u * widths).floor().long()).tolist()
        return torch.tensor(picked + last, dtype=torch.long)

    def detail_subset(self, num_sampled: int) -> list[int]:
        """Positions (in the sorted sample) that also get entropy, top-k and output norms:
        ``n_detail`` evenly spread ones, always including the last query."""
        nd = min(self.n_detail, num_sampled)
        if nd <= 0:
            return []
        if nd == 1:
            return [num_sampled - 1]
        return sorted({round(i * (num_sampled - 1) / (nd - 1)) for i in range(nd)})

    # ------------------------------------------------------------------ updates
    def update(self, layer: int, q: Any, k: Any, scale: float, *, q_start: int | None = None,
               v: Any = None, softcap: float | None = None, sink_logits: Any = None,
               sample: Any = None) -> int:
        """Fold one request's attention at ``layer`` into the statistics.

        q: [Lq, Hq, D] queries (after RoPE) at positions q_start .. q_start+Lq-1 (default:
        the last Lq of the keys, i.e. a prefill or a decode step); k: [Lk, Hkv, D] all keys
        of the request so far, causal. v: [Lk, Hkv, Dv] optional (output norms).
        softcap: Gemma-2 style tanh cap on logits; sink_logits: [Hq] learned sink logits
        (gpt-oss), counted as sink mass. ``sample``: explicit query indices (default
        :meth:`sample_queries`). Returns the number of sampled queries.
        """
        import torch

        lq, hq, _ = q.shape
        lk, hkv, _ = k.shape
        if hq != self.num_q_heads or hkv != self.num_kv_heads:
            raise ValueError(f"expected {self.num_q_heads} q / {self.num_kv_heads} kv heads, "
                             f"got {hq} / {hkv}")
        start = lk - lq if q_start is None else int(q_start)
        idx = (self.sample_queries(lq, start) if sample is None
               else torch.as_tensor(sample).cpu())
        if idx.numel() == 0:
            return 0
        idx = idx.sort().values
        detail = set(self.detail_subset(idx.numel()))
        with torch.no_grad():
            kh = k.float().permute(1, 2, 0)  # [hkv, d, Lk]
            for c0 in range(0, idx.numel(), self.chunk_queries):
                ci = idx[c0:c0 + self.chunk_queries]
                det = [i - c0 for i in range(c0, c0 + len(ci)) if i in detail]
                self._chunk(layer, q, kh, v, ci, start, scale, softcap, sink_logits, det)
        self.requests[layer] += 1
        return int(idx.numel())

    def update_hf(self, layer: int, q: Any, k: Any, scale: float, *,
                  v: Any = None, **kw: Any) -> int:
        """Same as :meth:`update` for the transformers layout q [B, Hq, L, D], k/v
        [B, Hkv, L, D] (each batch row is one request; no padding)."""
        n = 0
        for b in range(q.shape[0]):
            n += self.update(layer, q[b].transpose(0, 1), k[b].transpose(0, 1), scale,
                             v=None if v is None else v[b].transpose(0, 1), **kw)
        return n

    def _chunk(self, layer: int, q: Any, kh: Any, v: Any, ci: Any, start: int, scale: float,
               softcap: float | None, sink_logits: Any, det: list[int]) -> None:
        """One chunk of sampled queries. Rows are laid out [hkv, c*g] as bmm produces them,
        so the [rows, keys] matrix is written once and read a handful of times (mask tail,
        max, exp, block sums); no sort or cumsum over all keys."""
        import torch

        c = len(ci)
        hkv, g = self.num_kv_heads, self.group_size
        hq = hkv * g
        pos = ci + start
        pos_l = pos.tolist()
        n = pos_l[-1] + 1
        # scale folded into q: one pass over [rows, keys] fewer
        qh = (q[ci].float() * scale).view(c, hkv, g, -1).permute(1, 0, 2, 3).reshape(
            hkv, c * g, -1)
        x = torch.bmm(qh, kh[:, :, :n])  # [hkv, c*g, n] logits
        dev = x.device  # CUDA in a GPU worker: keep index tensors there, results to numpy
        if softcap:
            x.div_(softcap).tanh_().mul_(softcap)
        lo = pos_l[0] + 1
        rowpos = pos.repeat_interleave(g).to(dev)  # row r belongs to query r // g
        if lo < n:  # causal mask; a finite fill keeps 0 * fill == 0 below
            keys = torch.arange(lo, n, device=dev)
            x[:, :, lo:].masked_fill_(keys[None, None, :] > rowpos[None, :, None], -1e30)
        m, top1 = x.max(-1)  # [hkv, c*g]
        x.sub_(m[..., None]).exp_()  # unnormalized weights e, max 1
        # Block sums (one pass) and their suffix sums in float64 give the mass of any key
        # range [a, n) as suffix-of-blocks + a partial block: summed directly, never as
        # total - prefix, so small local masses stay precise.
        bs = _BLOCK
        nb = n // bs
        blocks = torch.empty(hkv, c * g, nb + 2, dtype=torch.float64, device=dev)
        blocks[..., :nb] = x[..., :nb * bs].reshape(hkv, c * g, nb, bs).sum(-1)
        blocks[..., nb] = x[..., nb * bs:].sum(-1)
        blocks[..., nb + 1] = 0.0
        suffix = blocks.flip(-1).cumsum(-1).flip(-1)  # suffix[b] = sum of blocks b..
        z = suffix[..., 0]
        wins_t = torch.tensor(self.window_grid, device=dev)
        first = (rowpos[:, None] - wins_t[None, :] + 1).clamp(min=0)  # [rows, W] window start
        fb = first // bs
        t = torch.arange(bs, device=dev)
        cols = fb[..., None] * bs + t  # [rows, W, bs] the rest of the start's block
        ok = (cols >= first[..., None]) & (cols < n)
        part = torch.gather(x, 2, cols.clamp(max=n - 1).reshape(1, c * g, -1)
                            .expand(hkv, -1, -1)).reshape(hkv, c * g, len(self.window_grid),
                                                          bs)
        part = (part * ok[None]).sum(-1).double()
        local = torch.gather(suffix, 2, (fb + 1).clamp(max=nb + 1)[None].expand(hkv, -1, -1))
        local = local + part  # [hkv, rows, W]
        smax = max(self.sinks_grid)
        pre = x[:, :, :max(1, smax)].double().cumsum(-1)
        sink_idx = torch.tensor([max(0, s - 1) for s in self.sinks_grid],
                                device=dev).clamp(max=n - 1)
        has = torch.tensor([s > 0 for s in self.sinks_grid], dtype=torch.float64, device=dev)
        sink_m = pre[:, :, sink_idx] * has
        learned = None
        if sink_logits is not None:
            sl = torch.as_tensor(sink_logits).to(dev).float().view(hkv, 1, g).expand(hkv, c, g)
            extra = torch.exp(sl.reshape(hkv, c * g) - m).double()
            z = z + extra
            learned = extra / z
        zz = z[..., None]
        local = local / zz
        sink_m = sink_m / zz
        if learned is not None:
            sink_m = sink_m + learned[..., None] * has

        def rows_to_ch(t: Any) -> Any:  # [hkv, c*g, ...] -> [c, hq, ...] as float64 numpy
            t = t.reshape(hkv, c, g, *t.shape[2:]).transpose(0, 1).reshape(c, hq, *t.shape[2:])
            return t.double().cpu().numpy()

        self._fold(layer, pos, rows_to_ch(sink_m), rows_to_ch(local), rows_to_ch(top1),
                   rows_to_ch(1.0 / z))
        self._fold_sinks(layer, pos, rows_to_ch(sink_m))
        if det:
            self._detail(layer, x, z.float(), pos_l, det, v, c)

    def _fold(self, layer: int, pos: Any, sink_m: Any, local: Any, top1: Any, maxw: Any
              ) -> None:
        c = top1.shape[0]
        sinks = np.asarray(self.sinks_grid)
        wins = np.asarray(self.window_grid)
        posn = pos.numpy()
        nseen = posn + 1.0
        cov = np.minimum(local[:, :, None, :] + sink_m[..., None], 1.0)  # [c, hq, S, W]
        elig = nseen[:, None, None] > (sinks[:, None] + wins[None, :])[None]  # [c, S, W]
        e = np.broadcast_to(elig[:, None], cov.shape).astype(np.float64)
        out = ((top1[..., None, None] >= sinks[None, None, :, None])
               & (top1[..., None, None] <= (posn[:, None, None, None] - wins[None, None, None, :])))
        L = layer
        self.queries[L] += c
        self.sink_sum[L] += sink_m.sum(0)
        self.maxw_sum[L] += maxw.sum(0)
        self.cov_n[L] += e.sum(0)
        self.cov_sum[L] += (cov * e).sum(0)
        self.cov_min[L] = np.minimum(self.cov_min[L], np.where(e > 0, cov, 1.0).min(0))
        self.top1_out[L] += (out * e).sum(0)
        nb = len(COVERAGE_LOSS_EDGES)
        cb = np.clip(np.searchsorted(COVERAGE_LOSS_EDGES, 1.0 - cov, side="right") - 1, 0,
                     nb - 1)
        # one-hot add per eligible (query, head, s, w): bounded by the sample size
        flat = (cb + nb * np.arange(cb[0].size).reshape(cb.shape[1:])[None]).ravel()
        counts = np.bincount(flat, weights=e.ravel(), minlength=cb[0].size * nb)
        self.cov_hist[L] += counts.reshape(*cb.shape[1:], nb)

    def _detail(self, layer: int, x: Any, z: Any, pos_l: list[int], det: list[int], v: Any,
                c: int) -> None:
        """Entropy, top-k for ``mass_gamma`` and output norm on a few queries (sorting whole
        rows is the costliest part, so it runs on ``n_detail`` queries per request)."""
        import torch

        hkv, g = self.num_kv_heads, self.group_size
        hq = hkv * g
        L = layer
        for qi in det:
            p_ = pos_l[qi]
            n = p_ + 1
            rows = slice(qi * g, (qi + 1) * g)
            p = (x[:, rows, :n] / z[:, rows, None]).reshape(hq, n)  # [hq, n] (kv-major)
            ent = -torch.special.xlogy(p, p).sum(-1)
            ent_n = (ent / math.log(n) if n > 1 else torch.zeros_like(ent)).double().cpu().numpy()
            srt = torch.sort(p, dim=-1, descending=True).values.cumsum(-1)
            tk = ((srt < self.mass_gamma * srt[:, -1:]).sum(-1) + 1).cpu().numpy()
            self.detail_n[L] += 1
            self.entropy_sum[L] += ent_n
            eb = np.clip((ent_n * _ENTROPY_BINS).astype(np.int64), 0, _ENTROPY_BINS - 1)
            self.entropy_hist[L, np.arange(hq), eb] += 1
            self.topk_frac_sum[L] += tk / n
            kb = np.clip(np.searchsorted(self.k_edges, tk, side="left"), 0,
                         len(self.k_edges) - 1)
            self.topk_hist[L, np.arange(hq), kb] += 1
            self._pair_js(L, p)
            if v is not None:
                o = torch.einsum("hgn,nhd->hgd", p.view(hkv, g, n), v[:n].float())
                self.out_norm_sum[L] += o.reshape(hq, -1).norm(dim=-1).double().cpu().numpy()
                self.out_norm_n[L] += 1

    def _fold_sinks(self, layer: int, pos: Any, sink_m: Any, weight: Any = None) -> None:
        """Histogram of each sampled query's sink mass per [q head, s] (``sink_m``: [c, hq,
        S]); only queries that see >= ``DORMANT_MIN_SEEN`` * s keys count at s. ``weight``:
        per-query weights [c] (default 1 each)."""
        posn = np.asarray(pos.numpy() if hasattr(pos, "numpy") else pos, dtype=np.float64)
        w = np.ones(len(posn)) if weight is None else np.asarray(weight, dtype=np.float64)
        sinks = np.asarray(self.sinks_grid)
        elig = ((posn[:, None] + 1) >= DORMANT_MIN_SEEN * sinks[None, :]) & (sinks[None, :] > 0)
        ew = elig * w[:, None]  # [c, S]
        nb = len(SINK_MASS_EDGES)
        b = np.clip(np.searchsorted(SINK_MASS_EDGES, sink_m, side="right") - 1, 0, nb - 1)
        onehot = b[..., None] == np.arange(nb)  # [c, hq, S, E]
        self.sink_hist[layer] += (onehot * ew[:, None, :, None]).sum(0)
        self.sink_n[layer] += elig.sum(0)[None, :]

    def _pair_js(self, layer: int, p: Any, weight: float = 1.0) -> None:
        """Jensen-Shannon distance (base 2) between every pair of query heads' rows ``p``
        [hq, n] of one detail query, upper triangle only. Summed term by term
        (p log 2p/(p+q)) so identical rows give exactly 0; cost O(hq^2 n)."""
        import torch

        hq = p.shape[0]
        if hq < 2:
            return
        out = np.zeros((hq, hq))
        for a in range(hq - 1):
            pa, pb = p[a:a + 1], p[a + 1:]
            m = (pa + pb).clamp(min=1e-38)
            js = 0.5 * (torch.xlogy(pa, 2 * pa / m) + torch.xlogy(pb, 2 * pb / m)).sum(-1)
            out[a, a + 1:] = (js.clamp(min=0) / math.log(2)).clamp(max=1).sqrt() \
                .double().cpu().numpy()
        iu = np.triu_indices(hq, 1)
        self.js_sum[layer][iu] += weight * out[iu]
        self.js_n[layer][iu] += weight
        self.js_far[layer][iu] += weight * (out[iu] > JS_FAR)
        self.js_k[layer][iu] += 1

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
    def coverage_quantile(self, q: float = 0.05) -> Any:
        """Conservative low quantile of C(s, w) per [layer, q head, s, w] (NaN: no evidence).

        Walks the 1 - C histogram from its top; the bin holding the (1-q) quantile of 1 - C
        gives C's q quantile as 1 - its upper edge (never overstated).
        """
        hist = self.cov_hist
        n = hist.sum(-1)
        from_top = np.cumsum(hist[..., ::-1], axis=-1)
        # first bin from the top where the count from the top exceeds q * n
        k = np.argmax(from_top > (q * n)[..., None], axis=-1)
        bin_idx = hist.shape[-1] - 1 - k
        upper = np.asarray((*COVERAGE_LOSS_EDGES[1:], 1.0))[bin_idx]
        # a value of exactly 0 loss sits in bin 0 whose upper edge is 0.001: treat as exact
        upper = np.where(bin_idx == 0, np.minimum(upper, 1 - np.minimum(self.cov_min, 1.0)),
                         upper)
        out = 1.0 - upper
        return np.where(n > 0, out, np.nan)

    def coverage_mean(self) -> Any:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.cov_n > 0, self.cov_sum / np.maximum(self.cov_n, 1), np.nan)

    def per_head_means(self) -> dict[str, Any]:
        qn = np.maximum(self.queries, 1)
        dn = np.where(self.detail_n > 0, self.detail_n, np.nan)
        return {
            "sink_mass": self.sink_sum / qn[..., None],
            "entropy": self.entropy_sum / dn,
            "max_weight": self.maxw_sum / qn,
            "topk_fraction": self.topk_frac_sum / dn,
            "top1_outside": self.top1_out / np.maximum(self.cov_n, 1),
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

    _SUM_FIELDS = ("queries", "detail_n", "requests", "sink_sum", "entropy_sum", "entropy_hist",
                   "maxw_sum", "topk_frac_sum", "topk_hist", "cov_n", "cov_sum", "cov_hist",
                   "top1_out", "out_norm_sum", "out_norm_n", "sink_hist", "sink_n", "js_sum",
                   "js_n", "js_far", "js_k")
    _PAIR_FIELDS = ("js_sum", "js_n", "js_far", "js_k")  # [layer, q head, q head]

    def merge(self, other: HeadStatsAccumulator) -> HeadStatsAccumulator:
        self._check_compatible(other)
        for f in self._SUM_FIELDS:
            getattr(self, f).__iadd__(getattr(other, f))
        self.cov_min = np.minimum(self.cov_min, other.cov_min)
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe state; arrays are stored sparsely (most histogram bins are empty)."""
        arrays: dict[str, Any] = {}
        for f in (*self._SUM_FIELDS, "cov_min"):
            a = getattr(self, f)
            fill = 1.0 if f == "cov_min" else 0.0
            nz = np.flatnonzero(a != fill)
            arrays[f] = {"shape": list(a.shape), "index": nz.tolist(),
                         "value": [float(x) for x in a.ravel()[nz]]}
        return {
            "schema": _SCHEMA, "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads, "group_size": self.group_size,
            "sinks_grid": list(self.sinks_grid), "window_grid": list(self.window_grid),
            "n_last": self.n_last, "n_random": self.n_random, "n_detail": self.n_detail,
            "mass_gamma": self.mass_gamma,
            "coverage_loss_edges": list(COVERAGE_LOSS_EDGES), "arrays": arrays,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HeadStatsAccumulator:
        if d.get("schema") != _SCHEMA:
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
        return acc

    # ------------------------------------------------------------------ deltas (live)
    def _meta(self) -> dict[str, Any]:
        return {"schema": _SCHEMA, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "group_size": self.group_size,
                "sinks_grid": list(self.sinks_grid), "window_grid": list(self.window_grid),
                "n_last": self.n_last, "n_random": self.n_random, "n_detail": self.n_detail,
                "mass_gamma": self.mass_gamma,
                "coverage_loss_edges": list(COVERAGE_LOSS_EDGES)}

    def take_bytes(self) -> bytes:
        """Everything gathered since the last take, as compact bytes (an ``.npz`` of the
        non-default entries: index + value per field), and restart from zero. A worker sends
        these deltas between model steps; the API server merges them (:meth:`add_at`). Not
        compressed: zlib would triple the time the engine waits, to save wire bytes on a
        local socket."""
        import io
        import json

        arrays: dict[str, Any] = {"meta": np.frombuffer(json.dumps(self._meta()).encode(),
                                                        dtype=np.uint8)}
        for f in (*self._SUM_FIELDS, "cov_min"):
            a = getattr(self, f)
            fill = 1.0 if f == "cov_min" else 0.0
            nz = np.flatnonzero(a != fill)
            arrays[f + ".i"] = nz.astype(np.uint32 if a.size < 1 << 32 else np.uint64)
            arrays[f + ".v"] = a.ravel()[nz]
            a.fill(fill)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

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
                    flat = getattr(acc, f).reshape(-1)
                    flat[z[f + ".i"].astype(np.int64)] = z[f + ".v"]
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
            if f == "requests":
                if count_requests:
                    self.requests[lay] += other.requests
                continue
            if f in self._PAIR_FIELDS:  # pairs across ranks stay unmeasured (count 0)
                getattr(self, f)[lay, heads, heads] += getattr(other, f)
                continue
            getattr(self, f)[lay, heads] += getattr(other, f)
        self.cov_min[lay, heads] = np.minimum(self.cov_min[lay, heads], other.cov_min)
        return self

    @classmethod
    def for_config(cls, cfg: Any, **kw: Any) -> HeadStatsAccumulator:
        """Shape from a Hugging Face config (dict or object), read by
        :class:`attnprof.facts.shape.AttentionShape`."""
        from attnprof.facts.shape import AttentionShape

        shape = AttentionShape.from_config(cfg)
        return cls(shape.num_layers, shape.num_kv_heads, shape.group_size, **kw)

    def layers_with_data(self) -> Iterable[int]:
        return (i for i in range(self.num_layers) if self.queries[i].sum() > 0)

