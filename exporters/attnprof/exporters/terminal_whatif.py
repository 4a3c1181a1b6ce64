"""What ``attnprof whatif`` (and ``report --validate``) prints once the run is over: the noise
floor (the A/A arm), each variant's predicted beside measured with its verdict (confirmed,
OFF, inconclusive), and which what-ifs are off."""

from __future__ import annotations

from attnprof.contracts.report import Report
from attnprof.contracts.whatif import WhatifRun
from attnprof.exporters.report_validation import variant_lines

__all__ = ["run_lines"]


def run_lines(run: WhatifRun, rep: Report) -> list[str]:
    """The run's summary: the traffic replayed, the A/A arm, then each variant."""
    t = run.traffic
    inst = f", {run.instances} instance pairs per arm" if run.instances > 1 else ""
    out = [f"What-ifs measured on real vLLM servers ({run.rounds} paired rounds of "
           f"{run.duration_s:g} s per arm{inst}, concurrency {t.concurrency}, "
           f"{t.output_tokens} tokens out per request; changes are variant vs baseline with "
           f"95% intervals; a verdict is confirmed (inside the prediction's band), OFF "
           f"(wholly outside) or inconclusive):"]
    by_id = {w.id: w for m in rep.models for w in m.what_ifs}
    floor = rep.models[0].noise_floor if rep.models else None
    for res in run.variants:
        w = by_id.get(res.what_if)
        v = floor if res.control else (w.validation if w is not None else None)
        out += variant_lines(res, v)
    if not any(r.control for r in run.variants):
        out.append("No A/A arm: instance-to-instance noise is unmeasured, so no throughput "
                   "change is confirmed or refuted")
    off = [w.id for w in by_id.values()
           if w.validation is not None and w.validation.verdict == "off"]
    if floor is not None and floor.verdict == "off":
        off.insert(0, "the A/A arm (its floor is understated)")
    if off:
        out.append(f"OFF (the whole interval outside the band): {', '.join(off)} (see the "
                   "report's predicted-vs-measured tables)")
    return out
