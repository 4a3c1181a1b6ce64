"""docs/live-capture.md's "seen and not seen, from a run" block: the generator's rendering of
the committed run record, byte for byte, in the generator's format; and every drop reason the
capture code counts has its meaning in the catalog the block reads."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from attnprof.facts.drop_reasons import DROP_REASONS
from tests import coverage_doc

PLUGIN = Path(__file__).resolve().parents[3] / "plugin" / "attnprof"


def test_the_docs_block_is_the_rendering_of_the_committed_run() -> None:
    run = json.loads(coverage_doc.RUN.read_text())
    assert coverage_doc.block_of(coverage_doc.DOC.read_text()) == coverage_doc.render(run)
    assert coverage_doc.main(["--check"]) == 0


def test_the_docs_block_has_the_generators_format() -> None:
    lines = coverage_doc.block_of(coverage_doc.DOC.read_text()).splitlines()
    assert lines[0] == coverage_doc.BEGIN and lines[-1] == coverage_doc.END
    assert coverage_doc.TABLE_HEADER in lines and coverage_doc.REASON_HEADER in lines
    rows = [ln for ln in lines if ln.startswith("| prefill |") or ln.startswith("| decode |")]
    assert {r.split(" | ")[0] for r in rows} == {"| prefill", "| decode"}
    reasons = [ln.split("`")[1] for ln in lines if ln.startswith("| `")]
    assert reasons == list(DROP_REASONS)  # every reason, none outside the catalog
    assert any(ln.startswith("vLLM flags: `") and "--enable-chunked-prefill" in ln
               for ln in lines)
    assert any(ln.startswith("Worker 0: runner `") for ln in lines)


def _run(buckets: list[dict[str, object]], dropped: dict[str, int]) -> dict[str, object]:
    return {"date": "2026-01-02", "vllm": "9.9", "flags": ["--x"], "env": {"A": "1"},
            "traffic": {"description": "t", "requests": 1},
            "coverage": {"min_tokens": 32, "buckets": buckets, "phases": [
                {"phase": "prefill", "folded_requests": 1, "traffic_requests": 2,
                 "traffic_query_share": 0.5}]},
            "workers": [{"runner": {"runner": "v1", "runner_class": "C", "hooked": True},
                         "graph_modes": {"NONE": 3}, "steps_seen": 4, "steps_sampled": 3,
                         "dropped": dropped}]}


def test_render_rows_reasons_and_runner() -> None:
    seen = {"phase": "prefill", "bucket": 256, "hi": 512, "traffic_requests": 2,
            "traffic_queries": 700, "folded_requests": 1, "folded_queries": 350.25,
            "query_share": 0.5, "sampled_queries": 40}
    unseen = {**seen, "phase": "decode", "bucket": 512, "hi": None, "traffic_requests": 0,
              "folded_requests": 0, "sampled_queries": 0}
    text = coverage_doc.render(_run([seen, unseen], {"head_stats_queue_full": 5, "new": 1}))
    assert "| prefill | 256-512 | 2 | 700 | 1 | 350.2 | 50% | 40 |" in text
    assert "| decode |" not in text  # a bucket the traffic never reached
    assert f"| `head_stats_queue_full` | 5 | {DROP_REASONS['head_stats_queue_full']} |" in text
    assert "| `capture_error` | 0 |" in text
    assert "| `new` | 1 | (not in the catalog) |" in text
    assert "prefill 1 of 2 requests folded, 50% of its query tokens" in text
    assert "runner `v1` (`C`), hooked: True; steps sampled 3 of 4; " \
           "graph modes of sampled steps: NONE 3." in text


def _string_constants() -> dict[str, str]:
    """Module-level ``NAME = "..."`` assignments across the plugin."""
    out: dict[str, str] = {}
    for path in PLUGIN.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node.value.value
    return out


def test_every_reason_the_capture_drops_is_in_the_catalog() -> None:
    consts = _string_constants()
    found: set[str] = set()
    for path in PLUGIN.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "drop" and len(node.args) == 1):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.add(arg.value)
            else:
                name = arg.attr if isinstance(arg, ast.Attribute) else getattr(arg, "id", None)
                assert name in consts, f"{path}:{node.lineno}: drop reason not a known constant"
                found.add(consts[name])
    found.discard("")
    assert found and found <= set(DROP_REASONS), sorted(found - set(DROP_REASONS))
    assert set(DROP_REASONS) <= found, sorted(set(DROP_REASONS) - found)  # none stale
