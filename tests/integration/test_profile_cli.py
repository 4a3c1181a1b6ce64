"""`attnprof profile` and `attnprof compat` end to end: outputs validated against the published
schema, the OOM prediction checked against a measured run, bad inputs fail in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from attnprof.cli import main

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "docs" / "schema" / "profile.schema.json"


def validate_outputs(out: Path) -> dict[str, Any]:
    """Every file `attnprof profile` writes: the JSON against the schema, the trace as a
    Chrome trace with the attention ranges, the plot and the activation map as PNG (and SVG)
    whose cells are coloured by the profile's own activation map."""
    import jsonschema

    assert sorted(p.name for p in out.iterdir()) == [
        "activation_map.png", "activation_map.svg", "profile.json", "roofline.png",
        "roofline.svg", "scaling.png", "trace.json"]
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    prof = json.loads((out / "profile.json").read_text())
    jsonschema.validate(prof, schema)
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    for layer in prof["layers"]:
        assert f"attn::L{layer['layer']}::{layer['backend']}" in names
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {k: v for k, v in prof["outputs"].items() if k != "tensorboard"} == {
        "profile": "profile.json", "trace": "trace.json", "plot": "scaling.png",
        "activation_map": "activation_map.png", "activation_map_svg": "activation_map.svg",
        "roofline": "roofline.png", "roofline_svg": "roofline.svg"}
    check_activation_map(out, prof)
    check_roofline(out, prof)
    return dict(prof)


