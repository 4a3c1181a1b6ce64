"""OOM predictions against a model's positions and layer kinds (issue 13 items 5 and 7,
review): learned absolute position tables bound what can be run (--seq-lens refused, the
validation run skipped, never a traceback), and the analytic floor counts each attention
site's own mask and KV cache (encoders hold none; an encoder-decoder's decoder holds its own
ceil(L/2) tokens plus the encoder's L for cross-attention). Tiny random-weight models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from attnprof.analyze import memory, oom
from attnprof.cli import main
from attnprof.contracts.profile import ActivationRow
from attnprof.tools import model_inputs, profile_run
from tests.integration.model_families import build


def _gpt2(path: Path, n_positions: int = 64) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=n_positions,
        bos_token_id=0, eos_token_id=0)).save_pretrained(path)
    return path


@pytest.mark.parametrize(("family", "limit"), [
    ("gpt2", 256), ("bert", 256), ("bart", 256), ("llama", None), ("t5", None),
    ("vit", None)])
def test_position_limit_only_for_learned_absolute_tables(family: str, limit: int | None
                                                         ) -> None:
    """GPT-2 wpe, BERT position_embeddings, BART embed_positions (1026 rows, offset 2) are
    indexed by position; Llama (rotary), T5 (relative) and ViT (interpolated) run past."""
    m = build(family)
    assert model_inputs.position_limit(m) == limit
    if family == "bart":
        assert m.model.encoder.embed_positions.num_embeddings == 258


def test_profile_refuses_seq_lens_past_learned_positions(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _gpt2(tmp_path / "gpt2")
    out = tmp_path / "out"
    rc = main(["profile", str(ckpt), "--seq-lens", "32,128", "--paths", "flash_cpu",
               "--repeats", "1", "--no-validate", "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bars
    assert "--seq-lens 128" in err and "64 positions" in err and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


def test_validation_skipped_past_learned_positions(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Memory allows more than GPT-2's 64 positions: the validation run is skipped with the
    reason (it used to run the forward at L > 64 and end in an IndexError traceback)."""
    ckpt = _gpt2(tmp_path / "gpt2")
    out = tmp_path / "out"
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    static = profile_run._static_bytes(m)
    del m
    rc = main(["profile", str(ckpt), "--seq-lens", "16,32", "--paths", "flash_cpu",
               "--repeats", "1", "--memory-budget", str(static + (32 << 20)),
               "--out", str(out)])
    assert rc == 0
    o = json.loads((out / "profile.json").read_text())["oom_prediction"]
    assert o["model_max_context"] == 64 and o["max_seq_len"] > 64, o
    v = o["validation"]
    assert not v["planned"] and "past the model's 64 learned absolute positions" in v["skipped"]
    assert v.get("measured_peak_bytes") is None
    text = capsys.readouterr().out
    assert "validation skipped: L=" in text and "beyond the model's maximum context" in text


def _amap(prof: dict[str, Any]) -> list[ActivationRow]:
    return [ActivationRow.from_json(r) for r in prof["activation_map"]]


def _floor(prof: dict[str, Any], sites: list[oom.FloorSite] | None, L: int) -> float:
    m, o = prof["model"], prof["oom_prediction"]
    return oom.forward_floor(
        L, static_bytes=o["static_bytes"], batch=prof["run"]["batch_size"],
        num_heads=m["num_heads"], num_kv_heads=m["num_kv_heads"], head_dim=m["head_dim"],
        dtype=m["dtype"], layer_paths=["flash_cpu"] * m["num_layers"], sites=sites,
        threads=prof["environment"]["device"]["threads"], decoder_len=model_inputs.decoder_len)


def _profiled(tmp_path: Path, family: str, seq_lens: str) -> dict[str, Any]:
    build(family).save_pretrained(tmp_path / family)
    out = tmp_path / "out"
    rc = main(["profile", str(tmp_path / family), "--seq-lens", seq_lens, "--paths",
               "flash_cpu", "--repeats", "1", "--no-validate", "--out", str(out)])
    assert rc == 0
    return dict(json.loads((out / "profile.json").read_text()))


def test_encoder_floor_holds_no_kv_and_no_causal_mask(tmp_path: Path) -> None:
    """BERT: dense self-attention, no KV cache. The floor is below the old one (every layer
    a causal decoder with L tokens of KV) and below every measured peak."""
    prof = _profiled(tmp_path, "bert", "64,128")
    sites = oom.floor_sites(
        oom.run_sites(_amap(prof), prof["model"]["num_layers"]), False, None)
    assert [s.keeps_kv or s.causal for s in sites] == [False, False]
    for r in prof["scaling"]["by_seq_len"]:
        L = r["seq_len"]
        new, old = _floor(prof, sites, L), _floor(prof, None, L)
        assert new < old
        assert new <= r["peak_total_bytes"] and new <= r["attention_peak_total_bytes"]
    assert prof["oom_prediction"]["attention_sites"] == {"flash_cpu": ["L0", "L1"]}


def test_encoder_decoder_floor_uses_decoder_kv(tmp_path: Path) -> None:
    """BART: the encoder holds no KV; each decoder layer holds ceil(L/2) self KV and L cross
    KV, which is exactly the measured EncoderDecoderCache at the end of the forward."""
    prof = _profiled(tmp_path, "bart", "64,128")
    run = oom.run_sites(_amap(prof), prof["model"]["num_layers"])
    assert [s.label for s in run] == ["encoder.L0", "encoder.L1", "decoder.L0",
                                        "decoder.L0.cross", "decoder.L1", "decoder.L1.cross"]
    sites = oom.floor_sites(run, True, None)
    assert [(s.causal, s.keeps_kv, s.decoder, s.cross) for s in sites] == [
        (False, False, False, False)] * 2 + [
        (True, True, True, False), (False, True, True, True)] * 2
    m = prof["model"]
    for r in prof["scaling"]["by_seq_len"]:
        L, d = r["seq_len"], (r["seq_len"] + 1) // 2
        f = _floor(prof, sites, L)
        assert f <= r["peak_total_bytes"] and f <= r["attention_peak_total_bytes"]
        # Spelled out: KV written so far + each site's own call, maximised over sites.
        k = memory.kv_bytes_per_token(m["num_kv_heads"], m["head_dim"], m["dtype"])[
            "per_layer"]

        def a(q: int, kv: int, causal: bool) -> float:
            return memory.analytic_attention_peak(memory.AttnShape(
                1, m["num_heads"], m["num_kv_heads"], q, kv, m["head_dim"], m["head_dim"],
                m["dtype"]), "flash_cpu", causal=causal,
                threads=prof["environment"]["device"]["threads"])["total"]
        want = max(a(L, L, False), d * k + a(d, d, True), (d + L) * k + a(d, L, False),
                   (2 * d + L) * k + a(d, d, True), (2 * d + 2 * L) * k + a(d, L, False))
        assert f == pytest.approx(prof["oom_prediction"]["static_bytes"] + want)
        assert (2 * d + 2 * L) * k == r["kv_cache_bytes_measured"]
    o = prof["oom_prediction"]
    assert len(o["attention_sites"]["flash_cpu"]) == 6


def test_validated_extrapolation_says_why_it_is_high() -> None:
    from attnprof.exporters.terminal_profile import how_sure

    assert how_sure(65.0, True, "high", 256, validated=True) == (
        " (EXTRAPOLATION (validated): 65x the longest measured length (256), confidence high)")
    assert how_sure(65.0, True, "low", 256) == (
        " (EXTRAPOLATION: 65x the longest measured length (256), confidence low)")
