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
from typing import Any, NamedTuple

import numpy as np

from attnprof.aggregate.head_stats import JS_CHUNK_ELEMENTS, HeadStatsAccumulator

__all__ = ["SCRATCH_ELEMENTS", "Folds", "Prepared", "fold_plan", "pair_js", "prepare", "run",
           "sample_queries", "scratch_bytes", "span_plan", "update", "update_hf",
           "update_span"]

_BLOCK = 32  # keys per block for range sums
SCRATCH_ELEMENTS = 1 << 22
"""Most logits (queries x heads x keys) one tile of recomputed rows holds (16 MiB of fp32;
long contexts get tiles of fewer queries, never less than one). The detail queries' sorts
and pairwise distances go in pieces of a quarter and an eighth of it:
:func:`scratch_bytes` is the bound on everything a fold allocates."""


def scratch_bytes(num_q_heads: int, num_kv_heads: int, head_size: int, n_keys: int,
                  tile_elements: int = 0, values: bool = False) -> int:
    """Upper bound of the bytes one :func:`fold_plan` call holds at once beyond its inputs,
    for queries that see ``n_keys`` keys (the stated bound; tests measure it):

    * an fp32 copy of the keys (and of the values when output norms are on): n x Hkv x D;
    * the tile's logits and their softmax, 2 x T fp32 (T = ``tile_elements``, default the
      most :data:`SCRATCH_ELEMENTS` allows: max(SCRATCH_ELEMENTS, Hq x n), one query at
      least), plus block sums, the causal mask and indices (< T more);
    * a detail query's rows, normalised and their entropy terms (2 x Hq x n fp32), then
      either its sort, in pieces of SCRATCH_ELEMENTS / 4 elements (values, indices, running
      sums: < 26 B each), or its pairwise distances, in pieces of SCRATCH_ELEMENTS / 8
      (< 8 fp32 temporaries each): < 2 x 4 B x SCRATCH_ELEMENTS.

    So 4 B x (n Hkv D (x2 with values) + 3 T + 2 Hq n + 2 SCRATCH_ELEMENTS).
    """
    t = tile_elements or max(SCRATCH_ELEMENTS, num_q_heads * n_keys)
    kv = n_keys * num_kv_heads * head_size * (2 if values else 1)
    return 4 * (kv + 3 * t + 2 * num_q_heads * n_keys + 2 * SCRATCH_ELEMENTS)


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
                sink_logits: Any = None, weight: float = 1.0) -> int:
    """Fold one piece of a prompt (a chunk, or the uncached tail after a prefix-cache hit):
    ``q`` [Lq, Hq, D] the queries at prompt positions ``q_start`` .. ``q_start + Lq - 1``,
    ``k`` [>= q_start + Lq, Hkv, D] the prompt's keys from position 0 (earlier ones read from
    the paged cache; or a function of n giving the first n keys: see :func:`fold_plan`). The
    sample is the **whole prompt's** (:meth:`sample_plan` over ``prompt_len``, and its detail
    subset), restricted to this piece's positions, so the pieces of a prompt served in chunks
    fold exactly the queries, weights and detail queries the prompt served whole would. The
    request counts ``Lq / prompt_len``: once over all its pieces, partly when positions were
    never computed (a prefix-cache hit's cached head); it is seen whole on the piece holding
    its last position. ``weight`` multiplies every query's
    weight: the sampling stages before this one (the step's own inclusion probability)."""
    idx, wts, local, share = span_plan(acc, int(q.shape[0]), prompt_len, q_start, weight)
    return fold_plan(acc, layer, q, k, scale, q_start, idx, wts, local, v=v, softcap=softcap,
                     sink_logits=sink_logits, request_share=share,
                     whole=q_start + int(q.shape[0]) >= prompt_len)


