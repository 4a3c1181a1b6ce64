"""The GPU check's verdict on a run (``benchmarks/whatif_gpu_check.py``, ``checks()``): it is
pure, so each check is tried here on a run that passes and on one that must fail, without
a GPU or a server. The passing run is the stored what-if
(``benchmarks/results/whatif/whatif.json``) cut to the shape the check runs: turns, two
instance pairs, two rounds."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from attnprof.contracts.whatif import RunHardware, WhatifRun

STORED = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "whatif" / "whatif.json"


@pytest.fixture(scope="module")
def gc() -> Any:
    from tests.conftest import load_benchmark

    return load_benchmark("whatif_gpu_check")


def _turns_run(gpu: bool = False) -> WhatifRun:
    """The stored run as the check's command writes one: turns, rounds on pairs [0, 1]."""
    run = WhatifRun.from_json(json.loads(STORED.read_text()))
    run.device_plan, run.rounds, run.instances = "turns", 2, 2
    for v in run.variants:
        v.rounds, v.instances = 2, 2
        for arm in (v.baseline, v.variant):
            assert arm is not None
            arm.instances = [0, 1]
            # Rounds 3 and 4 of the stored eight ran on instance 0 and instance 1.
            arm.ttft_per_request_s = arm.ttft_per_request_s[3:5]
            arm.itl_per_request_s = arm.itl_per_request_s[3:5]
    if gpu:
        run.hardware = RunHardware(device="cuda", name="NVIDIA H100 80GB HBM3", dtype="bfloat16")
        fp8 = next(v for v in run.variants if v.what_if == "fp8_kv")
        fp8.what_if = "custom"
    return run


def test_the_stored_run_cut_to_the_checks_shape_passes(gc: Any) -> None:
    assert gc.checks(_turns_run(), dry_run=True) == {
        "plan_is_turns": True, "aa_arm_present": True, "every_arm_measured": True,
        "two_pairs_per_arm": True, "per_request_values_paired": True,
        "own_provenance_beside_the_records": True}
    on_gpu = gc.checks(_turns_run(gpu=True), dry_run=False)
    assert on_gpu["hardware_is_the_gpu"] and on_gpu["fp8_measured"] and all(on_gpu.values())


def test_the_dry_run_skips_the_gpu_checks(gc: Any) -> None:
    assert not {"hardware_is_the_gpu", "fp8_measured"} & set(gc.checks(_turns_run(), True))


def test_empty_per_request_lists_fail_though_their_lengths_agree(gc: Any) -> None:
    run = _turns_run()
    for v in run.variants:
        assert v.baseline is not None and v.variant is not None
        v.baseline.ttft_per_request_s = v.variant.ttft_per_request_s = []
    assert gc.checks(run, True)["per_request_values_paired"] is False
    run = _turns_run()
    arm = run.variants[0].baseline
    assert arm is not None and run.variants[0].variant is not None
    arm.ttft_per_request_s = [[], []]
    run.variants[0].variant.ttft_per_request_s = [[], []]
    assert gc.checks(run, True)["per_request_values_paired"] is False


def test_per_request_lists_must_cover_every_round_and_pair_up(gc: Any) -> None:
    run = _turns_run()
    for v in run.variants:
        assert v.baseline is not None and v.variant is not None
        v.baseline.ttft_per_request_s = v.baseline.ttft_per_request_s[:1]
        v.variant.ttft_per_request_s = v.variant.ttft_per_request_s[:1]
    assert gc.checks(run, True)["per_request_values_paired"] is False
    run = _turns_run()
    arm = run.variants[1].variant
    assert arm is not None
    arm.ttft_per_request_s = [arm.ttft_per_request_s[0][:-1], arm.ttft_per_request_s[1]]
    out = gc.checks(run, True)
    assert out["per_request_values_paired"] is False
    assert all(ok for name, ok in out.items() if name != "per_request_values_paired")


def test_each_structural_check_fails_on_its_own_fault(gc: Any) -> None:
    run = _turns_run()
    run.device_plan = "side_by_side"
    assert gc.checks(run, True)["plan_is_turns"] is False

    run = _turns_run()
    run.variants = [v for v in run.variants if v.what_if != "aa"]
    assert gc.checks(run, True)["aa_arm_present"] is False
    run = _turns_run()
    next(v for v in run.variants if v.what_if == "aa").control = False
    assert gc.checks(run, True)["aa_arm_present"] is False

    run = _turns_run()
    run.variants[1].status = "failed"
    out = gc.checks(run, True)
    assert out["every_arm_measured"] is False and out["two_pairs_per_arm"] is True

    run = _turns_run()
    arm = run.variants[1].baseline
    assert arm is not None
    arm.instances = [0, 0]
    assert gc.checks(run, True)["two_pairs_per_arm"] is False
    run = _turns_run()
    run.variants[2].instances = 1
    assert gc.checks(run, True)["two_pairs_per_arm"] is False

    run = _turns_run()
    assert run.provenance is not None and run.source_provenance is not None
    run.provenance = copy.deepcopy(run.source_provenance)
    assert gc.checks(run, True)["own_provenance_beside_the_records"] is False
    run.provenance = None
    assert gc.checks(run, True)["own_provenance_beside_the_records"] is False


def test_a_cpu_run_or_a_missing_fp8_arm_fails_the_gpu_checks(gc: Any) -> None:
    out = gc.checks(_turns_run(), dry_run=False)
    assert out["hardware_is_the_gpu"] is False and out["fp8_measured"] is False
    run = _turns_run(gpu=True)
    next(v for v in run.variants if v.what_if == "custom").status = "failed"
    assert gc.checks(run, False)["fp8_measured"] is False
    run = _turns_run(gpu=True)
    assert run.hardware is not None
    run.hardware.name = None
    assert gc.checks(run, False)["hardware_is_the_gpu"] is False
