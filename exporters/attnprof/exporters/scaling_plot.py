"""The profile's scaling plot (``scaling.png``, also a TensorBoard image): attention time and
memory per path against sequence length, fits, the whole model's peak and the OOM length."""

from __future__ import annotations

from attnprof.contracts.profile import ProfileReport

__all__ = ["scaling_png"]


def scaling_png(res: ProfileReport) -> bytes:
    """``scaling.png``: attention time and memory against sequence length per path, the
    model's peak, the budget and the predicted OOM length (matplotlib, Agg; no pyplot state
    is left behind)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnprof.analyze.scaling import eval_poly2

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"flash_cpu": "tab:green", "math": "tab:red", "eager": "tab:orange"}
    for path, e in res.scaling.paths.items():
        xs = [int(k) for k in e.time_s]
        if not xs:
            continue
        c = colors.get(path)
        ax_t.plot(xs, [v * 1e3 for v in e.time_s.values()], "o", color=c, label=path)
        ax_m.plot(xs, [v / 2**20 for v in e.peak_bytes.values()], "o", color=c,
                  label=f"{path} (one call)")
        if e.time_fit is not None and e.memory_fit is not None:
            tf, mf = e.time_fit.to_json(), e.memory_fit.to_json()
            grid = _grid(xs)
            ax_t.plot(grid, [eval_poly2(tf, x) * 1e3 for x in grid], "-", color=c, alpha=0.6)
            ax_m.plot(grid, [eval_poly2(mf, x) / 2**20 for x in grid], "-", color=c,
                      alpha=0.6)
    rows = res.scaling.by_seq_len
    xs = [r.seq_len for r in rows]
    ax_m.plot(xs, [r.peak_total_bytes / 2**20 for r in rows], "s-", color="tab:blue",
              label="whole model forward")
    o = res.oom_prediction
    ax_m.axhline(o.memory_budget_bytes / 2**20, color="black", ls="--", lw=1,
                 label=f"budget {o.memory_budget_bytes / 2**30:.2f} GiB")
    if o.max_seq_len and o.max_seq_len <= 64 * max(xs):
        # The analytic floor the prediction never passes: weights + KV cache + the attention
        # peaks of the paths the model ran, out to the predicted OOM length.
        from attnprof.analyze.oom import forward_floor

        m = res.model
        paths = [""] * m.num_layers
        for p, layers in o.attention_paths.items():
            for i in layers:
                if i < len(paths):
                    paths[i] = p
        paths = [p or "flash_cpu" for p in paths]
        grid = _grid([min(xs), int(o.max_seq_len * 1.3)])
        ax_m.plot(grid, [forward_floor(int(x), static_bytes=o.static_bytes,
                                       batch=res.run.batch_size, num_heads=m.num_heads,
                                       num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                       dtype=m.dtype, layer_paths=paths,
                                       threads=res.environment.device.threads or 1,
                                       layer_windows=m.layer_windows) / 2**20 for x in grid],
                  "--", color="tab:blue", lw=1, label="analytic floor (paths as run)")
        how = "" if o.confidence is None else (
            f" ({'extrapolated ' if o.extrapolation else ''}"
            f"{o.extrapolation_factor or 0:g}x, confidence {o.confidence})")
        ax_m.axvline(o.max_seq_len, color="black", ls=":", lw=1,
                     label=f"predicted OOM at L={o.max_seq_len}{how}")
    ax_t.set(xlabel="sequence length", ylabel="ms per attention call", title="Attention time",
             xscale="log", yscale="log")
    ax_m.set(xlabel="sequence length", ylabel="MiB (peak)", title="Memory vs length",
             xscale="log", yscale="log")
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    m = res.model
    fig.suptitle(f"{m.name} ({m.num_heads}/{m.num_kv_heads} heads x {m.head_dim}, "
                 f"{m.dtype}, batch {res.run.batch_size})", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _grid(xs: list[int]) -> list[float]:
    lo, hi = min(xs), max(xs)
    return [lo * (hi / lo) ** (i / 40) for i in range(41)] if hi > lo else [lo]
