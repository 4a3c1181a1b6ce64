"""``attnprof snapshot`` says which vLLM model runner each worker runs and whether attnprof
hooks it, and ``attnprof report`` warns about it: an empty profile from an unhooked runner says
why instead of showing nothing."""

from __future__ import annotations

import json
from typing import Any

from attnprof.contracts.snapshot import RunnerReport, Snapshot
from attnprof.exporters.terminal import render_snapshot
from tests.golden import DEMO


def _snap(runner: RunnerReport | None) -> dict[str, Any]:
    snap: dict[str, Any] = json.loads(DEMO.read_text())["snapshot"]
    snap["workers"][0]["runner"] = runner.to_json() if runner is not None else None
    return Snapshot.from_json(snap).to_json()  # as the contract reads it back


def test_unhooked_runner_is_said_before_the_empty_tables() -> None:
    text = render_snapshot(_snap(RunnerReport("unknown", "TPUModelRunner", False,
                                              "not hooked: TPUModelRunner")))
    line = "Model runner: unknown (TPUModelRunner): not hooked: TPUModelRunner: no step is " \
           "sampled or timed"
    assert line in text.splitlines()
    assert text.index(line) < text.index("Attention layers in worker")


def test_hooked_runners_and_their_caveat() -> None:
    v2 = render_snapshot(_snap(RunnerReport("v2", "GPUModelRunner", True,
                                            "hooked by construction, not run on a GPU")))
    assert ("Model runner: v2 (GPUModelRunner), hooked (hooked by construction, not run on a "
            "GPU)") in v2.splitlines()
    v1 = render_snapshot(_snap(RunnerReport("v1", "CPUModelRunner", True)))
    assert "Model runner: v1 (CPUModelRunner), hooked" in v1.splitlines()
    assert "Model runner" not in render_snapshot(_snap(None))  # an older snapshot: no line


def test_the_cost_report_warns_what_its_times_stand_on() -> None:
    from attnprof.tools.report_sources import from_snapshot

    unhooked = _snap(RunnerReport("unknown", "TPUModelRunner", False,
                                  "not hooked: TPUModelRunner"))
    inp, _ = from_snapshot(unhooked, "snap.json")
    assert ("a worker runs a vLLM model runner attnprof does not hook (not hooked: "
            "TPUModelRunner): no step of it is sampled or timed") in inp.warnings
    v2, _ = from_snapshot(_snap(RunnerReport("v2", "GPUModelRunner", True,
                                             "hooked by construction, not run on a GPU")),
                          "snap.json")
    assert [w for w in v2.warnings if "Model Runner V2" in w] == [
        "the workers run vLLM's Model Runner V2 (hooked by construction, not run on a GPU); "
        "a sampled step's time includes its input preparation"]
    v1, _ = from_snapshot(_snap(RunnerReport("v1", "CPUModelRunner", True)), "snap.json")
    assert not [w for w in v1.warnings if "runner" in w.lower()]
