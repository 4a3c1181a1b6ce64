"""What ``attnprof whatif`` (and ``report --validate``) prints once the run is over: each
variant's predicted beside measured, and where a prediction is off."""

from __future__ import annotations

from attnprof.contracts.report import Report
from attnprof.contracts.whatif import WhatifRun
from attnprof.exporters.report_validation import variant_lines

__all__ = ["run_lines"]


def run_lines(run: WhatifRun, rep: Report) -> list[str]:
    """The run's summary: the traffic replayed, then each variant."""
    t = run.traffic
    out = [f"What-ifs measured on real vLLM servers ({run.rounds} paired rounds of "
           f"{run.duration_s:g} s per arm, concurrency {t.concurrency}, {t.output_tokens} "
           f"tokens out per request; changes are variant vs baseline with 95% intervals):"]
    by_id = {w.id: w for m in rep.models for w in m.what_ifs}
    for res in run.variants:
        w = by_id.get(res.what_if)
        out += variant_lines(res, w.validation if w is not None else None)
    off = [w.id for w in by_id.values() if w.validation is not None and w.validation.off]
    if off:
        out.append(f"Off by more than the stated confidence: {', '.join(off)} (see the "
                   "report's predicted-vs-measured tables)")
    return out