def span_plan(acc: HeadStatsAccumulator, q_len: int, prompt_len: int, q_start: int,
              weight: float = 1.0) -> tuple[Any, Any, dict[int, float], float]:
    """:func:`update_span`'s share of the whole prompt's plan for the piece of ``q_len``
    queries at ``q_start``: (indices into the piece, weights, detail, request share), the
    arguments :func:`fold_plan` and :func:`prepare` take."""
    idx, wts, detail = _whole_plan(acc, int(prompt_len))
    keep = np.flatnonzero((idx >= q_start) & (idx < q_start + q_len))
    local = {int(j): detail[int(i)] * weight for j, i in enumerate(keep) if int(i) in detail}
    return (idx[keep] - q_start, wts[keep] * weight if weight != 1.0 else wts[keep], local,
            q_len / max(1, prompt_len))


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
              request_share: float = 1.0, whole: bool | None = None) -> int:
    """Fold the queries ``idx_np`` (indices into ``q``, sorted; at positions ``q_start +
    idx``) with Horvitz-Thompson weights ``wts``; ``detail`` maps an index into ``idx_np`` to
    its detail weight. Queries go in tiles of at most ``acc.chunk_queries``, fewer when the
    context is long, so the logits stay under :data:`SCRATCH_ELEMENTS` floats (all scratch:
    :func:`scratch_bytes`). ``k`` may be a function of n returning the
    first n keys (a paged-cache read): it is called only when a query is folded, for the keys
    up to the last one. Adds ``request_share`` to the layer's requests (also when no query of
    the plan falls here), and one to its requests seen when ``whole`` (default: a share of
    1). Returns the number of queries folded.

    :func:`prepare` then :func:`run` (what the engine's thread and the statistics' worker do
    when the work is deferred: :mod:`attnprof.capture.head_worker`); on a device tensor the
    numbers reach ``acc`` only once :meth:`Folds.apply` ran (here, at once: it waits)."""
    job = prepare(acc, layer, q, k, scale, q_start, idx_np, wts, detail, v=v,
                  softcap=softcap, sink_logits=sink_logits, request_share=request_share,
                  whole=whole)
    run(acc, job).apply()
    return job.queries


