"""What the transformers wrapper records: per-call records, activation-map rows and the
reasons a kernel ran, built from what the SDPA spy saw (no torch import; tensors are only
read for their shapes and dtypes). :mod:`attnprof.capture.transformers` holds the wrapper.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from attnprof.facts.shape import layer_label, site_order

__all__ = ["EAGER_REASON", "NO_REGISTRY_REASON", "AttentionCallEvent", "CallRecord",
           "KernelEntry", "activation_rows", "call_record", "layer_rows", "length_bucket",
           "mask_kind", "resolve_entry", "resolve_module_entry"]

NO_REGISTRY_REASON = {
    "code": "no_registry",
    "backend": "transformers",
    "message": "this attention module does not call transformers' attention registry "
               "(no attn_implementation); attnprof wraps its forward and reads the aten ops "
               "it ran",
}
EAGER_REASON = {
    "code": "eager",
    "backend": "transformers",
    "message": "attn_implementation='eager' runs QK^T, softmax and PV as separate ops and "
               "materializes the [B, Hq, Lq, Lk] score matrix",
}


@dataclass
class AttentionCallEvent:
    """What ``on_call`` receives for each attention call (after it ran, outside timing).

    Tensors are the live ones the model passed (do not modify them in place); ``kwargs``
    holds transformers' keyword arguments (``scaling``, ``dropout``, ``sliding_window``,
    ``softcap``, ``is_causal``...); ``backend`` is the transformers implementation that ran
    ("sdpa", "eager", "flex_attention", ...); ``kernel``/``fused`` are the resolved kernel
    when known (e.g. "flash_cpu" for SDPA's fused CPU kernel, "math", "eager").
    """

    layer_idx: int
    module: Any
    query: Any
    key: Any
    value: Any
    attention_mask: Any
    kwargs: dict[str, Any]
    backend: str
    output: Any = None
    attn_weights: Any = None
    elapsed_s: float = 0.0
    kernel: str | None = None
    fused: bool | None = None
    stack: str | None = None
    kind: str = "self"


@dataclass
class CallRecord:
    """One attention call, shapes and timing only (no tensor contents, no token ids)."""

    layer_idx: int
    impl: str
    phase: str  # prefill (Lq > 1) | decode (Lq == 1)
    mask: str  # none | bool | float | block_mask
    batch: int
    q_len: int
    kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: str
    sliding_window: int | None
    dropout: float
    elapsed_s: float
    kernel: str
    fused: bool
    tags: dict[str, Any] = field(default_factory=dict)
    start_ns: int = 0
    """``time.perf_counter_ns()`` just before the call's clock started (places it in a trace)."""
    stack: str | None = None
    """"encoder"/"decoder" in encoder-decoder models, else None."""
    kind: str = "self"
    """"cross" for cross-attention (keys/values from the encoder), else "self"."""

    @property
    def label(self) -> str:
        return layer_label(self.layer_idx, self.stack, self.kind)


@dataclass
class KernelEntry:
    """Activation-map row: the kernel that ran for one layer and shape class, and why."""

    layer_idx: int
    impl: str
    phase: str
    mask: str
    length_bucket: int
    dtype: str
    kernel: str
    fused: bool
    reasons: list[dict[str, str]]
    sdpa_args: dict[str, Any] | None  # what reached F.scaled_dot_product_attention
    ops: list[str]  # aten ops under the call (first ones), the ground truth
    calls: int = 0
    time_s: float = 0.0
    tags: dict[str, Any] = field(default_factory=dict)
    stack: str | None = None
    kind: str = "self"

    @property
    def label(self) -> str:
        return layer_label(self.layer_idx, self.stack, self.kind)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def length_bucket(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def mask_kind(mask: Any) -> str:
    """none | bool | float | block_mask (or the mask's type name)."""
    if mask is None:
        return "none"
    dt = getattr(mask, "dtype", None)
    if dt is None:
        return "block_mask" if type(mask).__name__ == "BlockMask" else type(mask).__name__
    return "bool" if str(dt) == "torch.bool" else "float"


def _attention_ops(ops: list[str]) -> list[str]:
    """The ops of the attention maths among a module's ops (projections dropped), first 12."""
    keep = ("bmm", "baddbmm", "matmul", "softmax", "_softmax", "masked_fill", "where",
            "dropout", "native_dropout", "scaled_dot_product")
    return [o for o in ops if o.startswith(keep)][:12]


def resolve_entry(ckey: tuple[Any, ...], base: str, spy: Any) -> KernelEntry:
    """The activation-map row of a shape class (``ckey``, see :meth:`Profile._class_key`):
    the kernel the SDPA spy saw on its first call (``spy``: None where no spy ran), eager's
    ops, or the implementation's own name."""
    (layer, stack, kind), _base, phase, mask, bucket, dtype, _drop, tags = ckey
    dtype = dtype.removeprefix("torch.")
    common = dict(layer_idx=layer, impl=base, phase=phase, mask=mask, length_bucket=bucket,
                  dtype=dtype, tags=dict(tags), stack=stack, kind=kind)
    if base == "eager":
        return KernelEntry(kernel="eager", fused=False, reasons=[dict(EAGER_REASON)],
                           sdpa_args=None, ops=["matmul", "softmax", "matmul"], **common)
    calls = spy.calls if spy is not None else []
    if calls:
        c = calls[-1]
        args = {"query": list(c.query_shape), "key": list(c.key_shape),
                "value": list(c.value_shape), "dtype": c.dtype, "mask": c.mask,
                "mask_shape": list(c.mask_shape) if c.mask_shape else None,
                "dropout_p": c.dropout_p, "is_causal": c.is_causal,
                "enable_gqa": c.enable_gqa, "dispatcher_choice": c.choice.backend}
        reasons = [] if c.fused else list(c.choice.reasons)
        if not c.fused and c.choice.fused:
            reasons.append({"code": "dispatch_mismatch", "backend": c.choice.backend,
                            "message": "the dispatcher chose a fused backend but the math "
                                       "ops ran"})
        return KernelEntry(kernel=c.backend, fused=c.fused, reasons=reasons,
                           sdpa_args=args, ops=c.ops[:12], **common)
    if "flex" in base:
        return KernelEntry(kernel="flex_attention", fused=True, reasons=[], sdpa_args=None,
                           ops=["flex_attention"], **common)
    return KernelEntry(kernel=base, fused=True, reasons=[], sdpa_args=None, ops=[], **common)

def call_record(site: tuple[int, str | None, str], base: str, q: Any, k: Any, v: Any,
                mask: Any, kwargs: dict[str, Any], dt: float, entry: KernelEntry,
                tags: dict[str, Any], start_ns: int = 0) -> CallRecord:
    """One call's record: shapes and timing from its tensors (no contents)."""
    sw = kwargs.get("sliding_window")
    layer, stack, kind = site
    return CallRecord(
        layer_idx=layer, impl=base, phase="prefill" if int(q.shape[-2]) > 1 else "decode",
        mask=mask_kind(mask), batch=int(q.shape[0]), q_len=int(q.shape[-2]),
        kv_len=int(k.shape[-2]), num_heads=int(q.shape[1]), num_kv_heads=int(k.shape[1]),
        head_dim=int(q.shape[-1]), head_dim_v=int(v.shape[-1]),
        dtype=str(q.dtype).removeprefix("torch."),
        sliding_window=int(sw) if isinstance(sw, int) and sw > 0 else None,
        dropout=float(kwargs.get("dropout", 0.0) or 0.0), elapsed_s=dt,
        kernel=entry.kernel, fused=entry.fused, tags=dict(tags), start_ns=start_ns,
        stack=stack, kind=kind)


def resolve_module_entry(ckey: tuple[Any, ...], rec: Any, spy: Any) -> KernelEntry:
    """The module route's row: the SDPA call it made, if any, else its own ops."""
    if spy.calls:
        entry = resolve_entry(ckey, "module", spy)
        entry.reasons.append(dict(NO_REGISTRY_REASON))
        return entry
    (layer, stack, kind), _b, phase, mask, bucket, dtype, _d, tags = ckey
    return KernelEntry(layer_idx=layer, impl="module", phase=phase, mask=mask,
                       length_bucket=bucket, dtype=dtype.removeprefix("torch."),
                       kernel="eager", fused=False, reasons=[dict(NO_REGISTRY_REASON)],
                       sdpa_args=None, ops=_attention_ops(rec.ops), tags=dict(tags),
                       stack=stack, kind=kind)


def activation_rows(kernels: Iterable[KernelEntry]) -> list[dict[str, Any]]:
    """One row per (layer site, implementation, phase, mask kind, length bucket, dtype);
    a site is (stack, layer index, kind), in model order (encoder before decoder)."""
    rows = [e.as_dict() for e in kernels]
    rows.sort(key=lambda r: (*site_order(r["stack"], r["layer_idx"], r["kind"]),
                             r["phase"], r["mask"], r["length_bucket"]))
    return rows

def layer_rows(kernels: Iterable[KernelEntry]) -> list[dict[str, Any]]:
    """Per layer site: kernels seen, whether all calls were fused, reasons, calls and
    time (``stack``/``kind``/``label`` tell encoder, decoder and cross-attention apart)."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in kernels:
        d = out.setdefault(site_order(e.stack, e.layer_idx, e.kind), {
            "layer": e.layer_idx, "stack": e.stack, "kind": e.kind, "label": e.label,
            "impl": e.impl, "kernels": [], "fused": True, "reasons": [], "calls": 0,
            "time_s": 0.0})
        if e.kernel not in d["kernels"]:
            d["kernels"].append(e.kernel)
        d["fused"] = d["fused"] and e.fused
        for r in e.reasons:
            if r not in d["reasons"]:
                d["reasons"].append(r)
        d["calls"] += e.calls
        d["time_s"] += e.time_s
    return [out[k] for k in sorted(out)]
