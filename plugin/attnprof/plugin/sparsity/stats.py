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

Memory is O(layers * q_heads * |sinks| * |windows| * bins), independent of traffic; the
state merges across requests, processes and replicas (:meth:`merge`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "COVERAGE_LOSS_EDGES",
    "DEFAULT_SINKS_GRID",
    "DEFAULT_WINDOW_GRID",
    "HeadStatsAccumulator",
]

DEFAULT_SINKS_GRID = (0, 4, 16, 64, 128)
DEFAULT_WINDOW_GRID = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# Edges of 1 - C (mass outside sinks + window). 1 - tau for tau in {0.9, 0.95, 0.99} are
# edges, so "low quantile of C >= tau" is decided exactly from the histogram.
COVERAGE_LOSS_EDGES = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                       0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_ENTROPY_BINS = 20
_SCHEMA = "attnprof.head_stats/1"


def _kbins(max_k: int = 1 << 20) -> tuple[int, ...]:
    out, k = [], 1
    while k <= max_k:
        out.append(k)
        k *= 2
    return tuple(out)


class HeadStatsAccumulator:
    """Bounded, mergeable attention statistics per (layer, query head).

    Decisions are made per KV head by :mod:`attnprof.plugin.sparsity.classify` (a KV head's
    window is the max over the ``group_size`` query heads that share it).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, group_size: int,
                 sinks_grid: Sequence[int] = DEFAULT_SINKS_GRID,
                 window_grid: Sequence[int] = DEFAULT_WINDOW_GRID, *,
                 n_last: int = 64, n_random: int = 64, chunk_queries: int = 32,
                 mass_gamma: float = 0.9, seed: int = 0) -> None:
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
        self.chunk_queries = max(1, chunk_queries)
        self.mass_gamma = mass_gamma
        self.seed = seed
        self.k_edges = _kbins()
        lh = (num_layers, self.num_q_heads)
        sw = (len(self.sinks_grid), len(self.window_grid))
        self.queries = np.zeros(lh)
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

    # ------------------------------------------------------------------ updates
    def update(self, layer: int, q: Any, k: Any, scale: float, *, q_start: int | None = None,
               v: Any = None, softcap: float | None = None, sink_logits: Any = None,
               sample: Any = None) -> int:
        """Fold one request's attention at ``layer`` into the statistics.

        q: [Lq, Hq, D] queries (after RoPE) at positions q_start .. q_start+Lq-1 (default:
        the last Lq of the keys, i.e. a prefill or a decode step); k: [Lk, Hkv, D] all keys
        of the request so far, causal. v: [Lk, Hkv, Dv] optional (output norms).
        softcap: Gemma-2 style tanh cap on logits; sink_logits: [Hq] learned sink logits
        (gpt-oss), counted as sink mass. Returns the number of sampled queries.
        """
        import torch

        lq, hq, d = q.shape
        lk, hkv, _ = k.shape
        if hq != self.num_q_heads or hkv != self.num_kv_heads:
            raise ValueError(f"expected {self.num_q_heads} q / {self.num_kv_heads} kv heads, "
                             f"got {hq} / {hkv}")
        start = lk - lq if q_start is None else int(q_start)
        idx = self.sample_queries(lq, start) if sample is None else torch.as_tensor(sample)
        if idx.numel() == 0:
            return 0
        g = self.group_size
        sinks = torch.tensor(self.sinks_grid, dtype=torch.long)
        wins = torch.tensor(self.window_grid, dtype=torch.long)
        with torch.no_grad():
            for c0 in range(0, idx.numel(), self.chunk_queries):
                ci = idx[c0:c0 + self.chunk_queries]
                pos = ci + start  # absolute positions, [c]
                n = int(pos.max()) + 1
                qc = q[ci].float().view(-1, hkv, g, d)
                kc = k[:n].float()
                logits = torch.einsum("chgd,nhd->chgn", qc, kc).reshape(-1, hq, n) * scale
                if softcap:
                    logits = torch.tanh(logits / softcap) * softcap
                keys = torch.arange(n)
                logits.masked_fill_((keys[None, :] > pos[:, None])[:, None, :], float("-inf"))
                if sink_logits is not None:
                    sl = torch.as_tensor(sink_logits).float().view(1, hq, 1).expand(len(ci),
                                                                                  hq, 1)
                    p = torch.softmax(torch.cat([logits, sl], -1), -1)
                    learned, p = p[..., -1], p[..., :-1]
                else:
                    learned = None
                    p = torch.softmax(logits, -1)
                self._fold(layer, p, pos, learned, sinks, wins,
                           None if v is None else v[:n])
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

    def _fold(self, layer: int, p: Any, pos: Any, learned: Any, sinks: Any, wins: Any,
              v: Any) -> None:
        import torch

        c, hq, n = p.shape
        cs = p.cumsum(-1)  # [c, hq, n]
        total = cs[..., -1]
        nseen = (pos + 1).float()  # keys seen by each query under full attention
        # sink mass per s (s = 0 -> 0); learned sinks (gpt-oss) add their mass to every s > 0
        sidx = (sinks - 1).clamp(min=0)[None, None, :].expand(c, hq, -1)
        sink_m = torch.gather(cs, 2, sidx.clamp(max=n - 1))
        sink_m = torch.where((sinks == 0)[None, None, :], torch.zeros_like(sink_m), sink_m)
        # keys beyond a query's position have p == 0, so cs at index >= pos equals total
        if learned is not None:
            sink_m = sink_m + torch.where((sinks > 0)[None, None, :], learned[..., None], 0.0)
        # local mass of the last w keys as a suffix sum from key pos - w + 1 (keys after pos
        # have p == 0); a suffix sum keeps small local masses precise, total - prefix would not
        rs = p.flip(-1).cumsum(-1).flip(-1)
        first = (pos[:, None] - wins[None, :] + 1).clamp(min=0)  # [c, W]
        local = torch.gather(rs, 2, first[:, None, :].expand(c, hq, -1))  # [c, hq, W]
        cov = (local[:, :, None, :] + sink_m[..., None]).clamp(max=1.0)  # [c, hq, S, W]
        elig = (nseen[:, None, None] > (sinks[:, None] + wins[None, :])[None])  # [c, S, W]
        top1 = p.argmax(-1)  # [c, hq]
        out = ((top1[..., None, None] >= sinks[None, None, :, None])
               & (top1[..., None, None] <= (pos[:, None, None, None] - wins[None, None, None, :])))
        ent = -torch.special.xlogy(p, p).sum(-1)
        ent_n = torch.where(nseen[:, None] > 1, ent / torch.log(nseen.clamp(min=2))[:, None],
                            torch.zeros_like(ent))
        srt = torch.sort(p, dim=-1, descending=True).values.cumsum(-1)
        topk = (srt < self.mass_gamma * total[..., None]).sum(-1) + 1  # [c, hq]

        e = elig[:, None].expand(c, hq, *elig.shape[1:]).double().numpy()
        covn = cov.double().numpy()
        L = layer
        self.queries[L] += c
        self.sink_sum[L] += sink_m.double().sum(0).numpy()
        entn = ent_n.double().numpy()
        self.entropy_sum[L] += entn.sum(0)
        eb = np.clip((entn * _ENTROPY_BINS).astype(np.int64), 0, _ENTROPY_BINS - 1)
        for h in range(hq):
            self.entropy_hist[L, h] += np.bincount(eb[:, h], minlength=_ENTROPY_BINS)
        self.maxw_sum[L] += p.max(-1).values.double().sum(0).numpy()
        tk = topk.numpy()
        self.topk_frac_sum[L] += (tk / nseen.numpy()[:, None]).sum(0)
        kb = np.clip(np.searchsorted(self.k_edges, tk, side="left"), 0, len(self.k_edges) - 1)
        for h in range(hq):
            self.topk_hist[L, h] += np.bincount(kb[:, h], minlength=len(self.k_edges))
        self.cov_n[L] += e.sum(0)
        self.cov_sum[L] += (covn * e).sum(0)
        self.cov_min[L] = np.minimum(self.cov_min[L], np.where(e > 0, covn, 1.0).min(0))
        self.top1_out[L] += (out.double().numpy() * e).sum(0)
        nb = len(COVERAGE_LOSS_EDGES)
        cb = np.clip(np.searchsorted(COVERAGE_LOSS_EDGES, 1.0 - covn, side="right") - 1, 0,
                     nb - 1)
        # one-hot add per eligible (query, head, s, w): bounded by the sample size
        flat = (cb + nb * np.arange(cb[0].size).reshape(cb.shape[1:])[None]).ravel()
        counts = np.bincount(flat, weights=e.ravel(), minlength=cb[0].size * nb)
        self.cov_hist[L] += counts.reshape(*cb.shape[1:], nb)
        if v is not None:
            vg = v.float()  # [n, hkv, dv]
            g = self.group_size
            o = torch.einsum("chgn,nhd->chgd", p.view(c, self.num_kv_heads, g, n), vg)
            self.out_norm_sum[L] += o.reshape(c, hq, -1).norm(dim=-1).double().sum(0).numpy()
            self.out_norm_n[L] += c

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
        return {
            "sink_mass": self.sink_sum / qn[..., None],
            "entropy": self.entropy_sum / qn,
            "max_weight": self.maxw_sum / qn,
            "topk_fraction": self.topk_frac_sum / qn,
            "top1_outside": self.top1_out / np.maximum(self.cov_n, 1),
            "output_norm": np.where(self.out_norm_n > 0,
                                    self.out_norm_sum / np.maximum(self.out_norm_n, 1), np.nan),
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

    _SUM_FIELDS = ("queries", "requests", "sink_sum", "entropy_sum", "entropy_hist",
                   "maxw_sum", "topk_frac_sum", "topk_hist", "cov_n", "cov_sum", "cov_hist",
                   "top1_out", "out_norm_sum", "out_norm_n")

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
            "n_last": self.n_last, "n_random": self.n_random, "mass_gamma": self.mass_gamma,
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
                  n_random=int(d["n_random"]), mass_gamma=float(d["mass_gamma"]))
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

    @classmethod
    def for_config(cls, cfg: Mapping[str, Any], **kw: Any) -> HeadStatsAccumulator:
        """Shape from a Hugging Face config dict."""
        c = dict(cfg.get("text_config") or cfg)
        hq = int(c["num_attention_heads"])
        hkv = int(c.get("num_key_value_heads") or hq)
        return cls(int(c["num_hidden_layers"]), hkv, hq // hkv, **kw)

    def layers_with_data(self) -> Iterable[int]:
        return (i for i in range(self.num_layers) if self.queries[i].sum() > 0)

