"""Every model family the transformers integration supports (GPT-2, BERT, Llama, ViT, BART,
T5), each on a tiny random-weight config built here: the activation map agrees with torch's
own trace of the same forward, encoder-decoder sites are labelled apart in every output, and
``attnprof profile`` runs on each (kernel map, reasons, memory, scaling)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import attnprof
from attnprof.cli import main
from attnprof.facts.shape import layer_label
from tests.integration.model_families import FAMILIES, build, inputs

FUSED_OP = "aten::_scaled_dot_product_flash_attention_for_cpu"
REPO = Path(__file__).resolve().parents[2]
ATTENTION_MODULES = {"gpt2": 2, "bert": 2, "llama": 2, "vit": 2, "bart": 6, "t5": 6}


def _ops_under(evt: Any) -> set[str]:
    """Names of every op torch's profiler recorded under one range (all depths)."""
    out: set[str] = set()
    stack = list(evt.cpu_children)
    while stack:
        e = stack.pop()
        out.add(e.name)
        stack.extend(e.cpu_children)
    return out


def _run(family: str, mode: str) -> tuple[Any, Any]:
    """One forward under attnprof and torch.profiler together; (profile, profiler)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = build(family, "eager" if mode == "eager" else "sdpa")
    batch = inputs(family)
    with torch.no_grad(), attnprof.profile(m) as prof, torch.profiler.profile() as tp:
        if mode == "math":  # every fused SDPA backend off: the dispatcher falls back
            with sdpa_kernel([SDPBackend.MATH]):
                m(**batch)
        else:
            m(**batch)
    return prof, tp


@pytest.mark.parametrize("mode", ["sdpa", "math", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_activation_map_matches_torch_trace(family: str, mode: str) -> None:
    """Per attention site: attnprof's map says fused exactly when torch's trace shows the
    fused SDPA op under that call (math/eager: softmax and matmuls, no fused op), and the
    calls it counts are the ranges torch recorded, one per attention module."""
    prof, tp = _run(family, mode)
    assert not prof.errors
    rows = prof.activation_map()
    sites = {layer_label(r["layer_idx"], r["stack"], r["kind"]) for r in rows}
    assert len(sites) == ATTENTION_MODULES[family]  # no module conflated with another
    ranges = [e for e in tp.events() if e.name.startswith("attn::")]
    impl = "eager" if mode == "eager" else "sdpa"
    assert Counter(e.name for e in ranges) == Counter(
        {f"attn::{s}::{impl}": 1 for s in sites})  # one call per module, named by site
    fused_by_site = {layer_label(r["layer_idx"], r["stack"], r["kind"]): r["fused"]
                     for r in rows}
    calls_by_site: Counter[str] = Counter()
    for r in rows:
        calls_by_site[layer_label(r["layer_idx"], r["stack"], r["kind"])] += r["calls"]
    assert all(n == 1 for n in calls_by_site.values())
    for e in ranges:
        site = e.name.split("::")[1]
        ops = _ops_under(e)
        if fused_by_site[site]:
            assert FUSED_OP in ops, (site, sorted(ops))
            assert "aten::softmax" not in ops and "aten::_softmax" not in ops
        else:
            assert FUSED_OP not in ops, (site, sorted(ops))
            assert {"aten::_softmax"} & ops or {"aten::softmax"} & ops, sorted(ops)
            assert ops & {"aten::bmm", "aten::matmul"}, sorted(ops)
    expected_fused = mode == "sdpa"
    assert all(r["fused"] is expected_fused for r in rows)
    if mode == "math":  # the reason says why: the fused backends were switched off
        assert all(r["kernel"] == "math" and r["reasons"] for r in rows)
    if mode == "eager":
        assert all(r["kernel"] == "eager" and r["reasons"][0]["code"] == "eager" for r in rows)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_encoder_decoder_sites_labelled_apart(family: str) -> None:
    """6 attention modules (2 encoder self, 2 decoder self, 2 cross) give 6 sites: cross-
    attention has no causal mask, the decoder's queries and the encoder's KV length."""
    m = build(family)
    enc, dec = 12, 5
    ids = torch.randint(1, 100, (1, enc))
    with torch.no_grad(), attnprof.profile(m) as prof:
        m(input_ids=ids, decoder_input_ids=ids[:, :dec])
    rows = prof.activation_map()
    got = [(r["stack"], r["layer_idx"], r["kind"]) for r in rows]
    assert got == [("encoder", 0, "self"), ("encoder", 1, "self"), ("decoder", 0, "self"),
                   ("decoder", 0, "cross"), ("decoder", 1, "self"), ("decoder", 1, "cross")]
    for r in rows:
        q, k = r["sdpa_args"]["query"][2], r["sdpa_args"]["key"][2]
        if r["kind"] == "cross":
            assert (q, k) == (dec, enc) and r["sdpa_args"]["is_causal"] is False
            if family == "bart":  # T5 adds its (zero) position bias as a float mask
                assert r["mask"] == "none"
        elif r["stack"] == "decoder":
            # Causal: by is_causal (BART), or in the float mask with the position bias (T5).
            assert (q, k) == (dec, dec)
            assert r["sdpa_args"]["is_causal"] is (family == "bart")
        else:
            assert (q, k) == (enc, enc) and r["sdpa_args"]["is_causal"] is False
    recs = {(r.stack, r.layer_idx, r.kind): (r.q_len, r.kv_len) for r in prof.records}
    assert recs[("decoder", 1, "cross")] == (dec, enc)
    layers = prof.layers()
    assert [x["label"] for x in layers] == ["encoder.L0", "encoder.L1", "decoder.L0",
                                            "decoder.L0.cross", "decoder.L1",
                                            "decoder.L1.cross"]
    # The picture's rows, one per site, named apart.
    from attnprof.contracts.profile import ActivationRow
    from attnprof.exporters import activation_map as am

    grid = am.grid_from_rows([ActivationRow.from_json(r) for r in rows], "t", 2)
    assert [grid.row_label(i) for i in range(len(grid.layers))] == [
        x["label"] for x in layers]
    assert b"decoder.L1.cross" in am.render(grid, "svg")
    assert "decoder.L0.cross" in am.markdown(grid)


def test_single_stack_models_keep_plain_labels() -> None:
    """Decoder-only and encoder-only models keep L<i> everywhere (no stack, no cross)."""
    for family in ("gpt2", "bert", "vit"):
        prof, _ = _run(family, "sdpa")
        rows = prof.activation_map()
        assert {(r["stack"], r["kind"]) for r in rows} == {(None, "self")}
        assert [r["layer_idx"] for r in rows] == [0, 1]


# ------------------------------------------------------------------ the `attnprof profile` CLI

SEQ_LENS = {"vit": "17,37"}  # n^2 patches + 1 class token


def _profile(tmp_path: Path, family: str, seq_lens: str) -> tuple[int, Path]:
    model_dir = tmp_path / family
    build(family).save_pretrained(model_dir)
    out = tmp_path / "out"
    rc = main(["profile", str(model_dir), "--seq-lens", seq_lens, "--paths", "flash_cpu,math",
               "--repeats", "1", "--no-validate", "--out", str(out)])
    return rc, out


@pytest.mark.parametrize("family", FAMILIES)
def test_profile_cli_on_each_family(tmp_path: Path, family: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    import jsonschema

    rc, out = _profile(tmp_path, family, SEQ_LENS.get(family, "16,32"))
    assert rc == 0
    prof = json.loads((out / "profile.json").read_text())
    jsonschema.validate(prof, json.loads(
        (REPO / "docs" / "schema" / "profile.schema.json").read_text()))
    n_sites = ATTENTION_MODULES[family]
    assert len(prof["layers"]) == n_sites
    labels = [layer_label(x["layer"], x["stack"], x["kind"]) for x in prof["layers"]]
    assert len(set(labels)) == n_sites
    # Memory per site and length, from the calls' own shapes.
    Ls = [int(x) for x in SEQ_LENS.get(family, "16,32").split(",")]
    for lay in prof["layers"]:
        peaks = lay["memory"]["attention_peak"]
        assert [p["seq_len"] for p in peaks] == Ls
        assert all(p["measured_peak_bytes"] > 0 and p["analytic_peak_bytes"] > 0
                   for p in peaks)
        for p in peaks:
            if family in ("bart", "t5"):
                dec = (p["seq_len"] + 1) // 2
                want = {("encoder", "self"): (p["seq_len"], p["seq_len"]),
                        ("decoder", "self"): (dec, dec),
                        ("decoder", "cross"): (dec, p["seq_len"])}[(lay["stack"], lay["kind"])]
            else:
                want = (p["seq_len"], p["seq_len"])
            assert (p["q_len"], p["kv_len"]) == want, (lay, p)
        assert all(c["kernel"] == "flash_cpu" for c in lay["shape_classes"])
    # Scaling: one model run per length and a fit through them.
    assert [r["seq_len"] for r in prof["scaling"]["by_seq_len"]] == Ls
    assert prof["scaling"]["fits"]["forward_time_s"] is not None
    if family in ("bart", "t5"):
        # The analytic KV cache holds decoder self KV and cross (encoder-length) KV.
        for r in prof["scaling"]["by_seq_len"]:
            assert r["kv_cache_bytes_analytic"] == r["kv_cache_bytes_measured"] > 0
    # trace.json names every site as the capture's ranges do.
    trace = json.loads((out / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "attention"}
    assert names == {f"attn::{s}::sdpa" for s in labels}
    # The terminal summary names cross-attention apart.
    text = capsys.readouterr().out
    if family in ("bart", "t5"):
        assert "decoder.L0.cross" in text and "encoder.L1" in text
    svg = (out / "activation_map.svg").read_text()
    assert all(s in svg for s in labels)


def test_profile_cli_refuses_vit_lengths_off_the_patch_grid(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _profile(tmp_path, "vit", "17,20")
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--seq-lens 20" in err and "n^2 patches + 1" in err and "17 or 26" in err
    assert not (out / "profile.json").exists()


# ------------------------------------------------ a family outside the registry: the module route


def test_module_route_for_attention_outside_the_registry(tmp_path: Path) -> None:
    """GPT-Neo's attention never calls transformers' registry: attnprof wraps the module's
    forward instead. The map's verdict matches torch's trace (its own softmax and matmuls, no
    fused op), outputs stay bit-identical, and uninstrument restores the class's forward."""
    m = build("gpt_neo")
    ids = torch.randint(1, 100, (1, 10))
    attn = m.transformer.h[0].attn.attention
    with torch.no_grad():
        ref = m(input_ids=ids).logits
        with attnprof.profile(m) as prof, torch.profiler.profile() as tp:
            out = m(input_ids=ids).logits
    assert torch.equal(ref, out)
    assert "forward" not in attn.__dict__  # the class's own forward again
    assert prof.module_route == ["transformer.h.0.attn.attention",
                                 "transformer.h.1.attn.attention"]
    assert not prof.errors
    rows = prof.activation_map()
    assert [(r["layer_idx"], r["impl"], r["kernel"], r["fused"], r["calls"]) for r in rows] == [
        (0, "module", "eager", False, 1), (1, "module", "eager", False, 1)]
    assert all(r["reasons"][0]["code"] == "no_registry" for r in rows)
    ranges = [e for e in tp.events() if e.name.startswith("attn::")]
    assert sorted(e.name for e in ranges) == ["attn::L0::module", "attn::L1::module"]
    for e in ranges:
        ops = _ops_under(e)
        assert FUSED_OP not in ops and "aten::_softmax" in ops and "aten::bmm" in ops
    # The profile CLI takes the same route and says so.
    model_dir = tmp_path / "gpt_neo"
    m.save_pretrained(model_dir)
    rc = main(["profile", str(model_dir), "--seq-lens", "16,32", "--paths", "flash_cpu",
               "--repeats", "1", "--no-validate", "--out", str(tmp_path / "out")])
    assert rc == 0
    prof_json = json.loads((tmp_path / "out" / "profile.json").read_text())
    assert {r["impl"] for r in prof_json["activation_map"]} == {"module"}
    assert all(lay["memory"]["attention_peak"] for lay in prof_json["layers"])
