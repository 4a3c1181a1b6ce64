"""``attnprof diff`` end to end on real profiles of a tiny Llama: deliberate regressions exit 1
and name the layers and the reason; the same configuration exits 0 (10 of 10 fresh pairs);
bad or incomparable input is one line and exit 2 with nothing written; and a dtype the
fused kernel rejects, on vLLM's CPU backend, exits 1 naming the dtype."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attnprof.cli import main
from tests.conftest import build_tiny_model, run_py


def _profile(model: Path, out: Path, **kw: Any) -> Path:
    from attnprof.tools.profile_run import ProfileOptions, run_profile

    rep = run_profile(ProfileOptions(model_dir=model, model_name="tiny", seq_lens=[64, 128],
                                     repeats=5, paths=("flash_cpu",), validate=False, **kw))
    out.write_text(json.dumps(rep.to_json()))
    return out


@pytest.fixture(scope="module")
def profiles(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("diff")
    return {
        "base": _profile(tiny_model, d / "base.json"),
        "train": _profile(tiny_model, d / "train.json", train=True, attention_dropout=0.1),
        "eager": _profile(tiny_model, d / "eager.json", attn_implementation="eager"),
    }


def _diff(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    rc = main(["diff", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_train_mode_with_dropout_is_a_regression_naming_layers_and_reason(
        profiles: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, md, _ = _diff(capsys, profiles["base"], profiles["train"], "--markdown",
                      "--write-json", tmp_path / "d.json")
    assert rc == 1, md
    assert md.startswith("### attnprof diff: REGRESSION")
    assert ("| kernel | layers 0-1: flash_cpu -> math (fallback): dropout_p 0 -> 0.1; "
            "fallback reason: dropout |") in md
    assert "| fused-drop | fused fraction of calls: 100% -> 0% |" in md
    assert "- **run.train**: `False` -> `True`" in md
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["schema_version"] == "attnprof.diff/1.0" and doc["regression"] is True
    kern = [f for f in doc["findings"] if f["kind"] == "kernel"]
    assert kern[0]["layers"] == [0, 1] and kern[0]["evidence"]["reason_codes"] == ["dropout"]


def test_sdpa_to_eager_is_a_regression_naming_layers_and_reason(
        profiles: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc, md, _ = _diff(capsys, profiles["base"], profiles["eager"], "--markdown")
    assert rc == 1, md
    assert "layers 0-1: flash_cpu -> eager (fallback): attn_implementation sdpa -> eager" in md
    assert "- **model.attn_implementation**: `sdpa` -> `eager`" in md
    # Eager holds the score matrix: the OOM length the profile predicts drops too.
    assert "predicted max sequence length" in md
    # Thresholds from the command line: kernel and fused checks off leave the memory one.
    rc, text, _ = _diff(capsys, profiles["base"], profiles["eager"],
                        "--fail-on", "kernel=off,fused-drop=off,oom=off,time=off,share=off")
    assert rc == 0, text


def test_the_same_profile_and_fresh_profiles_of_one_configuration_exit_0(
        profiles: dict[str, Path], tiny_model: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, text, _ = _diff(capsys, profiles["base"], profiles["base"])
    assert rc == 0 and text.startswith("attnprof diff: no regression"), text
    # Noise must not trip it: 10 of 10 pairs of fresh profiles (same process, same model).
    for i in range(10):
        a = _profile(tiny_model, tmp_path / f"a{i}.json")
        b = _profile(tiny_model, tmp_path / f"b{i}.json")
        rc, text, _ = _diff(capsys, a, b)
        assert rc == 0, f"pair {i}:\n{text}"


def test_bad_or_incomparable_input_is_one_line_and_exit_2(
        profiles: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = json.loads(profiles["base"].read_text())
    trunc = tmp_path / "trunc.json"
    trunc.write_text(profiles["base"].read_text()[:500])
    other = tmp_path / "advice.json"
    other.write_text(json.dumps({"schema_version": "attnprof.window_advice/1.0"}))
    future = tmp_path / "future.json"
    future.write_text(json.dumps({**good, "schema_version": "attnprof.profile/9.0"}))
    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps({"schema_version": "attnprof.snapshot/1.5", "time": 1.0,
                                "model": "tiny", "enabled": True}))
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    out = tmp_path / "never.md"
    cases = [(trunc, "malformed JSON"), (other, "attnprof diff compares"),
             (future, "version 9 is not supported"), (snap, "a profile and"),
             (listing, "not an attnprof profile or snapshot"),
             (tmp_path / "missing.json", "cannot read")]
    for path, words in cases:
        rc, _, err = _diff(capsys, profiles["base"], path, "--write-markdown", out)
        assert rc == 2, path
        assert err.count("\n") == 1 and words in err, err
        assert not out.exists()
    rc, _, err = _diff(capsys, profiles["base"], profiles["base"], "--fail-on", "speed=1%")
    assert rc == 2 and "unknown check 'speed'" in err
    # Both outputs are checked before anything is written: no Markdown without its JSON.
    (tmp_path / "plain").write_text("a file, not a directory")
    rc, _, err = _diff(capsys, profiles["base"], profiles["train"], "--write-markdown", out,
                       "--write-json", tmp_path / "plain" / "d.json")
    assert rc == 2 and "--write-json" in err and not out.exists()


def test_two_models_need_allow_model_change(profiles: dict[str, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    other = build_tiny_model(tmp_path / "windowed", sliding_window=16)
    new = _profile(other, tmp_path / "windowed.json")
    rc, _, err = _diff(capsys, profiles["base"], new)
    assert rc == 2 and "different models" in err and "--allow-model-change" in err
    rc, text, _ = _diff(capsys, profiles["base"], new, "--allow-model-change")
    assert rc in (0, 1) and "model.config_sha256" in text


_VLLM_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
import attnprof
if __name__ == "__main__":
    out = {}
    llm = LLM(model=sys.argv[1], dtype=sys.argv[2], enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(["the model request server", "cache token layer attention window"] * 2, sp,
                 use_tqdm=False)
    json.dump(attnprof.snapshot(llm).to_json(), open(sys.argv[3], "w"))
"""


@pytest.mark.vllm
def test_a_dtype_the_fused_cpu_kernel_rejects_is_a_regression(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's AMX attention kernel needs AMX (every dtype runs [vec] here)")
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ATTNPROF_ENABLED": "1",
           "ATTNPROF_SAMPLE_RATE": "1.0"}
    files = {}
    for dtype in ("bfloat16", "float32"):
        files[dtype] = tmp_path / f"{dtype}.json"
        script = (_VLLM_SCRIPT.replace("sys.argv[1]", repr(str(tiny_model)))
                  .replace("sys.argv[2]", repr(dtype))
                  .replace("sys.argv[3]", repr(str(files[dtype]))))
        r = run_py(script, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    rc, md, _ = _diff(capsys, files["bfloat16"], files["float32"], "--markdown")
    assert rc == 1, md
    assert ("| kernel | layers 0-1: cpu_attention_with_kv_cache[amx] -> "
            "cpu_attention_with_kv_cache[vec]: dtype bfloat16 -> float32 |") in md
