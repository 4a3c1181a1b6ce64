"""The kernel activation map picture: grids built from a profile and a live snapshot, and the
colours of the drawn cells (PNG pixels and SVG rects) checked against the grid's data."""

from __future__ import annotations

import io
import re
from collections import Counter
from typing import Any

import pytest

from attnprof.contracts.profile import ActivationRow
from attnprof.contracts.snapshot import Snapshot
from attnprof.exporters import activation_map as am

# Distinct, non-default colours: a cell drawn from the wrong entry cannot pass by chance.
PALETTE = am.Palette(fused=("#10a020", "#2050c0"), fallback=("#c01010", "#e08000"),
                     fixed={("eager", False): "#e08000"}, missing="#d0d0d0")


def _row(layer: int, phase: str, mask: str, bucket: int, kernel: str, fused: bool,
         reasons: tuple[str, ...] = (), calls: int = 2) -> ActivationRow:
    return ActivationRow.from_json({
        "layer_idx": layer, "impl": "sdpa", "phase": phase, "mask": mask,
        "length_bucket": bucket, "dtype": "float32", "kernel": kernel, "fused": fused,
        "reasons": [{"code": c, "message": f"why {c}"} for c in reasons],
        "ops": [], "calls": calls, "time_s": 0.001 * calls})


def mixed_rows() -> list[ActivationRow]:
    """Six layers: 0-1 fused, 2-3 math (dropout), 4 eager, 5 fused but no decode call."""
    rows = []
    for layer in range(6):
        for phase, mask, bucket in (("prefill", "none", 128), ("prefill", "bool", 64),
                                    ("decode", "none", 128)):
            if layer == 5 and phase == "decode":
                continue
            if layer in (2, 3):
                rows.append(_row(layer, phase, mask, bucket, "math", False, ("dropout",)))
            elif layer == 4:
                rows.append(_row(layer, phase, mask, bucket, "eager", False, ("eager",)))
            else:
                rows.append(_row(layer, phase, mask, bucket, "flash_cpu", True))
    return rows


def test_grid_from_profile_rows_one_row_per_layer_one_column_per_shape_class() -> None:
    grid = am.grid_from_rows(mixed_rows(), "t", num_layers=7)
    assert grid.layers == tuple(range(7))  # layer 6 had no call: still a row
    assert [(c.phase, c.mask, c.length_bucket) for c in grid.columns] == [
        ("prefill", "bool", 64), ("prefill", "none", 128), ("decode", "none", 128)]
    assert grid.cells[0][0] == am.Cell("flash_cpu", True, (), calls=2, time_s=0.002)
    assert grid.cells[2][1] is not None and grid.cells[2][1].look == ("math", False,
                                                                        ("dropout",))
    assert grid.cells[5][2] is None and all(c is None for c in grid.cells[6])
    assert grid.cells[2][0] is not None and grid.cells[2][0].text == "math: dropout"
    assert grid.cells[4][0] is not None and grid.cells[4][0].text == "eager (fallback)"
    assert grid.cells[0][0] is not None and grid.cells[0][0].text == "flash_cpu (fused)"
    assert am.row_groups(grid) == [(0, 1), (2, 3), (4, 4), (5, 5), (6, 6)]
    assert grid.reasons == {"dropout": "why dropout", "eager": "why eager"}
    md = am.markdown(grid)
    assert "| 0-1 | flash_cpu (fused) |" in md and "| 2-3 | **math** (fallback: dropout) |" in md


def _expected_colors(grid: am.Grid) -> list[list[str]]:
    colors = am.cell_color(grid, PALETTE)
    return [[PALETTE.missing if c is None else colors[c.key] for c in row]
            for row in grid.cells]


def _hex(rgb: Any) -> str:
    return "#" + "".join(f"{int(v):02x}" for v in rgb[:3])


def _dominant(img: Any, box: tuple[float, float, float, float]) -> str:
    """The most common colour inside a cell (text and antialiased edges are a minority)."""
    h, w = img.shape[:2]
    x0, y0, x1, y1 = box
    # Figure fractions (y up) -> pixel rows/columns, 3 px inside the white cell border.
    c0, c1 = int(x0 * w) + 3, int(x1 * w) - 3
    r0, r1 = int((1 - y1) * h) + 3, int((1 - y0) * h) - 3
    assert c1 > c0 and r1 > r0, (box, img.shape)
    pix = Counter(_hex(img[r, c]) for r in range(r0, r1) for c in range(c0, c1))
    return pix.most_common(1)[0][0]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["profile", "snapshot"])
