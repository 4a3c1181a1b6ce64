"""``attnprof whatif`` end to end on real vLLM servers of the tiny model: an A/A control
arm and the cheapest variant (``--max-model-len``) are each measured on a fresh
baseline/variant pair in paired rounds sized by ``--mde`` from the A/A's pilot, replaying the
same requests per round (per-request values paired by position); the variant's KV capacity is
vLLM's own log line (and, as vLLM sizes the cache by bytes, the baseline's), a variant vLLM
refuses yields its one-line reason, whatif.json holds this run's own provenance and hardware
beside the record's, and the report carries predicted beside measured, the A/A as its noise
floor, and a measurement on other hardware than the record's beside the estimate, never as
its money. ``report --validate`` (the same run, inside report) is exercised end to end by the
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


# The golden record's command line is not a vLLM server's (no flags to replay, not eager):
# eager here keeps the tiny servers' start-up short.
_BASE = "--kv-cache-memory-bytes 67108864 --no-enable-prefix-caching --enforce-eager"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnprof.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_whatif_measures_max_model_len_and_says_why_a_variant_could_not_start(
        tiny_model: Path, tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    r = _run("whatif", str(DEMO), "--checkpoint", str(tiny_model), "--only", "max_model_len",
             "--variant", "--max-model-len 999999", "--baseline-args", _BASE, "--mde", "0.001",
             "--max-rounds", "4", "--duration", "1s", "--keep-logs", str(logs),
             "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    # An MDE of 0.1% is out of reach in 4 rounds of 1 s: the cap binds, and says so.
    assert "pilot: per-round log-ratio SD" in r.stderr and "the cap of 4 binds" in r.stderr
    run = WhatifRun.from_json(json.loads((out / "whatif.json").read_text()))
    by = {v.what_if: v for v in run.variants}
    assert run.mde == 0.001 and run.rounds == 4 and run.device_plan == "side_by_side"
    assert run.instances == 2

    aa = by["aa"]  # always run, first: a second baseline measured like a variant
    assert aa.control and aa.flags == [] and aa.status == "measured"
    mml = by["max_model_len"]
    assert mml.status == "measured" and mml.flags == ["--max-model-len 768"]
    assert not mml.control and mml.rounds == aa.rounds == run.rounds == 4
    # Two fresh instance pairs per arm: the A/A's first ran the 3 pilot rounds.
    assert aa.instances == mml.instances == 2
    assert aa.variant is not None and aa.variant.instances == [0, 0, 0, 1]
    assert mml.variant is not None and mml.variant.instances == [0, 0, 1, 1]
    for res in (aa, mml):
        assert res.baseline is not None and res.variant is not None
        assert res.baseline.instances == res.variant.instances
        b, v = res.baseline.ttft_per_request_s, res.variant.ttft_per_request_s
        assert len(b) == len(v) == run.rounds
        assert [len(x) for x in b] == [len(x) for x in v] == \
            [len(x) for x in res.variant.itl_per_request_s]
        assert all(t is not None and t > 0 for x in b + v for t in x)
    # Round r replays the same requests in every arm.
    assert aa.baseline is not None and mml.baseline is not None
    assert [len(x) for x in aa.baseline.ttft_per_request_s] == \
        [len(x) for x in mml.baseline.ttft_per_request_s]
    # vLLM's own figure, read here from its log independently of the runner.
    assert mml.kv_capacity_tokens == _log_kv(logs / "whatif-max_model_len-0.log")
    assert mml.baseline_kv_capacity_tokens == _log_kv(logs / "whatif-aa-base0.log") == \
        _log_kv(logs / "whatif-max_model_len-base1.log")
    # vLLM sizes its cache by bytes, not by max_model_len: the same capacity.
    assert mml.kv_capacity_tokens == mml.baseline_kv_capacity_tokens
    assert mml.agreement is None  # a length cap cannot change outputs: not sampled
    assert {"tokens_per_s", "ttft_p50", "itl_p50"} <= set(mml.changes)

    refused = by["custom"]
    assert refused.status == "could_not_start" and refused.reason is not None
    assert "\n" not in refused.reason
    assert refused.reason.startswith("User-specified max_model_len (999999) is greater")
    assert "custom (--max-model-len 999999): could not start: User-specified" in r.stdout

    # This run's own provenance and hardware beside the record's.
    assert run.source_provenance is not None and run.source_provenance.command == [
        "attnprof", "golden"]
    assert run.provenance is not None and "whatif" in run.provenance.command
    assert run.hardware is not None and run.hardware.device == "cpu"
    assert run.hardware.dtype == "float32" and "vLLM's defaults" in run.baseline_basis
    assert run.baseline_flags[:2] == ["--max-model-len", "1024"]

    rep = Report.from_json(json.loads((out / "report.json").read_text()))
    model = rep.models[0]
    assert model.noise_floor is not None and model.noise_floor.control
    w = next(x for x in model.what_ifs if x.id == "max_model_len")
    assert w.validation is not None
    checks = {c.metric: c for c in w.validation.checks}
    assert checks["kv_capacity"].predicted == 0.0 and checks["kv_capacity"].measured == 0.0
    assert checks["kv_capacity"].verdict == "confirmed"
    assert checks["refused_share"].measured == 0.0  # nothing replayed was above 768
    # The golden record ran on a CPU named "cpu": this machine's is another, so the
    # measurement is shown beside the estimate, never adopted as its money.
    assert w.evidence != "measured" and w.measured_beside is not None
    assert w.measured_beside.mismatch.startswith("hardware: measured on ")
    assert "Measured on real vLLM servers" in (out / "report.md").read_text()
