"""The bandwidth probe and decode-attention utilisation, measured (issue 13, item 2):

- ``probe``: ``attnprof probe`` on this machine, several rounds: read, copy, triad and
  matmul medians and spreads, and how long the probe takes;
- ``probe_vs_numpy``: the probe's peak (its read stream) over an independent numpy read of
  arrays of the same size (the better of numpy's float max and uint64 bitwise-or loops, on
  as many threads as torch uses, pinned one per CPU; a fresh array each round), paired
  round by round (``tests.integration.test_probe.probe_vs_numpy_rounds``);
- ``decode``: decode attention on SmolLM2's attention shape (9/3 heads x 64, fp32) through the
  transformers capture, at several KV-cache sizes: attnprof's bandwidth utilisation (analytic
  KV bytes / captured time / probed peak) against the independent one (the K and V tensors'
  bytes / a plain timing of the same attention function / a torch read of those bytes, the
  probe's own estimator), paired round by round
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

    def med(name: str) -> dict[str, float]:
        return _q([k.median for r in runs if (k := r.kernel(name)) is not None])

    return {**{k: med(k) for k in ("read", "copy", "triad", "matmul")},
            "peak": _q([r.bandwidth_bytes_per_second for r in runs]),
            "seconds": _q([r.seconds for r in runs]),
            "array_bytes": runs[0].kernels[0].size, "threads": runs[0].threads,
            "cpu": runs[0].device_name}


def bench_probe_vs_numpy(rounds: int) -> dict[str, Any]:
    from tests.integration.test_probe import probe_vs_numpy_rounds

    return {"ratio": _q(probe_vs_numpy_rounds(rounds))}


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
    for k, unit, f in (("read", "GB/s", g), ("copy", "GB/s", g), ("triad", "GB/s", g),
                       ("matmul", "GFLOP/s", g), ("seconds", "s", 1.0)):
        q = p[k]
        lines.append(f"| {k} | {q['median'] / f:.3g} {unit} | {q['min'] / f:.3g} - "
                     f"{q['max'] / f:.3g} |")
    r = res["probe_vs_numpy"]["ratio"]
    lines += ["", f"Probe peak / independent numpy read (paired): median {r['median']:.3f} "
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
    ap.add_argument("--kv-lens", default="65536,131072,262144,349525",
                    help="decode KV-cache lengths (tokens; 1536 B per token here). Keep the KV "
                         "above 2x the LLC: a smaller one stays in cache when one layer is "
                         "called again and again, unlike a real server's")
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
