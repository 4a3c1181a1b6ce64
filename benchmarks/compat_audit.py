"""How often did the hand-kept rules disagree with vLLM's own verdicts?

Compares a hand-kept compatibility matrix (by default the one attnprof shipped before the vLLM
matrix was derived, read from git) with the derived vLLM matrix over the audit grid: 8 head
dims x fp16/bf16/fp32 x sm80/sm90/sm100 x window/sinks/fp8 KV = 576 cases, 4 backends each.
The old report mapped FLASH_ATTN to the FlashAttention rows of that GPU (FA2 on Ampere,
FA2/FA3/FA4 on Hopper, FA4 on Blackwell), FLASHINFER, TRITON_ATTN and FLEX_ATTENTION to theirs.

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

HEADS = (64, 80, 96, 128, 160, 192, 256, 512)
GPUS = ("sm80", "sm90", "sm100")
FA_ROWS = {"sm80": ["flash_attn_2"], "sm90": ["flash_attn_2", "flash_attn_3", "flash_attn_4"],
           "sm100": ["flash_attn_4"]}
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


def audit(old: dict[str, Any]) -> dict[str, Any]:
    cases = verdicts = 0
    by: dict[str, int] = {}
    for gpu, head, dtype in itertools.product(GPUS, HEADS, ("fp16", "bf16", "fp32")):
        for bits in itertools.product((False, True), repeat=3):
            feats = dict(zip(vllm_matrix.FEATURES, bits, strict=True))
            case = vllm_matrix.lookup(gpu, head, dtype, feats)
            assert case is not None
            differs = False
            for be in ("FLASH_ATTN", *ROWS):
                keys = FA_ROWS[gpu] if be == "FLASH_ATTN" else [ROWS[be]]
                said = any(rules.evaluate(k, gpu, head, dtype, feats, matrix=old).ok
                           for k in keys if k in old["backends"])
                says = be not in case.invalid
                if said != says:
                    verdicts += 1
                    differs = True
                    key = f"{be} on {gpu}: attnprof {'yes' if said else 'no'}, vLLM " \
                          f"{'yes' if says else 'no'}"
                    by[key] = by.get(key, 0) + 1
            cases += differs
    return {"cases": 576, "backend_verdicts": 576 * 4, "cases_disagreeing": cases,
            "verdicts_disagreeing": verdicts, "by_class": dict(sorted(by.items()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="git:d4abb25",
                    help="hand-kept matrix: git:REV or a path (default git:d4abb25)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compat_audit.json"))
    args = ap.parse_args()
    # After: attnprof's vLLM verdicts are the derived matrix itself, so 0 by construction;
    # tests/unit/test_vllm_matrix.py regenerates it from vLLM and compares byte for byte.
    res = {"old": args.old, "derived_from": vllm_matrix.source_line(),
           "before": audit(load_old(args.old)),
           "after": "0: the vLLM part is vLLM's own answer (checked by regenerating it)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    b = res["before"]
    print(f"before: {b['verdicts_disagreeing']} of {b['backend_verdicts']} backend verdicts in "
          f"{b['cases_disagreeing']} of {b['cases']} cases disagree with vLLM")
    for k, v in b["by_class"].items():
        print(f"  {v:4d}  {k}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