class Prepared(NamedTuple):
    """One layer call's statistics work, its inputs read (:func:`prepare`)."""

    layer: int
    q: Any  # [m, Hq, D] the sampled queries only, in plan order
    kt: Any  # [Hkv, D, n] keys of positions [0, n) (n: the last sampled query's + 1)
    v: Any  # [>= n, Hkv, Dv] or None
    scale: float
    q_start: int
    idx: Any  # numpy int64 [m], indices into the piece's queries (positions q_start + idx)
    wts: Any
    detail: dict[int, float]
    softcap: float | None
    sink_logits: Any
    request_share: float
    whole: bool = False  # counts one request seen (see HeadStatsAccumulator.requests_seen)

    @property
    def queries(self) -> int:
        return len(self.idx)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors it holds (what a deferred fold keeps alive until it runs)."""
        return sum(int(t.numel()) * int(t.element_size()) for t in (self.q, self.kt, self.v)
                   if t is not None)


def prepare(acc: HeadStatsAccumulator, layer: int, q: Any, k: Any, scale: float,
            q_start: int, idx_np: Any, wts: Any, detail: dict[int, float], *, v: Any = None,
            softcap: float | None = None, sink_logits: Any = None, request_share: float = 1.0,
            copy: bool = False, whole: bool | None = None) -> Prepared:
    """The reads :func:`fold_plan` needs (arguments as there): the sampled queries and the
    keys up to the last of them, as ``[Hkv, D, n]`` fp32. ``copy``: own every tensor (the
    engine may overwrite its buffers and the paged cache as soon as the call returns: a fold
    run later on another thread needs copies). Raises ``ValueError`` on a head-count
    mismatch, as :func:`fold_plan`."""
    import torch

    hq = q.shape[1]
    if hq != acc.num_q_heads:
        raise ValueError(f"expected {acc.num_q_heads} q heads, got {hq}")
    idx = np.asarray(idx_np, dtype=np.int64)
    seen = request_share >= 1.0 if whole is None else bool(whole)
    if len(idx) == 0:
        return Prepared(layer, None, None, None, scale, int(q_start), idx, wts, {}, softcap,
                        sink_logits, request_share, seen)
    n_keys = int(q_start) + int(idx[-1]) + 1
    if callable(k):
        k = k(n_keys)  # a paged read: a new tensor already
        fresh = True
    else:
        fresh = False
    if k.shape[1] != acc.num_kv_heads:
        raise ValueError(f"expected {acc.num_kv_heads} kv heads, got {k.shape[1]}")
    if n_keys > k.shape[0]:
        raise ValueError(f"query at position {n_keys - 1} needs {n_keys} keys, "
                         f"got {k.shape[0]}")
    with torch.no_grad():
        kt = k[:n_keys].permute(1, 2, 0)
        if fresh:  # [Hkv, D, n] fp32 and contiguous already (read_keys_t)
            kt = kt.float()
        else:  # one copy (a conversion from 16 bits needed one anyway): owned, contiguous
            kt = torch.empty(kt.shape, dtype=torch.float32, device=kt.device).copy_(kt)
        # only the sampled rows (a compact copy: index_select never aliases)
        qs = q.index_select(0, _to_dev(idx, q.device))
        if v is not None and copy:
            v = v[:n_keys].clone()
        sl = sink_logits
        if sl is not None and copy and hasattr(sl, "clone"):
            sl = sl.clone()
    return Prepared(layer, qs, kt, v, scale, int(q_start), idx, wts, detail, softcap, sl,
                    request_share, seen)


def run(acc: HeadStatsAccumulator, job: Prepared) -> Folds:
    """The statistics of a call :func:`prepare` read. On the CPU their numbers are folded into
    ``acc`` here (the returned :class:`Folds` is empty); on a device the work is only
    enqueued and the numbers copied to the host without waiting: :meth:`Folds.apply`, called
    later (off the serving path), waits for them and folds. Nothing here reads a device
    value on the host (no synchronisation; tests/unit/capture/test_head_rows_nosync.py)."""
    import torch

    out = Folds(acc, job.kt.device if job.kt is not None else None)
    out.add("requests", job.layer, job.request_share, job.whole)
    if job.queries == 0:
        return out.close()
    idx, detail = job.idx, job.detail
    tile = max(1, min(acc.chunk_queries,
                      SCRATCH_ELEMENTS // max(1, acc.num_q_heads * int(job.kt.shape[2]))))
    with torch.no_grad():
        for c0 in range(0, len(idx), tile):
            ci = idx[c0:c0 + tile]
            det = [i - c0 for i in range(c0, c0 + len(ci)) if i in detail]
            det_w = [detail[i + c0] for i in det]
            _chunk(acc, out, job.layer, job.q[c0:c0 + len(ci)], job.kt, job.v, ci,
                   job.q_start, job.scale, job.softcap, job.sink_logits, det,
                   job.wts[c0:c0 + len(ci)], det_w)
    return out.close()


def _on_device(dev: Any) -> bool:
    """Whether numbers on ``dev`` must reach the host without a wait (every device but the
    CPU; a test forces the device path on CPU tensors to prove it reads nothing back)."""
    return bool(dev.type != "cpu")


def _to_dev(a: Any, dev: Any) -> Any:
    """A numpy array as a tensor on ``dev``: through pinned memory and a non-blocking copy
    on a CUDA device (a pageable copy would wait for the device's queue)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    if dev.type == "cpu":
        return t
    if dev.type == "cuda":
        t = t.pin_memory()
    return t.to(dev, non_blocking=True)


class Folds:
    """A layer call's per-query numbers on their way into the accumulator: folded at once
    from CPU tensors; from device tensors copied to the host by non-blocking copies, then
    folded by :meth:`apply` once the event recorded after the copies has completed."""

    def __init__(self, acc: HeadStatsAccumulator, dev: Any) -> None:
        self.acc = acc
        self.dev = dev
        self.device = dev is not None and _on_device(dev)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.event: Any = None

    def host(self, t: Any) -> Any:
        """``t`` on its way to the host (device: a non-blocking copy into pinned memory)."""
        return t.to("cpu", non_blocking=True) if self.device else t

    def add(self, name: str, *args: Any) -> None:
        if self.device:
            self.calls.append((name, args))
        else:
            _fold_call(self.acc, name, args)

    def close(self) -> Folds:
        if self.device and self.calls:
            self.event = _record_event(self.dev)
        return self

    @property
    def ready(self) -> bool:
        """The copies have landed (:meth:`apply` will not wait)."""
        return self.event is None or bool(self.event.query())

    def apply(self) -> None:
        """Fold what is held (waits for the copies on a device: call it off the serving
        path, or once :attr:`ready`)."""
        if self.event is not None:
            if isinstance(self.event, _DoneEvent):
                self.event.synchronize()
            else:  # on the worker's thread: the event's device made current first
                import torch

                with torch.cuda.device(self.dev):
                    self.event.synchronize()
            self.event = None
        calls, self.calls = self.calls, []
        for name, args in calls:
            _fold_call(self.acc, name, args)


class _DoneEvent:
    """Stands for a CUDA event where there is none (a device path forced on CPU tensors)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _record_event(dev: Any) -> Any:
    """An event after the copies just enqueued on ``dev``'s current stream."""
    if dev.type != "cuda":
        return _DoneEvent()
    import torch

    ev = torch.cuda.Event()
    ev.record()
    return ev


def _np(a: Any) -> Any:
    return a.numpy() if hasattr(a, "numpy") and not isinstance(a, np.ndarray) else a


def _fold_call(acc: HeadStatsAccumulator, name: str, args: tuple[Any, ...]) -> None:
    if name == "requests":
        layer, share, whole = args
        acc.requests[layer] += share
        if whole:
            acc.requests_seen[layer] += 1
    elif name == "rows":
        layer, pos, res, w_np, ns = args
        res = _np(res)
        acc.fold_rows(layer, pos, res[..., :ns], res[..., ns:-2], res[..., -2], res[..., -1],
                      w_np)
    else:  # detail
        layer, n, ent_n, tk, js, norm, dw = args
        acc.fold_detail(layer, n, _np(ent_n), _np(tk), None if js is None else _np(js),
                        None if norm is None else _np(norm), dw)


def update_hf(acc: HeadStatsAccumulator, layer: int, q: Any, k: Any, scale: float, *,
              v: Any = None, **kw: Any) -> int:
    """Same as :func:`update` for the transformers layout q [B, Hq, L, D], k/v
    [B, Hkv, L, D] (each batch row is one request; no padding)."""
    n = 0
    for b in range(q.shape[0]):
        n += update(acc, layer, q[b].transpose(0, 1), k[b].transpose(0, 1), scale,
                    v=None if v is None else v[b].transpose(0, 1), **kw)
    return n


class _Index(NamedTuple):
    """Index tensors of one tile, the same at every layer of a step (memoized)."""

    ci: Any  # [c] query indices into q (long, on the device)
    lo: int  # first key column a causal mask touches (the first query's position + 1)
    mask: Any  # [rows, n - lo] bool: key after the row's query; None when lo >= n
    cols: Any  # [rows, W * bs] key column of each window start's block (clamped)
    ok: Any  # [rows, W, bs] float: the column is inside the window and below n
    fb1: Any  # [rows, W] the block after each window start's (clamped to nb + 1)
    sink_idx: Any  # [S] last key of each sink prefix (clamped to n - 1)
    has: Any  # [S] float64: 0 for the s = 0 entry


_INDEX: dict[tuple[Any, ...], _Index] = {}
_INDEX_BYTES = 1 << 23
"""Most bytes the memoized index tensors hold (masks dominate: rows x keys after the first
query); past it the memo starts over."""
_index_bytes = 0


def _index(acc: HeadStatsAccumulator, ci: Any, start: int, n: int, dev: Any) -> _Index:
    """The tile's index tensors, built in numpy (a few microseconds each instead of a torch
    op each) and memoized on (positions, grids, device): every layer of a step asks for the
    same ones. Bounded: cleared past ``_INDEX_BYTES``."""
    global _index_bytes
    key = (ci.tobytes(), start, n, acc.group_size, acc.window_grid, acc.sinks_grid, str(dev))
    got = _INDEX.get(key)
    if got is not None:
        return got
    g, bs = acc.group_size, _BLOCK
    rowpos: Any = np.repeat(ci + start, g)  # row r belongs to query r // g
    lo = int(rowpos[0]) + 1
    mask = None
    if lo < n:  # causal mask; a finite fill keeps 0 * fill == 0 below
        mask = _to_dev(np.arange(lo, n)[None, :] > rowpos[:, None], dev)
    wins = np.asarray(acc.window_grid, dtype=np.int64)
    first = np.maximum(rowpos[:, None] - wins[None, :] + 1, 0)  # [rows, W] window start
    fb = first // bs
    cols = fb[..., None] * bs + np.arange(bs)  # [rows, W, bs] the rest of the start's block
    ok = (cols >= first[..., None]) & (cols < n)
    nb = n // bs
    sinks = np.asarray(acc.sinks_grid, dtype=np.int64)
    got = _Index(
        _to_dev(np.asarray(ci, dtype=np.int64), dev), lo, mask,
        _to_dev(np.minimum(cols, n - 1).reshape(len(rowpos), -1), dev),
        _to_dev(ok.astype(np.float32), dev),
        _to_dev(np.minimum(fb + 1, nb + 1), dev),
        _to_dev(np.minimum(np.maximum(sinks - 1, 0), n - 1), dev),
        _to_dev((sinks > 0).astype(np.float64), dev))
    size = sum(t.numel() * t.element_size() for t in got if not isinstance(t, int | None))
    if _index_bytes + size > _INDEX_BYTES:
        _INDEX.clear()
        _index_bytes = 0
    if size <= _INDEX_BYTES:
        _INDEX[key] = got
        _index_bytes += size
    return got


def _chunk(acc: HeadStatsAccumulator, folds: Folds, layer: int, q: Any, kh: Any, v: Any,
           ci: Any, start: int, scale: float, softcap: float | None, sink_logits: Any,
           det: list[int], wts: Any = None, det_w: list[float] | None = None) -> None:
    """One tile of sampled queries ``ci`` (numpy indices at positions ``start + ci``, their
    rows ``q`` [c, Hq, D], into ``folds``; ``wts``: their weights,
    default 1; ``det_w``: the weights of the detail queries ``det``). Rows are laid out
    [hkv, c*g] as bmm produces them. The logits go through one fused softmax (the fastest
    pass over [rows, keys] here: max, exp, sum and scale in one kernel); the top-1 key is
    found from 32-key block maxima (argmax over all keys is a slow scalar loop on CPU);
    window masses come from block sums. No sort or cumsum over all keys."""
    import torch

    c = len(ci)
    hkv, g = acc.num_kv_heads, acc.group_size
    hq, rows = hkv * g, c * g
    pos = np.asarray(ci, dtype=np.int64) + start
    n = int(pos[-1]) + 1
    dev = kh.device  # CUDA in a GPU worker: index tensors live there, results go to numpy
    ix = _index(acc, np.asarray(ci, dtype=np.int64), start, n, dev)
    # scale folded into q: one pass over [rows, keys] fewer
    qh = (q.float() * scale).view(c, hkv, g, -1).permute(1, 0, 2, 3).reshape(
        hkv, rows, -1)
    x = torch.bmm(qh, kh[:, :, :n])  # [hkv, rows, n] logits
    if softcap:
        x.div_(softcap).tanh_().mul_(softcap)
    if ix.mask is not None:
        x[:, :, ix.lo:].masked_fill_(ix.mask, -1e30)
    bs = _BLOCK
    nb = n // bs
    # top-1: the first block holding the row's maximum, then the first maximum inside it
    bmax = x[..., :nb * bs].view(hkv, rows, nb, bs).amax(-1)
    if n > nb * bs:
        bmax = torch.cat([bmax, x[..., nb * bs:].amax(-1, keepdim=True)], -1)
    b1 = bmax.argmax(-1, keepdim=True) * bs  # [hkv, rows, 1]
    inb = (b1 + torch.arange(bs, device=dev)).clamp(max=n - 1)
    top1 = b1[..., 0] + torch.gather(x, 2, inb).argmax(-1)  # [hkv, rows]
    m = None if sink_logits is None else torch.gather(x, 2, top1[..., None])[..., 0]
    p = torch.softmax(x, -1)  # normalized weights, [hkv, rows, n]
    del x
    # Block sums (one pass) and their suffix sums in float64 give the mass of any key
    # range [a, n) as suffix-of-blocks + a partial block: summed directly, never as
    # total - prefix, so small local masses stay precise.
    blocks = torch.zeros(hkv, rows, nb + 2, dtype=torch.float64, device=dev)
    blocks[..., :nb] = p[..., :nb * bs].view(hkv, rows, nb, bs).sum(-1)
    blocks[..., nb] = p[..., nb * bs:].sum(-1)
    suffix = blocks.flip(-1).cumsum(-1).flip(-1)  # suffix[b] = sum of blocks b..
    z = suffix[..., :1]  # 1 up to rounding: dividing by it keeps the masses' sum exactly 1
    part = (torch.gather(p, 2, ix.cols.expand(hkv, -1, -1)).view(hkv, rows, -1, bs)
            * ix.ok).sum(-1)
    out = torch.empty(hkv, rows, len(acc.sinks_grid) + len(acc.window_grid) + 2,
                      dtype=torch.float64, device=dev)
    ns = len(acc.sinks_grid)
    local = out[..., ns:-2]
    torch.add(torch.gather(suffix, 2, ix.fb1.expand(hkv, -1, -1)), part, out=local)
    pre = p[:, :, :max(1, max(acc.sinks_grid))].cumsum(-1, dtype=torch.float64)
    sink_m = out[..., :ns]
    torch.mul(pre[:, :, ix.sink_idx], ix.has, out=sink_m)
    out[..., -2] = top1
    maxw = out[..., -1]
    maxw.copy_(p.amax(-1))  # 1 / z before the division below
    out[..., :-2] /= z
    maxw /= z[..., 0]
    zd = z[..., 0]  # the detail rows' normaliser
    if m is not None:  # learned sinks (gpt-oss): extra mass outside every key
        sl = torch.as_tensor(sink_logits)
        sl = (sl if sl.device == dev else sl.to(dev, non_blocking=True)).float()
        sl = sl.view(hkv, 1, g).expand(hkv, c, g)
        r = torch.exp(sl.reshape(hkv, rows) - m).double() * maxw  # sink / keys' mass
        out[..., :-2] /= (1 + r)[..., None]
        sink_m += (r / (1 + r))[..., None] * ix.has
        maxw /= 1 + r
        zd = zd * (1 + r)
    res = out.reshape(hkv, c, g, -1).transpose(0, 1).reshape(c, hq, -1)
    w_np = np.ones(c) if wts is None else np.asarray(wts, dtype=np.float64)
    folds.add("rows", layer, pos, folds.host(res), w_np, ns)
    if det:
        _detail(acc, folds, layer, p, zd.float(), pos.tolist(), det, v, det_w)


def _detail(acc: HeadStatsAccumulator, folds: Folds, layer: int, x: Any, z: Any,
            pos_l: list[int], det: list[int], v: Any, det_w: list[float] | None = None
            ) -> None:
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
        ent_n = folds.host((ent / math.log(n) if n > 1 else torch.zeros_like(ent)).double())
        tk = (folds.host(_mass_count_dev(p, acc.mass_gamma)) if folds.device
              else _mass_count(p, acc.mass_gamma))
        norm = None
        if v is not None:
            o = torch.einsum("hgn,nhd->hgd", p.view(hkv, g, n), v[:n].float())
            norm = folds.host(o.reshape(hq, -1).norm(dim=-1).double())
        js = pair_js(p, SCRATCH_ELEMENTS // 8, host=not folds.device)
        folds.add("detail", layer, n, ent_n, tk, None if js is None else folds.host(js), norm,
                  dw)


_TOPK_FIRST = 64


def _mass_count_dev(p: Any, gamma: float) -> Any:
    """:func:`_mass_count` without reading anything back (a device's path): every row
    sorted in full, in the same pieces, the counts left where ``p`` lives (int64 [rows]).
    The same counts (the partial top-k only settles rows early)."""
    import torch

    rows, n = int(p.shape[0]), int(p.shape[1])
    need = gamma * p.sum(-1, dtype=torch.float64)
    piece = max(1, SCRATCH_ELEMENTS // (4 * n))
    parts = []
    for a in range(0, rows, piece):
        top = torch.sort(p[a:a + piece], -1, descending=True).values.cumsum(
            -1, dtype=torch.float64)
        parts.append(((top < need[a:a + piece, None]).sum(-1) + 1).clamp(max=n))
    return torch.cat(parts)


def _mass_count(p: Any, gamma: float) -> Any:
    """Keys needed, largest first, for ``gamma`` of each row's mass (``p`` [rows, n]) as
    numpy. A partial top-k (linear time) of 64, then 512 keys settles the peaked rows; only
    rows still short sort in full (a sort of 9 x 4K keys took 2 ms, a top-64 0.08 ms). The
    same count as sorting every row: the top-k values come sorted, so their running sum is
    the sorted row's up to k."""
    import torch

    rows, n = int(p.shape[0]), int(p.shape[1])
    need = gamma * p.sum(-1, dtype=torch.float64)
    out: Any = np.empty(rows, dtype=np.int64)
    todo = np.arange(rows)
    k = _TOPK_FIRST
    while len(todo):
        k = min(k, n)
        # rows in pieces: a sort's values, indices and running sums stay under
        # SCRATCH_ELEMENTS / 4 elements each
        piece = max(1, SCRATCH_ELEMENTS // (4 * n))
        left = []
        for a in range(0, len(todo), piece):
            rows_ = todo[a:a + piece]
            at = torch.from_numpy(rows_).to(p.device)
            sub = p if len(rows_) == rows else p[at]
            top = (torch.sort(sub, -1, descending=True) if k == n
                   else torch.topk(sub, k, -1)).values.cumsum(-1, dtype=torch.float64)
            nd = need if len(rows_) == rows else need[at]
            cnt = np.minimum((top < nd[:, None]).sum(-1).cpu().numpy() + 1, n)
            done = (cnt <= k) | (k == n)  # settled within the top k (all keys: always)
            out[rows_[done]] = cnt[done]
            left.append(rows_[~done])
        todo = np.concatenate(left)
        k *= 8
    return out


def pair_js(p: Any, chunk_elements: int = JS_CHUNK_ELEMENTS, host: bool = True) -> Any:
    """Jensen-Shannon distance (base 2, in [0, 1]) between every pair of query heads' rows
    ``p`` [hq, n] of one detail query, as a float64 numpy array over the upper triangle
    (row-major, as ``np.triu_indices``); None below two heads. Summed term by term
    (p log 2p/(p+q)) so identical rows give exactly 0; cost O(hq^2 n). All pairs are
    computed where ``p`` lives, ``chunk_elements`` (pairs x keys) at a time so scratch
    stays bounded, and read back once (``host``; else left where ``p`` lives, float64): no
    device sync per head."""
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
    out = (js.clamp(min=0) / math.log(2)).clamp(max=1).sqrt().double()
    return out.cpu().numpy() if host else out