def test_png_cell_colours_match_the_grid(source: str) -> None:
    import numpy as np
    from PIL import Image

    grid = (am.grid_from_rows(mixed_rows(), "t", num_layers=7) if source == "profile"
            else am.grid_from_snapshot(Snapshot.from_json(live_snapshot())))
    png = am.render(grid, "png", PALETTE)
    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    lay = am.layout(grid)
    want = _expected_colors(grid)
    got = [[_dominant(img, lay.cell_box(i, j)) for j in range(len(grid.columns))]
           for i in range(len(grid.layers))]
    assert got == want
    # And the palette really separates fused from fallback here.
    flat = {c for row in want for c in row}
    assert flat >= ({"#10a020", "#c01010", "#e08000", "#d0d0d0"} if source == "profile"
                    else {"#10a020", "#c01010", "#d0d0d0"})


def _svg_fills(svg: str) -> dict[tuple[int, int], str]:
    out = {}
    for m in re.finditer(r'<g id="cell-(\d+)-(\d+)">\s*<path [^>]*style="fill: (#[0-9a-f]{6})',
                         svg):
        out[(int(m.group(1)), int(m.group(2)))] = m.group(3)
    return out


def test_svg_rects_carry_the_grid_colours_and_reason_codes() -> None:
    grid = am.grid_from_rows(mixed_rows(), "t", num_layers=7)
    svg = am.render(grid, "svg", PALETTE).decode()
    want = _expected_colors(grid)
    fills = _svg_fills(svg)
    assert fills == {(i, j): want[i][j] for i in range(7) for j in range(3)}
    # The reason code is written in the fallback cells, the kernel in the fused ones.
    assert "math: dropout" in svg and "flash_cpu (fused)" in svg and "eager (fallback)" in svg
    assert "layers 0-1" in svg and "layers 2-3" in svg  # identical rows bracketed
    for i in range(7):
        assert f">L{i}<" in svg  # every layer keeps its own row label
    assert am.render(grid, "svg", PALETTE).decode() == svg  # deterministic bytes


def live_snapshot() -> dict[str, Any]:
    """Two tensor-parallel workers holding the same 4 layers; layer 3 unfused (vLLM's
    rejections as the reason), layer 1 never ran decode."""
    def layer(i: int, fused: bool, phases: dict[str, int]) -> dict[str, Any]:
        return {"name": f"model.layers.{i}.self_attn.attn", "index": i,
                "backend": "CPU_ATTN" if fused else "TORCH_SDPA",
                "impl": "X", "num_heads": 4, "num_kv_heads": 2, "head_size": 64,
                "head_size_v": 64, "sliding_window": None, "dtype": "float32",
                "kv_cache_dtype": "auto", "fused": fused,
                "kernel": "cpu_attention_with_kv_cache[vec]" if fused else None,
                "phases": {p: {"calls": n, "time_s": 0.001 * n, "mean_time_s": 0.001}
                           for p, n in phases.items()}}

    both = {"prefill": 2, "decode": 5}
    layers = [layer(0, True, both), layer(1, True, {"prefill": 2}), layer(2, True, both),
              layer(3, False, both)]
    groups = [{"layers": [0, 1, 2], "backend": "CPU_ATTN", "kernel": "k", "fused": True},
              {"layers": [3], "backend": "TORCH_SDPA", "kernel": None, "fused": False,
               "rejected": {"CPU_ATTN": ["head_size not supported"]}}]
    worker = {"pid": 1, "layers": layers, "kernel_map": groups}
    other = {"pid": 2, "layers": [layer(0, False, both)], "kernel_map": []}  # rank 1: ignored
    return {"schema_version": Snapshot.version_tag(), "time": 1.0, "model": "tiny",
            "enabled": True, "workers": [worker, other]}


def test_grid_from_live_snapshot_columns_are_the_phases_that_ran() -> None:
    grid = am.grid_from_snapshot(Snapshot.from_json(live_snapshot()))
    assert grid.layers == (0, 1, 2, 3)
    assert [c.phase for c in grid.columns] == ["prefill", "decode"]
    assert grid.cells[0][0] is not None and grid.cells[0][0].look == ("CPU_ATTN", True, ())
    assert grid.cells[1][1] is None
    c = grid.cells[3][1]
    assert c is not None and c.look == ("TORCH_SDPA", False,
                                        ("CPU_ATTN: head_size not supported",))
    assert grid.details == {"CPU_ATTN": "cpu_attention_with_kv_cache[vec]"}


def test_live_snapshot_before_any_sampled_call_shows_the_backends() -> None:
    snap = live_snapshot()
    for w in snap["workers"]:
        for lay in w["layers"]:
            lay["phases"] = {}
    grid = am.grid_from_snapshot(Snapshot.from_json(snap))
    assert [c.phase for c in grid.columns] == ["any phase"]
    assert [row[0].kernel for row in grid.cells if row[0] is not None] == [
        "CPU_ATTN", "CPU_ATTN", "CPU_ATTN", "TORCH_SDPA"]
    assert am.render(grid, "png")[:8] == b"\x89PNG\r\n\x1a\n"


def test_empty_grid_still_renders() -> None:
    grid = am.grid_from_rows([], "nothing ran", num_layers=0)
    assert grid.layers == () and grid.columns == ()
    assert am.render(grid, "png")[:4] == b"\x89PNG"
