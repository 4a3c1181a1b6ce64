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
    Chrome trace with the attention ranges, the plot as a PNG."""
    import jsonschema

    assert sorted(p.name for p in out.iterdir()) == ["profile.json", "scaling.png", "trace.json"]
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    prof = json.loads((out / "profile.json").read_text())
    jsonschema.validate(prof, schema)
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    for layer in prof["layers"]:
        assert f"attn::L{layer['layer']}::{layer['backend']}" in names
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return dict(prof)


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
    rc = main(["profile", str(ckpt), "--seq-lens", "32,64,128", "--memory-budget", "64MiB",
               "--out", str(out), "--repeats", "1", "--no-validate",
               "--attn-implementation", "eager"])
    assert rc == 0
    prof = validate_outputs(out)
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
