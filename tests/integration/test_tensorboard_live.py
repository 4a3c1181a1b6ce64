"""`attnprof tensorboard --url` and `attnprof snapshot --png` against the real tiny vLLM
server: the event files read back with TensorBoard's reader agree with the server's own
snapshot, and the picture's cells with its layers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from attnprof.tools.http import post_json
from tests.conftest import TINY_API_KEY, counted_snapshot, get_snapshot

pytestmark = pytest.mark.vllm


def _complete(srv: Any, prompt: str, n: int) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "min_tokens": n,
            "ignore_eos": True, "temperature": 0.0}
    post_json(srv.base_url + "/v1/completions", body, timeout=120)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ATTNPROF_API_KEY": TINY_API_KEY}
    return subprocess.run([sys.executable, "-m", "attnprof.cli", *args], capture_output=True,
                          text=True, timeout=180, env=env)


def test_tensorboard_logs_the_live_snapshot(tiny_server: Any, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    n = get_snapshot(tiny_server.base_url)["requests"]["requests"]
    _complete(tiny_server, "attention layer window cache " * 6, 4)
    _complete(tiny_server, "the model request", 3)
    # The stat logger counts a request a little after its answer: read once it has both, or
    # one counted between the tool's two reads (or after them) would be "traffic since".
    counted_snapshot(tiny_server.base_url, n + 2)
    logdir = tmp_path / "tb"
    r = _cli("tensorboard", "--url", tiny_server.base_url, "--logdir", str(logdir),
             "--count", "2", "--interval", "1s")
    assert r.returncode == 0, r.stderr
    snap = get_snapshot(tiny_server.base_url)  # no traffic since: the same aggregates
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0,
                                                        "tensors": 0})
    acc.Reload()
    # Step 0 holds the totals since the server started; step 1 the interval after it, in
    # which nothing ran: no per-layer, fused or share value is written for it.
    series = {t: acc.Scalars(t) for t in acc.Tags()["scalars"]}
    for tag, events in series.items():
        if tag.startswith(("attention/", "context/")):
            assert [e.step for e in events] == [0], tag
    last = {t: e[0] for t, e in series.items()}
    w = snap["workers"][0]
    calls = fused = 0
    for lay in w["layers"]:
        for ph, st in lay["phases"].items():
            if st["calls"]:
                tag = f"attention/layer_{lay['index']:02d}/time_ms/{ph}"
                assert last[tag].value == pytest.approx(st["mean_time_s"] * 1e3, rel=1e-6)
                calls += st["calls"]
                fused += st["calls"] if lay["fused"] else 0
    assert calls > 0
    assert last["attention/fused_fraction"].value == pytest.approx(fused / calls)
    for ph, st in w["steps"].items():
        if st["attention_share"] is not None:
            assert last[f"attention/share/{ph}"].value == pytest.approx(st["attention_share"],
                                                                        rel=1e-6)
    ctx = snap["requests"]["context_tokens"]
    for k in ("p50", "p90", "p99", "mean", "max"):
        assert last[f"context/{k}"].value == pytest.approx(ctx[k], rel=1e-6)
    adv = snap["window_advice"]
    if adv and "error" not in adv:
        assert last["window/attention_flop_saving"].value == pytest.approx(
            adv["attention_flop_saving"], rel=1e-6)
    text = acc.Tensors("kernel_map")[0].tensor_proto.string_val[0].decode()
    assert "CPU_ATTN (fused)" in text
    assert [e.step for e in acc.Images("activation_map")] == [0]  # unchanged map: drawn once


def test_snapshot_png_draws_the_live_layers(tiny_server: Any, tmp_path: Path) -> None:
    _complete(tiny_server, "the model request", 3)
    png = tmp_path / "maps" / "live.png"
    r = _cli("snapshot", "--url", tiny_server.base_url, "--png", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = (tmp_path / "maps" / "live.svg").read_text()
    snap = get_snapshot(tiny_server.base_url)
    from attnprof.contracts.snapshot import Snapshot
    from attnprof.exporters import activation_map as am

    grid = am.grid_from_snapshot(Snapshot.from_json(snap))
    colors = am.cell_color(grid)
    fills = {(int(m[1]), int(m[2])): m[3] for m in re.finditer(
        r'<g id="cell-(\d+)-(\d+)">\s*<path [^>]*style="fill: (#[0-9a-f]{6})', svg)}
    layers = sorted(snap["workers"][0]["layers"], key=lambda x: x["index"])
    assert len(grid.layers) == len(layers) == 2
    for i, lay in enumerate(layers):
        for j, col in enumerate(grid.columns):
            ran = lay["phases"].get(col.phase, {}).get("calls", 0) > 0
            want = colors[(lay["backend"], lay["fused"])] if ran else am.DEFAULT_PALETTE.missing
            assert fills[(i, j)] == want, (i, col)
    assert {c.phase for c in grid.columns} >= {"prefill", "decode"}
