"""How often did the hand-kept rules disagree with vLLM's own verdicts?

Compares a hand-kept compatibility matrix (by default the one attnprof shipped before the vLLM
matrix was derived, read from git) with the derived vLLM matrix over the audit grid: 8 head
dims x fp16/bf16/fp32 x sm80/sm90/sm100 x window/sinks/fp8 KV = 576 cases, 4 backends each.
FLASHINFER, TRITON_ATTN and FLEX_ATTENTION map to their rows. FLASH_ATTN is counted two ways:
- ``before`` (``attnprof compat``, which listed every FlashAttention row): yes when any
  FlashAttention row of that GPU says yes (FA2 on Ampere, FA2/FA3/FA4 on Hopper, FA4 on
  Blackwell);
- ``before_live_report`` (the old live vLLM report, ``vllm_backend_report``): the one row it
  mapped FLASH_ATTN to (FA2, FA3 on sm90).

    python benchmarks/compat_audit.py [--old git:d4abb25 | --old PATH]

Writes benchmarks/results/compat_audit.json; docs/diagnostics.md section 3 quotes it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
from pathlib import Path
from typing import Any

import attnprof.analyze.rules as rules
from attnprof.analyze import vllm_matrix
from attnprof.tools.vllm_matrix import FEATURE_SETS

HEADS = (64, 80, 96, 128, 160, 192, 256, 512)
GPUS = ("sm80", "sm90", "sm100")
FA_ROWS = {"sm80": ["flash_attn_2"], "sm90": ["flash_attn_2", "flash_attn_3", "flash_attn_4"],
           "sm100": ["flash_attn_4"]}
FA_ROW_LIVE = {"sm80": ["flash_attn_2"], "sm90": ["flash_attn_3"], "sm100": ["flash_attn_2"]}
ROWS = {"FLASHINFER": "flashinfer", "TRITON_ATTN": "triton_attn",
        "FLEX_ATTENTION": "flex_attention"}
MATRIX = "plugin/attnprof/analyze/data/compat_matrix.json"


def load_old(spec: str) -> dict[str, Any]:
    if spec.startswith("git:"):
        text = subprocess.run(["git", "show", f"{spec[4:]}:{MATRIX}"], capture_output=True,
                              text=True, check=True).stdout
    else:
        text = Path(spec).read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def audit(old: dict[str, Any], fa_rows: dict[str, list[str]]) -> dict[str, Any]:
    cases = verdicts = disagreeing = 0
    by: dict[str, int] = {}
    for gpu, head, dtype, feature_set in itertools.product(GPUS, HEADS, ("fp16", "bf16", "fp32"),
                                                           FEATURE_SETS):
        feats = {f: f in feature_set for f in vllm_matrix.FEATURES}
        case = vllm_matrix.lookup(gpu, head, dtype, feats)
        assert case is not None
        cases += 1
        differs = False
        for be in ("FLASH_ATTN", *ROWS):
            keys = fa_rows[gpu] if be == "FLASH_ATTN" else [ROWS[be]]
            said = any(rules.evaluate(k, gpu, head, dtype, feats, matrix=old).ok
                       for k in keys if k in old["backends"])
            says = be in case.valid
            if said != says:
                verdicts += 1
                differs = True
                key = f"{be} on {gpu}: attnprof {'yes' if said else 'no'}, vLLM " \
                      f"{'yes' if says else 'no'}"
                by[key] = by.get(key, 0) + 1
        disagreeing += differs
    return {"cases": cases, "backend_verdicts": cases * (1 + len(ROWS)),
            "cases_disagreeing": disagreeing, "verdicts_disagreeing": verdicts,
            "by_class": dict(sorted(by.items()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="git:d4abb25",
                    help="hand-kept matrix: git:REV or a path (default git:d4abb25)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compat_audit.json"))
    args = ap.parse_args()
    # After: attnprof's vLLM verdicts are the derived matrix itself, so 0 by construction;
    # tests/unit/analyze/test_vllm_matrix.py regenerates it from vLLM and compares byte for byte.
    old = load_old(args.old)
    res = {"old": args.old, "derived_from": vllm_matrix.source_line(),
           "before": audit(old, FA_ROWS), "before_live_report": audit(old, FA_ROW_LIVE),
           "after": "0: the vLLM part is vLLM's own answer (checked by regenerating it)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    for name in ("before", "before_live_report"):
        b = res[name]
        print(f"{name}: {b['verdicts_disagreeing']} of {b['backend_verdicts']} backend "
              f"verdicts in {b['cases_disagreeing']} of {b['cases']} cases disagree with vLLM")
        for k, v in b["by_class"].items():
            print(f"  {v:4d}  {k}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
