"""The torch side of the head statistics: softmax rows of sampled queries, recomputed.

Fused attention kernels return no probabilities, so for the queries
:meth:`HeadStatsAccumulator.sample_plan` picks, the rows are recomputed here against all
causal keys in fp32, ``acc.chunk_queries`` queries at a time, on the tensors' own device. What
leaves this module are per-query numbers as numpy arrays (sink and local masses, top-1
positions, entropies, top-k, pairwise Jensen-Shannon distances, output norms), folded by the
accumulator (:mod:`attnprof.aggregate.head_stats`, pure numpy). Imports torch lazily.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attnprof.aggregate.head_stats import JS_CHUNK_ELEMENTS, HeadStatsAccumulator

__all__ = ["SCRATCH_ELEMENTS", "fold_plan", "pair_js", "sample_queries", "update", "update_hf",
           "update_span"]

_BLOCK = 32  # keys per block for range sums
SCRATCH_ELEMENTS = 1 << 24
"""Most logits (queries x heads x keys) one tile of recomputed rows holds: 64 MiB of fp32,
with a few same-sized temporaries (exp, mask) alongside; long contexts get smaller tiles."""


def sample_queries(acc: HeadStatsAccumulator, num_queries: int, q_start: int) -> Any:
    """Indices of :meth:`HeadStatsAccumulator.sample_plan` as a torch tensor (sorted)."""
    import torch

    return torch.as_tensor(acc.sample_plan(num_queries, q_start)[0], dtype=torch.long)


def update(acc: HeadStatsAccumulator, layer: int, q: Any, k: Any, scale: float, *,
           q_start: int | None = None, v: Any = None, softcap: float | None = None,
           sink_logits: Any = None, sample: Any = None) -> int:
    """Fold one request's attention at ``layer`` into ``acc``.

    q: [Lq, Hq, D] queries (after RoPE) at positions q_start .. q_start+Lq-1 (default:
    the last Lq of the keys, i.e. a prefill or a decode step); k: [Lk, Hkv, D] all keys
    of the request so far, causal. v: [Lk, Hkv, Dv] optional (output norms).
    softcap: Gemma-2 style tanh cap on logits; sink_logits: [Hq] learned sink logits
    (gpt-oss), counted as sink mass. ``sample``: explicit query indices, each of weight
    1 (default :meth:`HeadStatsAccumulator.sample_plan`, weighted). Returns the number of
    sampled queries; raises ``ValueError`` when the head counts do not match ``acc``.
    """
    lq = q.shape[0]
    lk = k.shape[0]
    start = lk - lq if q_start is None else int(q_start)
    if sample is None:
        idx_np, wts = acc.sample_plan(lq, start)
    else:
        import torch

        idx_np = np.unique(torch.as_tensor(sample).cpu().numpy().astype(np.int64))
        wts = np.ones(len(idx_np))
    if len(idx_np) == 0:
        return 0
    detail = dict(acc.detail_subset(len(idx_np), wts, start))
    return fold_plan(acc, layer, q, k, scale, start, idx_np, wts, detail, v=v,
                     softcap=softcap, sink_logits=sink_logits)


def update_span(acc: HeadStatsAccumulator, layer: int, q: Any, k: Any, scale: float, *,
                prompt_len: int, q_start: int, v: Any = None, softcap: float | None = None,
                sink_logits: Any = None) -> int:
    """Fold one piece of a prompt (a chunk, or the uncached tail after a prefix-cache hit):
    ``q`` [Lq, Hq, D] the queries at prompt positions ``q_start`` .. ``q_start + Lq - 1``,
    ``k`` [>= q_start + Lq, Hkv, D] the prompt's keys from position 0 (earlier ones read from
    the paged cache; or a function of n giving the first n keys: see :func:`fold_plan`). The
    sample is the **whole prompt's** (:meth:`sample_plan` over ``prompt_len``, and its detail
    subset), restricted to this piece's positions, so the pieces of a prompt served in chunks
    fold exactly the queries, weights and detail queries the prompt served whole would. The
    request counts ``Lq / prompt_len``: once over all its pieces, partly when positions were
    never computed (a prefix-cache hit's cached head)."""
    lq = int(q.shape[0])
    idx, wts, detail = _whole_plan(acc, int(prompt_len))
    keep = np.flatnonzero((idx >= q_start) & (idx < q_start + lq))
    local = {int(j): detail[int(i)] for j, i in enumerate(keep) if int(i) in detail}
    return fold_plan(acc, layer, q, k, scale, q_start, idx[keep] - q_start, wts[keep], local,
                     v=v, softcap=softcap, sink_logits=sink_logits,
                     request_share=lq / max(1, prompt_len))


_PLANS: dict[tuple[Any, ...], tuple[Any, Any, dict[int, float]]] = {}
_PLANS_MAX = 64


def _whole_plan(acc: HeadStatsAccumulator, prompt_len: int
                ) -> tuple[Any, Any, dict[int, float]]:
    """(positions, weights, detail) of a whole prompt's plan, memoized: every piece of a
    prompt at every layer asks for the same plan (it depends only on the sampling settings
    and the length). Bounded: cleared past ``_PLANS_MAX`` entries."""
    key = (acc.seed, acc.n_random, acc.n_last, acc.n_detail, prompt_len)
    got = _PLANS.get(key)
    if got is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        idx, wts = acc.sample_plan(prompt_len, 0)
        idx.setflags(write=False)
        wts.setflags(write=False)
        got = _PLANS[key] = (idx, wts, dict(acc.detail_subset(len(idx), wts, 0)))
    return got


def fold_plan(acc: HeadStatsAccumulator, layer: int, q: Any, k: Any, scale: float,
              q_start: int, idx_np: Any, wts: Any, detail: dict[int, float], *, v: Any = None,
              softcap: float | None = None, sink_logits: Any = None,
              request_share: float = 1.0) -> int:
    """Fold the queries ``idx_np`` (indices into ``q``, sorted; at positions ``q_start +
    idx``) with Horvitz-Thompson weights ``wts``; ``detail`` maps an index into ``idx_np`` to
    its detail weight. Queries go in tiles of at most ``acc.chunk_queries``, fewer when the
    context is long, so the logits scratch stays under :data:`SCRATCH_ELEMENTS` floats (plus
    one fp32 copy of the keys: Lk x Hkv x D). ``k`` may be a function of n returning the
    first n keys (a paged-cache read): it is called only when a query is folded, for the keys
    up to the last one. Adds ``request_share`` to the layer's requests (also when no query of
    the plan falls here). Returns the number of queries folded."""
    import torch

    hq = q.shape[1]
    if hq != acc.num_q_heads:
        raise ValueError(f"expected {acc.num_q_heads} q heads, got {hq}")
    acc.requests[layer] += request_share
    if len(idx_np) == 0:
        return 0
    idx = torch.as_tensor(np.asarray(idx_np), dtype=torch.long)
    n_keys = int(q_start) + int(idx_np[-1]) + 1
    if callable(k):
        k = k(n_keys)
    if k.shape[1] != acc.num_kv_heads:
        raise ValueError(f"expected {acc.num_kv_heads} kv heads, got {k.shape[1]}")
    if n_keys > k.shape[0]:
        raise ValueError(f"query at position {n_keys - 1} needs {n_keys} keys, "
                         f"got {k.shape[0]}")
    tile = max(1, min(acc.chunk_queries, SCRATCH_ELEMENTS // max(1, hq * n_keys)))
    with torch.no_grad():
        kh = k[:n_keys].float().permute(1, 2, 0)  # [hkv, d, Lk]
        for c0 in range(0, len(idx_np), tile):
            ci = idx[c0:c0 + tile]
            det = [i - c0 for i in range(c0, c0 + len(ci)) if i in detail]
            det_w = [detail[i + c0] for i in det]
            _chunk(acc, layer, q, kh, v, ci, int(q_start), scale, softcap, sink_logits, det,
                   wts[c0:c0 + len(ci)], det_w)
    return len(idx_np)


def update_hf(acc: HeadStatsAccumulator, layer: int, q: Any, k: Any, scale: float, *,
              v: Any = None, **kw: Any) -> int:
    """Same as :func:`update` for the transformers layout q [B, Hq, L, D], k/v
    [B, Hkv, L, D] (each batch row is one request; no padding)."""
    n = 0
    for b in range(q.shape[0]):
        n += update(acc, layer, q[b].transpose(0, 1), k[b].transpose(0, 1), scale,
                    v=None if v is None else v[b].transpose(0, 1), **kw)
    return n


def _chunk(acc: HeadStatsAccumulator, layer: int, q: Any, kh: Any, v: Any, ci: Any,
           start: int, scale: float, softcap: float | None, sink_logits: Any, det: list[int],
           wts: Any = None, det_w: list[float] | None = None) -> None:
    """One chunk of sampled queries (``wts``: their weights, default 1; ``det_w``: the
    weights of the detail queries ``det``). Rows are laid out [hkv, c*g] as bmm produces them,
    so the [rows, keys] matrix is written once and read a handful of times (mask tail,
    max, exp, block sums); no sort or cumsum over all keys."""
    import torch

    c = len(ci)
    hkv, g = acc.num_kv_heads, acc.group_size
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
    wins_t = torch.tensor(acc.window_grid, device=dev)
    first = (rowpos[:, None] - wins_t[None, :] + 1).clamp(min=0)  # [rows, W] window start
    fb = first // bs
    t = torch.arange(bs, device=dev)
    cols = fb[..., None] * bs + t  # [rows, W, bs] the rest of the start's block
    ok = (cols >= first[..., None]) & (cols < n)
    part = torch.gather(x, 2, cols.clamp(max=n - 1).reshape(1, c * g, -1)
                        .expand(hkv, -1, -1)).reshape(hkv, c * g, len(acc.window_grid), bs)
    part = (part * ok[None]).sum(-1).double()
    local = torch.gather(suffix, 2, (fb + 1).clamp(max=nb + 1)[None].expand(hkv, -1, -1))
    local = local + part  # [hkv, rows, W]
    smax = max(acc.sinks_grid)
    pre = x[:, :, :max(1, smax)].double().cumsum(-1)
    sink_idx = torch.tensor([max(0, s - 1) for s in acc.sinks_grid],
                            device=dev).clamp(max=n - 1)
    has = torch.tensor([s > 0 for s in acc.sinks_grid], dtype=torch.float64, device=dev)
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

    w_np = np.ones(c) if wts is None else np.asarray(wts, dtype=np.float64)
    acc.fold_rows(layer, pos.numpy(), rows_to_ch(sink_m), rows_to_ch(local), rows_to_ch(top1),
                  rows_to_ch(1.0 / z), w_np)
    if det:
        _detail(acc, layer, x, z.float(), pos_l, det, v, det_w)


def _detail(acc: HeadStatsAccumulator, layer: int, x: Any, z: Any, pos_l: list[int],
            det: list[int], v: Any, det_w: list[float] | None = None) -> None:
    """Entropy, top-k for ``mass_gamma`` and output norm on a few queries (sorting whole
    rows is the costliest part, so it runs on ``n_detail`` queries per request), each
    weighted by ``det_w`` (default 1)."""
    import torch

    hkv, g = acc.num_kv_heads, acc.group_size
    hq = hkv * g
    for j, qi in enumerate(det):
        dw = 1.0 if det_w is None else float(det_w[j])
        p_ = pos_l[qi]
        n = p_ + 1
        rows = slice(qi * g, (qi + 1) * g)
        p = (x[:, rows, :n] / z[:, rows, None]).reshape(hq, n)  # [hq, n] (kv-major)
        ent = -torch.special.xlogy(p, p).sum(-1)
        ent_n = (ent / math.log(n) if n > 1 else torch.zeros_like(ent)).double().cpu().numpy()
        srt = torch.sort(p, dim=-1, descending=True).values.cumsum(-1)
        tk = ((srt < acc.mass_gamma * srt[:, -1:]).sum(-1) + 1).cpu().numpy()
        norm = None
        if v is not None:
            o = torch.einsum("hgn,nhd->hgd", p.view(hkv, g, n), v[:n].float())
            norm = o.reshape(hq, -1).norm(dim=-1).double().cpu().numpy()
        acc.fold_detail(layer, n, ent_n, tk, pair_js(p), norm, dw)


def pair_js(p: Any, chunk_elements: int = JS_CHUNK_ELEMENTS) -> Any:
    """Jensen-Shannon distance (base 2, in [0, 1]) between every pair of query heads' rows
    ``p`` [hq, n] of one detail query, as a float64 numpy array over the upper triangle
    (row-major, as ``np.triu_indices``); None below two heads. Summed term by term
    (p log 2p/(p+q)) so identical rows give exactly 0; cost O(hq^2 n). All pairs are
    computed where ``p`` lives, ``chunk_elements`` (pairs x keys) at a time so scratch
    stays bounded, and read back once: no device sync per head."""
    import torch

    hq, n = p.shape[0], p.shape[1]
    if hq < 2:
        return None
    ia, ib = torch.triu_indices(hq, hq, 1, device=p.device)  # row-major, as numpy's
    step = max(1, chunk_elements // max(n, 1))
    parts = []
    for c in range(0, ia.numel(), step):
        pa, pb = p[ia[c:c + step]], p[ib[c:c + step]]
        m = (pa + pb).clamp(min=1e-38)
        parts.append(0.5 * (torch.xlogy(pa, 2 * pa / m) + torch.xlogy(pb, 2 * pb / m))
                     .sum(-1))
    js = torch.cat(parts)
    return (js.clamp(min=0) / math.log(2)).clamp(max=1).sqrt().double().cpu().numpy()
