"""``attnprof whatif`` end to end on real vLLM servers of the tiny model: the cheapest
variant (``--max-model-len``) is measured against a baseline in paired rounds, its KV
capacity is vLLM's own log line (and, as vLLM sizes the cache by bytes, the baseline's), a
variant vLLM refuses yields its one-line reason, and the report carries predicted beside
measured. ``report --validate`` (the same run, inside report) is exercised end to end by the
privacy canary (tests/integration/test_privacy_canary.py, surface cli-whatif) on FP8."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnprof.contracts.report import Report
from attnprof.contracts.whatif import WhatifRun
from tests.golden import DEMO

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_LOG_KV = re.compile(r"KV cache size: ([\d,]+) tokens")


def _log_kv(path: Path) -> int:
    (found,) = _LOG_KV.findall(path.read_text())
    return int(found.replace(",", ""))


_BASE = "--kv-cache-memory-bytes 67108864 --no-enable-prefix-caching"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnprof.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_whatif_measures_max_model_len_and_says_why_a_variant_could_not_start(
        tiny_model: Path, tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    r = _run("whatif", str(DEMO), "--checkpoint", str(tiny_model), "--only", "max_model_len",
             "--variant", "--max-model-len 999999", "--baseline-args", _BASE, "--rounds", "2",
             "--duration", "1s", "--keep-logs", str(logs), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    run = WhatifRun.from_json(json.loads((out / "whatif.json").read_text()))
    by = {v.what_if: v for v in run.variants}
    mml = by["max_model_len"]
    assert mml.status == "measured" and mml.flags == ["--max-model-len 768"]
    # vLLM's own figure, read here from its log independently of the runner.
    assert mml.kv_capacity_tokens == _log_kv(logs / "whatif-max_model_len.log")
    assert mml.baseline_kv_capacity_tokens == _log_kv(logs / "whatif-baseline.log")
    # vLLM sizes its cache by bytes, not by max_model_len: the same capacity.
    assert mml.kv_capacity_tokens == mml.baseline_kv_capacity_tokens
    assert mml.rounds == 2 and mml.baseline is not None and mml.variant is not None
    assert len(mml.baseline.tokens_per_s) == len(mml.variant.tokens_per_s) == 2
    assert mml.variant.requests == mml.baseline.requests > 0
    assert mml.agreement is None  # a length cap cannot change outputs: not sampled
    assert {"tokens_per_s", "itl_p99", "ttft_p50"} <= set(mml.changes)

    refused = by["custom"]
    assert refused.status == "could_not_start" and refused.reason is not None
    assert "\n" not in refused.reason
    assert refused.reason.startswith("User-specified max_model_len (999999) is greater")
    assert "custom (--max-model-len 999999): could not start: User-specified" in r.stdout

    rep = Report.from_json(json.loads((out / "report.json").read_text()))
    w = next(x for x in rep.models[0].what_ifs if x.id == "max_model_len")
    assert w.evidence == "measured" and w.validation is not None
    checks = {c.metric: c for c in w.validation.checks}
    assert checks["kv_capacity"].predicted == 0.0 and checks["kv_capacity"].measured == 0.0
    assert not checks["kv_capacity"].off
    assert checks["refused_share"].measured == 0.0  # nothing replayed was above 768
    assert "Measured on real vLLM servers" in (out / "report.md").read_text()
