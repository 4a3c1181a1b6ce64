"""Regenerate the golden test data in tests/data/ (``make golden``, about 3 minutes on 2 cores).

From a tiny random-weight Llama (:func:`tests.conftest.build_tiny_model`):

- ``snapshot.json``: ``attnprof.snapshot(llm)`` after a short offline vLLM run, every step
  sampled;
- ``profile.json``: ``attnprof profile`` at two short lengths;
- ``demo.json``: ``attnprof demo`` on the tiny model (a real server, four documents, no
  replay): the demo's report, its server snapshot inside;
- ``demo_structure.json``: the nested key sets and value types of that demo's
  ``report.json`` and the section headings it printed.

Volatile fields (wall-clock times, pids, versions, the machine's CPU name, git revisions,
the temporary model path, argv) are normalised so that a rerun differs only in measured
values. Run from the repository root: ``python -m tests.golden``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"
SNAPSHOT = DATA / "snapshot.json"
PROFILE = DATA / "profile.json"
DEMO = DATA / "demo.json"
DEMO_STRUCTURE = DATA / "demo_structure.json"
MODEL = "/golden/tiny"
DEMO_URL = "http://127.0.0.1:8011"

_UNIX_TIME = 1700000000.0
_VERSIONS = ("attnprof", "python", "torch", "transformers", "vllm")

_OFFLINE = r"""
import json, sys
from vllm import LLM, SamplingParams
import attnprof
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(["the model request server", "cache token layer attention window head"] * 2,
                 sp, use_tqdm=False)
    json.dump(attnprof.snapshot(llm).to_json(), open(sys.argv[2], "w"))
"""


def dump(doc: Any) -> str:
    """The text every golden JSON file holds."""
    return json.dumps(doc, indent=1) + "\n"


def normalise(doc: Any, model_dir: str) -> Any:
    """``doc`` with its volatile fields replaced by fixed values of the same type."""
    pids: dict[int, int] = {}

    def walk(x: Any, key: str = "", parent: str = "") -> Any:
        if isinstance(x, dict):
            return {k: walk(v, k, key) for k, v in x.items()}
        if isinstance(x, list):
            if key == "command":
                return ["attnprof", "golden"]
            return [walk(v, key, parent) for v in x]
        if isinstance(x, str):
            if key == "time_iso":
                return "2023-11-14T22:13:20+00:00"
            if key in _VERSIONS and parent in ("provenance", "environment"):
                return "0.0.0"
            if key == "cpu" and parent == "hardware":
                return "cpu"
            if key == "platform" and parent == "environment":
                return "Linux"
            if key in ("git_revision",):
                return None
            return x.replace(model_dir, MODEL)
        if isinstance(x, float) and key in ("time", "started_at"):
            return _UNIX_TIME
        if isinstance(x, float) and key in ("wall_s", "server_ready_s", "total_s", "seconds"):
            return 0.0
        if isinstance(x, int) and not isinstance(x, bool) and key == "pid":
            return pids.setdefault(x, 1000 + len(pids))
        return x

    out = walk(doc)
    if isinstance(out, dict) and isinstance(out.get("provenance"), dict):
        out["provenance"]["git"] = None
    return out


def structure(x: Any) -> Any:
    """Nested key sets and value types, not values: a list is the union of its elements'."""
    if isinstance(x, dict):
        return {k: structure(v) for k, v in sorted(x.items())}
    if isinstance(x, list):
        merged: dict[str, Any] = {}
        for item in x:
            s = structure(item)
            merged[json.dumps(s, sort_keys=True)] = s
        return [merged[k] for k in sorted(merged)]
    if x is None:
        return "null"
    return type(x).__name__


def headings(text: str) -> list[str]:
    """The section headings of the demo's terminal output: unindented lines that open with
    a capitalised label and a colon (the label, digits as N)."""
    out = []
    for line in text.splitlines():
        m = re.match(r"([A-Z][^:]*):", line)
        if m:
            out.append(re.sub(r"\d+", "N", m.group(1)))
    return out


def demo_structure(demo: dict[str, Any]) -> dict[str, Any]:
    """The structure of what ``attnprof demo`` writes and prints, rebuilt from its report
    (``demo``) through the demo's own code path: :func:`attnprof.cli.demo.print_summary`
    and the cost report (``report_sources.from_live``, ``report.build_report``,
    ``render_all``, ``print_savings``), without vLLM or a server."""
    from attnprof.analyze.cost import Settings
    from attnprof.cli.demo import print_summary
    from attnprof.cli.report import print_savings
    from attnprof.contracts.advice import AdviceUnavailable, WindowAdvice
    from attnprof.tools import report as rp
    from attnprof.tools import report_sources as rs

    raw = demo["window_advice"]
    advice = (AdviceUnavailable.from_json(raw) if "error" in raw
              else WindowAdvice.from_json(raw))
    snap = json.loads(json.dumps(demo["snapshot"]))
    g = rs.from_live(snap, DEMO_URL,
                     advice=advice if isinstance(advice, WindowAdvice) else None)
    rep = rp.build_report(g, Settings(gpu_hour_price=None), time.monotonic())
    texts = rp.render_all(rep)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_summary({**demo, "snapshot": snap}, advice, 0.0, 0.0, Path("demo.json"))
        print()
        print_savings(rep, Path("."))
    return {"report.json": structure(json.loads(texts["report.json"])),
            "terminal": headings(printed.getvalue())}


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 900
         ) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPROF_")}
    full.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}, **env)
    r = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} failed:\n{r.stderr[-3000:]}")
    return r


def main() -> int:
    from tests.conftest import build_tiny_model, free_port

    py = sys.executable
    cli = str(Path(py).with_name("attnprof"))
    DATA.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="attnprof-golden-") as tmp:
        work = Path(tmp)
        model = str(build_tiny_model(work / "tiny"))
        print("offline vLLM snapshot ...", file=sys.stderr)
        _run([py, "-c", _OFFLINE, model, str(work / "snapshot.json")], work,
             {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ATTNPROF_ENABLED": "1",
              "ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_SEED": "0",
              "ATTNPROF_OVERHEAD_BUDGET": "1.0"})
        print("attnprof profile ...", file=sys.stderr)
        _run([cli, "profile", model, "--seq-lens", "32,64", "--repeats", "1",
              "--no-validate", "--memory-budget", "1GiB", "--out", str(work / "profile")],
             work, {})
        print("attnprof demo ...", file=sys.stderr)
        demo_out = work / "demo"
        r = _run([cli, "demo", "--model", model, "--port", str(free_port()),
                  "--out", str(demo_out / "demo.json"), "--chats", "0",
                  "--doc-lengths", "200,300,600,700", "--max-model-len", "1024",
                  "--no-replay"], work, {})
        snapshot = normalise(json.loads((work / "snapshot.json").read_text()), model)
        profile = normalise(json.loads((work / "profile" / "profile.json").read_text()),
                            model)
        demo = normalise(json.loads((demo_out / "demo.json").read_text()), model)
        real = {"report.json": structure(json.loads((demo_out / "report.json").read_text())),
                "terminal": headings(r.stdout)}
    derived = demo_structure(demo)
    if derived != real:  # the unit test's stand-in for the demo must match the real one
        sys.exit("the demo's structure rebuilt from demo.json differs from the real run's:\n"
                 + json.dumps({"real": real, "derived": derived}, indent=1)[:4000])
    for path, doc in ((SNAPSHOT, snapshot), (PROFILE, profile), (DEMO, demo),
                      (DEMO_STRUCTURE, real)):
        path.write_text(dump(doc))
        print(path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
