"""The bandwidth probe and decode-attention utilisation, measured (issue 13, item 2):

- ``probe``: ``attnprof probe`` on this machine, several rounds: copy, triad and matmul
  medians and spreads, and how long the probe takes;
- ``probe_vs_numpy``: the probe's peak over an independent numpy copy of the same arrays
  (glibc memcpy, non-temporal above its threshold, split over torch's thread count), paired
  round by round;
- ``decode``: decode attention on SmolLM2's attention shape (9/3 heads x 64, fp32) through the
  transformers capture, at several KV-cache sizes: attnprof's bandwidth utilisation (analytic
  KV bytes / captured time / probed peak) against the independent one (the K and V tensors'
  bytes / a plain timing of the same attention function / the better of a torch copy and
  triad of those bytes, the probe's own estimator), paired round by round
  (``tests.integration.test_probe.decode_rounds``, the test's own rounds).

Writes benchmarks/results/roofline.json and the results table in docs/roofline.md.
Run: ``.venv/bin/python benchmarks/roofline.py [--rounds N]`` (~2-4 minutes).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the test's measurement helpers (one definition)

OUT = ROOT / "benchmarks" / "results" / "roofline.json"
DOC = ROOT / "docs" / "roofline.md"
BEGIN, END = "<!-- benchmarks/roofline.py: begin -->", "<!-- benchmarks/roofline.py: end -->"


def _q(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "n": len(s)}


def bench_probe(rounds: int) -> dict[str, Any]:
    from attnprof.tools.probe import probe

    runs = [probe(device="cpu") for _ in range(rounds)]
    return {"copy": _q([r.kernels[0].median for r in runs]),
            "triad": _q([r.kernels[1].median for r in runs]),
            "matmul": _q([r.kernels[2].median for r in runs]),
            "peak": _q([r.bandwidth_bytes_per_second for r in runs]),
            "seconds": _q([r.seconds for r in runs]),
            "array_bytes": runs[0].kernels[0].size, "threads": runs[0].threads,
            "cpu": runs[0].device_name}


def bench_probe_vs_numpy(rounds: int) -> dict[str, Any]:
    import torch
    from tests.integration.test_probe import _numpy_copy_bandwidth

    from attnprof.tools.probe import default_array_bytes, probe

    numpy_bw = _numpy_copy_bandwidth(default_array_bytes("cpu"), torch.get_num_threads())
    ratios = []
    for _ in range(rounds):
        p = probe(device="cpu", repeats=1, matmul_n=64)
        ratios.append(p.bandwidth_bytes_per_second / numpy_bw())
    return {"ratio": _q(ratios)}


def bench_decode(kv_len: int, rounds: int) -> dict[str, Any]:
    from tests.integration.test_probe import decode_rounds

    r = decode_rounds(kv_len, rounds)
    return {"kv_len": kv_len, "kv_bytes": r["kv_bytes"],
            "utilisation_attnprof": _q(r["ours"]), "utilisation_independent": _q(r["theirs"]),
            "ratio": _q(r["ratio"]), "attention_s_captured": _q(r["captured_s"]),
            "attention_s_plain": _q(r["plain_s"])}


def markdown(res: dict[str, Any]) -> str:
    p = res["probe"]
    g = 1e9
    lines = [BEGIN, "",
             f"Measured {res['when']} on {p['cpu']} ({p['threads']} threads, shared with other "
             f"jobs), {res['rounds']} rounds each; medians (min-max).", "",
             "| probe | median | min - max |", "|---|---|---|"]
    for k, unit, f in (("copy", "GB/s", g), ("triad", "GB/s", g), ("matmul", "GFLOP/s", g),
                       ("seconds", "s", 1.0)):
        q = p[k]
        lines.append(f"| {k} | {q['median'] / f:.3g} {unit} | {q['min'] / f:.3g} - "
                     f"{q['max'] / f:.3g} |")
    r = res["probe_vs_numpy"]["ratio"]
    lines += ["", f"Probe peak / independent numpy copy (paired): median {r['median']:.3f} "
                  f"({r['min']:.3f} - {r['max']:.3f}); goal within 10%.", "",
              "| KV cache | attnprof utilisation | independent | ratio (goal 0.9-1.1) | "
              "captured / plain attention time |", "|---|---|---|---|---|"]
    for d in res["decode"]:
        lines.append(
            f"| {d['kv_bytes'] / 2**20:.0f} MiB ({d['kv_len']} tokens) | "
            f"{d['utilisation_attnprof']['median']:.3f} | "
            f"{d['utilisation_independent']['median']:.3f} | {d['ratio']['median']:.3f} "
            f"({d['ratio']['min']:.2f} - {d['ratio']['max']:.2f}) | "
            f"{d['attention_s_captured']['median'] * 1e3:.1f} / "
            f"{d['attention_s_plain']['median'] * 1e3:.1f} ms |")
    return "\n".join([*lines, "", END])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kv-lens", default="8192,65536,262144",
                    help="decode KV-cache lengths (tokens; 1536 B per token here)")
    args = ap.parse_args(argv)
    res: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d", time.gmtime()), "rounds": args.rounds,
        "python": platform.python_version(), "probe": bench_probe(args.rounds),
        "probe_vs_numpy": bench_probe_vs_numpy(args.rounds),
        "decode": [bench_decode(int(n), args.rounds) for n in args.kv_lens.split(",")]}
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    text = markdown(res)
    doc = DOC.read_text()
    if BEGIN in doc and END in doc:
        DOC.write_text(doc[:doc.index(BEGIN)] + text + doc[doc.index(END) + len(END):])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
