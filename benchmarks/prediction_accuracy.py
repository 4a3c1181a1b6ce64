"""The bands a measured what-if's predictions are judged with, from how accurate they have
proven: every run under ``benchmarks/results/whatif*`` (its whatif.json and report.json), each
stored prediction judged again with today's statistics, the misses a run resolved kept as
evidence (``attnprof.analyze.whatif.ACCURACY_RULE``).

Run: ``python benchmarks/prediction_accuracy.py [RUN_DIR ...]`` (default: the kept history,
every benchmarks/results/whatif-* holding both files, a run copied under two names counted
once; never ``whatif/``, the latest run, which is judged with these bands out of sample and
joins the history when it is copied to a ``whatif-*`` directory); writes
plugin/attnprof/analyze/data/prediction_accuracy.json. A new run changes a band only when it
resolves a larger miss than the history holds. ``--check`` exits 1 when the file differs from
what the history gives (a unit test runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnprof.analyze.whatif import ACCURACY_FILE, accuracy_table, evidence, revalidate
from attnprof.contracts.report import Report
from attnprof.contracts.whatif import WhatifRun

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("runs", nargs="*", type=Path,
                    help="run directories (each with whatif.json and report.json)")
    ap.add_argument("--out", type=Path, default=ACCURACY_FILE)
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when --out differs from what the runs give; write nothing")
    a = ap.parse_args(argv)
    # The kept history only (whatif-*, sorted; never whatif/, the latest run): a run kept
    # under two names counts under the first in that order.
    found = a.runs or sorted(d for d in RESULTS.glob("whatif-*")
                             if (d / "whatif.json").is_file() and (d / "report.json").is_file())
    runs: list[Path] = []
    seen: set[bytes] = set()
    for d in found:  # a run kept under two names (a copy in the history) counts once
        key = (d / "whatif.json").read_bytes()
        if key not in seen:
            seen.add(key)
            runs.append(d)
    rows = []
    for d in runs:
        run = WhatifRun.from_json(json.loads((d / "whatif.json").read_text()))
        rep = Report.from_json(json.loads((d / "report.json").read_text()))
        name = str(d.resolve().relative_to(ROOT)) if d.resolve().is_relative_to(ROOT) else d.name
        by_id = {w.id: w for m in rep.models for w in m.what_ifs}
        for res in run.variants:
            w = by_id.get(res.what_if)
            if w is None or w.validation is None or res.control:
                continue
            rows += evidence(revalidate(w.validation, res, run, w.id), name, w.id)
    table = accuracy_table(rows)
    out = {"generated_by": "python benchmarks/prediction_accuracy.py",
           "runs": [str(d.resolve().relative_to(ROOT)) if d.resolve().is_relative_to(ROOT)
                    else d.name for d in runs], **table}
    text = json.dumps(out, indent=1) + "\n"
    if a.check:
        same = a.out.is_file() and a.out.read_text(encoding="utf-8") == text
        print(f"{a.out}: {'up to date' if same else 'differs from the history: regenerate'}")
        return 0 if same else 1
    a.out.write_text(text, encoding="utf-8")
    for metric, b in table["bands"].items():
        print(f"{metric:<18} +/- {b['band'] * 100:.1f} pts  ({b['basis']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