def check_roofline(out: Path, prof: dict[str, Any]) -> None:
    """The roofline places every phase the profile ran against the probe's peaks, and the
    pictures draw each of them."""
    rl, probe = prof["roofline"], prof["probe"]
    assert rl["peak_bandwidth_bytes_per_second"] == probe["bandwidth_bytes_per_second"] > 0
    assert rl["peak_flops_per_second"] == probe["matmul_flops_per_second"] > 0
    assert [k["name"] for k in probe["kernels"]] == ["read", "copy", "triad", "matmul"]
    assert "prefill" in rl["phases"]
    for phase, p in rl["phases"].items():
        assert p["time_s"] > 0 and p["flops"] > 0 and p["kv_bytes"] <= p["bytes"]
        assert p["intensity_flops_per_byte"] == pytest.approx(p["flops"] / p["bytes"])
        assert p["bound"] == ("memory" if p["intensity_flops_per_byte"]
                              < rl["ridge_flops_per_byte"] else "compute")
        assert f"{phase} (all layers)".encode() in (out / "roofline.svg").read_bytes()
    assert (out / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_activation_map(out: Path, prof: dict[str, Any]) -> None:
    """The SVG's cell rects have the colour of the kernel/fused state the profile recorded for
    that layer and shape class, and the PNG is that same picture."""
    import re

    from attnprof.contracts.profile import ProfileReport
    from attnprof.exporters import activation_map as am

    grid = am.grid_from_profile(ProfileReport.from_json(prof))
    assert len(grid.layers) == prof["model"]["num_layers"]
    colors = am.cell_color(grid)
    fills = {(int(m[1]), int(m[2])): m[3] for m in re.finditer(
        r'<g id="cell-(\d+)-(\d+)">\s*<path [^>]*style="fill: (#[0-9a-f]{6})',
        (out / "activation_map.svg").read_text())}
    want = {}
    for r in prof["activation_map"]:
        j = next(j for j, c in enumerate(grid.columns) if (c.phase, c.mask, c.length_bucket)
                 == (r["phase"], r["mask"], r["length_bucket"]))
        want[(r["layer_idx"], j)] = colors[(r["kernel"], r["fused"])]
    assert {k: fills[k] for k in want} == want
    assert (out / "activation_map.png").read_bytes() == am.render(grid, "png")


def check_tensorboard(logdir: Path, prof: dict[str, Any]) -> None:
    """The profile's event file, read back by TensorBoard's reader: per-layer times against
    the profile's medians, fused fraction and attention share against its rows, the map."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event_file,) = logdir.iterdir()  # one file, moved in whole (no temp dir left)
    assert prof["outputs"]["tensorboard"] == str(event_file.resolve())
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0,
                                                        "tensors": 0})
    acc.Reload()
    got = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    for lay in prof["layers"]:
        tag = f"attention/layer_{lay['layer']:02d}/time_ms/prefill"
        assert got[tag] == {int(k): pytest.approx(v * 1e3, rel=1e-6) for k, v in
                            lay["timing"]["median_s_by_seq_len"].items()}, tag
    rows = [r for r in prof["activation_map"] if r["calls"]]
    assert got["attention/fused_fraction"] == {0: pytest.approx(
        sum(r["calls"] for r in rows if r["fused"]) / sum(r["calls"] for r in rows))}
    assert got["attention/share/prefill"] == {
        r["seq_len"]: pytest.approx(r["attention_s"] / r["forward_s"], rel=1e-6)
        for r in prof["scaling"]["by_seq_len"]}
    assert set(acc.Tags()["images"]) == {"activation_map", "scaling"}
    text = acc.Tensors("kernel_map")[0].tensor_proto.string_val[0].decode()
    assert all(f"{r['kernel']}" in text for r in rows)


def tiny_checkpoint(tmp: Path, impl: str) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, use_sliding_window=True, sliding_window=16,
                      max_window_layers=1, attn_implementation=impl)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp)
    return tmp


def test_profile_tiny_eager_model_gives_unfused_map_and_advice(tmp_path: Path,
                                                               capsys: Any) -> None:
    ckpt = tiny_checkpoint(tmp_path / "ckpt", "eager")
    out = tmp_path / "out"
    tb = tmp_path / "tb" / "run1"
    rc = main(["profile", str(ckpt), "--seq-lens", "32,64,128", "--memory-budget", "64MiB",
               "--out", str(out), "--repeats", "1", "--no-validate",
               "--attn-implementation", "eager", "--tensorboard", str(tb)])
    assert rc == 0
    prof = validate_outputs(out)
    check_tensorboard(tb, prof)
    assert prof["model"]["attn_implementation"] == "eager"
    assert all(not lay["fused"] and lay["kernels"] == ["eager"] for lay in prof["layers"])
    assert [lay["sliding_window"] for lay in prof["layers"]] == [None, 16]
    adv = prof["advice"][0]
    assert adv["reason"] == "eager" and "sdpa" in adv["change"]
    assert adv["layers"] == [0, 1] and adv["expected_gain"]["speedup"] > 0
    assert prof["oom_prediction"]["validation"]["skipped"] == "disabled (--no-validate)"
    text = capsys.readouterr().out
    assert "Kernel activation map" in text and "[eager]" in text
    # Privacy: nothing like token ids in the output.
    assert "input_ids" not in (out / "profile.json").read_text()


@pytest.mark.smollm2
@pytest.mark.slow
def test_profile_smollm2_end_to_end_and_oom_check(smollm2_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # 700 MiB over the weights: the fit over 64..256 must extrapolate ~4x and be checked.
    budget = 538060288 + (160 << 20)
    rc = main(["profile", "smollm2", "--seq-lens", "64,128,256", "--memory-budget",
               str(budget), "--out", str(out), "--repeats", "1"])
    assert rc == 0
    prof = validate_outputs(out)
    m = prof["model"]
    assert (m["num_layers"], m["num_heads"], m["num_kv_heads"], m["head_dim"]) == (30, 9, 3, 64)
    assert len(prof["layers"]) == 30
    # Default SDPA on CPU: the fused CPU kernel for prefill, padded prefill and decode.
    assert {(r["phase"], r["mask"]) for r in prof["activation_map"]} >= {
        ("prefill", "none"), ("prefill", "bool"), ("decode", "none")}
    assert all(r["kernel"] == "flash_cpu" and r["fused"] for r in prof["activation_map"])
    # Analytic KV bytes equal the real cache; per-layer attention peaks agree within 10%.
    for row in prof["scaling"]["by_seq_len"]:
        assert row["kv_cache_bytes_measured"] == row["kv_cache_bytes_analytic"]
    for lay in prof["layers"]:
        for p in lay["memory"]["attention_peak"]:
            assert p["rel_error"] < 0.10, (lay["layer"], p)
    o = prof["oom_prediction"]
    assert o["max_seq_len"] > 256
    v = o["validation"]
    assert v["planned"] and v["seq_len"] == o["max_seq_len"]
    assert v["rel_error"] < 0.05, v
    assert v["fits_budget"]
    assert o["confidence"] == "high"  # validated at the predicted length


@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.parametrize(("args", "path", "limit"), [
    # Default SDPA: the math what-if was 93,950 tokens in 24 GiB (318 GB of scores per call).
    (["--seq-lens", "128,256"], "flash_cpu", {"math": (24 << 30) / (9 * 9 + 4)}),
    # Every layer eager: two fp32 score matrices; the headline was 102,990.
    (["--attn-implementation", "eager", "--seq-lens", "256,512"], "eager",
     {"eager": (24 << 30) / (9 * 2 * 4)}),
])
def test_profile_smollm2_predictions_physics_allows(smollm2_dir: Path, tmp_path: Path,
                                                     args: list[str], path: str,
                                                     limit: dict[str, float]) -> None:
    """The issue's two examples: predictions within the score matrices' limit, for the path
    the model ran, with their extrapolation factor and confidence."""
    out = tmp_path / "out"
    assert main(["profile", "smollm2", *args, "--out", str(out), "--repeats", "1",
                 "--no-validate"]) == 0
    o = validate_outputs(out)["oom_prediction"]
    assert o["attention_paths"] == {path: list(range(30))}
    preds = {path: o, **o["if_attention_path"]}
    for p, cap in limit.items():
        assert 10_000 < preds[p]["max_seq_len"] <= min(cap**0.5, preds[p]["analytic_max_seq_len"])
    for p in preds.values():
        assert p["max_seq_len"] <= p["analytic_max_seq_len"]
        assert p["extrapolation"] is True and p["confidence"] == "low"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnprof.cli", *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.mark.parametrize("args", [
    ["profile", "/nonexistent/model"],
    ["profile", "smollm2", "--seq-lens", "512,-4"],
    ["profile", "smollm2", "--seq-lens", "abc"],
    ["profile", "smollm2", "--memory-budget", "lots"],
    ["profile", "smollm2", "--batch-size", "0"],
    ["profile", "smollm2", "--out", "/proc/attnprof-cannot-write"],
    ["compat", "--gpu", "tpu-v9"],
    ["compat", "--head-dim", "-3"],
    ["compat", "--dtype", "int3"],
])
def test_bad_inputs_one_line_exit_2(args: list[str], tmp_path: Path) -> None:
    proc = _cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnprof: error: "), proc.stderr


def test_unwritable_out_writes_nothing(tmp_path: Path) -> None:
    # A regular file where the output directory should go (chmod does not stop root).
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = _cli("profile", "smollm2", "--seq-lens", "8,16", "--out", str(blocker / "out"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("attnprof: error: cannot create output directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_compat_cli_answers_case(capsys: Any) -> None:
    assert main(["compat", "--head-dim", "96", "--dtype", "bf16", "--gpu", "h100", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert "flash_attn_3" in rep["active"]
    assert rep["vllm"]["selected"] == "FLASH_ATTN" and rep["vllm"]["flash_attn_version"] == 3
    fi = next(b for b in rep["vllm"]["backends"] if b["backend"] == "FLASHINFER")
    assert fi["reasons"] == ["head_size not supported"]


def test_profile_with_traffic_adds_the_window_advice(tmp_path: Path, capsys: Any) -> None:
    ckpt = tiny_checkpoint(tmp_path / "ckpt", "sdpa")
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [20, 40, 60, 100, 120, 400, 900]) + "\n")
    out = tmp_path / "out"
    rc = main(["profile", str(ckpt), "--seq-lens", "32,64", "--memory-budget", "64MiB",
               "--out", str(out), "--repeats", "1", "--no-validate", "--lengths", str(lengths)])
    assert rc == 0
    prof = validate_outputs(out)  # schema-checked, window_advice included
    adv = prof["window_advice"]
    capsys.readouterr()
    # The same traffic through suggest-window gives the same recommendation.
    assert main(["suggest-window", "--lengths", str(lengths), "--model", str(ckpt),
                 "--json"]) == 0
    sw = json.loads(capsys.readouterr().out)
    for key in ("sinks", "window", "attention_flop_saving", "kv_memory_saving",
                "exact_request_fraction"):
        assert adv[key] == sw[key], key


def test_profile_bad_lengths_file_fails_before_profiling(tmp_path: Path) -> None:
    ckpt = tiny_checkpoint(tmp_path / "ckpt", "sdpa")
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nabc\n")
    r = subprocess.run([sys.executable, "-m", "attnprof.cli", "profile", str(ckpt),
                        "--lengths", str(bad), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing written
