"""On a GPU: does `attnprof compat` name the backend and FlashAttention version vLLM really picks?

For a few layer shapes (head sizes, a sliding window, sinks, an fp8 KV cache) this starts vLLM
on a tiny random-weight model, reads the backend and FA version the engine chose from vLLM's
own log lines, and compares them with ``attnprof compat`` for this GPU's capability. One child
process per shape (a fresh engine each), 90 s each at most.

    python benchmarks/gpu_compat_check.py [--out benchmarks/results/gpu_compat.json]

Needs a CUDA build of vLLM; on a CPU machine it says so and exits 2. Results go to the JSON
file and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# vLLM 0.32's own log lines (platforms/cuda.py, v1/attention/backends/flash_attn.py).
BACKEND_RE = re.compile(r"Using (\w+) attention backend out of potential backends")
SELECTED_RE = re.compile(r"Using (AttentionBackendEnum\.)?(\w+) backend\.")
FA_RE = re.compile(r"Using FlashAttention version (\d)")
FACTS_RE = re.compile(r"^FACTS (\{.*\})$", re.M)

# (name, model family, head_dim, extra config, kv cache dtype)
SHAPES: list[tuple[str, str, int, dict[str, Any], str]] = [
    ("llama-h64", "llama", 64, {}, "auto"),
    ("llama-h128", "llama", 128, {}, "auto"),
    ("llama-h256", "llama", 256, {}, "auto"),
    ("llama-h128-fp8kv", "llama", 128, {}, "fp8"),
    ("mistral-h128-window", "mistral", 128, {"sliding_window": 64}, "auto"),
    ("llama-h512", "llama", 512, {}, "auto"),
    # Sinks exercise the riskiest platform fact (FlashInfer's TRT-LLM kernels); a tiny GPT-OSS
    # that vLLM cannot load is reported as an error, not as a disagreement.
    # GPT-OSS's first layer is a sliding-window one (layer_types starts with
    # sliding_attention), and vLLM logs the first layer's choice: compare with window + sinks.
    ("gpt-oss-h64-sinks-window", "gpt_oss", 64, {"sliding_window": 128}, "auto"),
]


def parse_choice(log: str) -> dict[str, Any]:
    """The backend and FlashAttention version from vLLM's log text."""
    m = BACKEND_RE.search(log) or SELECTED_RE.search(log)
    backend = (m.group(1) if m and m.re is BACKEND_RE else m.group(2) if m else None)
    fa = FA_RE.search(log)
    return {"backend": backend, "flash_attn_version": int(fa.group(1)) if fa else None}


def compare(got: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Differences between what vLLM chose and what attnprof compat predicted."""
    diffs = []
    if got["backend"] != expected.get("selected"):
        diffs.append(f"backend: vLLM {got['backend']}, attnprof {expected.get('selected')}")
    if (got["backend"] == "FLASH_ATTN"
            and got["flash_attn_version"] != expected.get("flash_attn_version")):
        diffs.append(f"FA version: vLLM {got['flash_attn_version']}, attnprof "
                     f"{expected.get('flash_attn_version')}")
    return diffs


_CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams
from attnprof.tools.vllm_matrix import platform_facts
print("FACTS", json.dumps(platform_facts()))
llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=256,
          gpu_memory_utilization=0.2, kv_cache_dtype=sys.argv[2], skip_tokenizer_init=True)
out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2))
print("GENERATED", len(out[0].outputs[0].token_ids))
"""


def build(path: Path, family: str, head_dim: int, extra: dict[str, Any]) -> Path:
    import transformers as tf

    heads, kv_heads = 4, 2
    common = dict(vocab_size=512, hidden_size=heads * head_dim, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, max_position_embeddings=512, **extra)
    if family == "gpt_oss":
        common.update(num_local_experts=4, num_experts_per_tok=2)
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
    }[family]
    model_cls(cfg_cls(**common)).save_pretrained(path)
    return path


def cuda_vllm_missing() -> str | None:
    """Why this machine cannot run the GPU checks (no CUDA device, or a vLLM build whose
    platform is not CUDA), or None when it can. The device scripts' one start-up test."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            return f"vLLM's platform is {type(current_platform).__name__}"
    except Exception as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_compat.json"))
    args = ap.parse_args(argv)
    if (missing := cuda_vllm_missing()) is not None:
        print(f"gpu_compat_check: needs a CUDA GPU and a CUDA build of vLLM ({missing})",
              file=sys.stderr)
        return 2
    import torch
    import vllm

    from attnprof.analyze import compat

    major, minor = torch.cuda.get_device_capability()
    gpu = f"{major}.{minor}"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, family, hd, extra, kv in SHAPES:
            model = build(Path(tmp) / name, family, hd, extra)
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="INFO")
            try:
                p = subprocess.run([sys.executable, "-c", _CHILD, str(model), kv], env=env,
                                   capture_output=True, text=True, timeout=90, check=False)
                log, rc = p.stdout + p.stderr, p.returncode
            except subprocess.TimeoutExpired as err:
                log, rc = str(err.stdout or "") + str(err.stderr or ""), 124
            got = parse_choice(log)
            feats = {"sliding_window": "sliding_window" in extra, "fp8_kv": kv == "fp8",
                     "sinks": family == "gpt_oss"}
            try:
                want = compat.case_report(gpu, hd, "bf16", feats)["vllm"]
            except ValueError as err:
                want = {"available": False, "reason": str(err)}
            diffs = compare(got, want) if want.get("available") else ["no prediction"]
            fm = FACTS_RE.search(log)
            facts = json.loads(fm.group(1)) if fm else None
            if facts is not None and want.get("facts") and facts != want["facts"]:
                diffs.append(f"platform facts: this GPU {facts}, assumed {want['facts']}")
            row = {"shape": name, "head_dim": hd, "features": feats, "rc": rc, "vllm": got,
                   "facts": facts,
                   "attnprof": {k: want.get(k) for k in ("selected", "flash_attn_version",
                                                          "source", "facts")},
                   "agree": rc == 0 and not diffs, "error": rc != 0, "diffs": diffs,
                   "log_tail": log.strip().splitlines()[-3:] if rc else []}
            rows.append(row)
            print(f"{name:<22} vLLM {got['backend']} FA{got['flash_attn_version']}  attnprof "
                  f"{want.get('selected')} FA{want.get('flash_attn_version')}  "
                  f"{'agree' if row['agree'] else '; '.join(diffs) or f'rc={rc}'}", flush=True)
    ran = [r for r in rows if not r["error"]]
    sinks_ran = any(r["features"]["sinks"] for r in ran)
    if not sinks_ran:
        print("the sinks shape did not start: the FlashInfer/TRT-LLM platform facts, the "
              "riskiest assumption, stay unchecked", flush=True)
    doc = {"gpu": torch.cuda.get_device_name(), "capability": gpu,
           "vllm": str(vllm.__version__), "rows": rows,
           "agree": sum(r["agree"] for r in ran), "ran": len(ran), "total": len(rows),
           "sinks_checked": sinks_ran}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{doc['agree']} of {doc['ran']} shapes that started agree ({doc['total'] - doc['ran']} "
          f"did not start); wrote {args.out}")
    return 0 if doc["agree"] == doc["ran"] and doc["ran"] and sinks_ran else 1


if __name__ == "__main__":
    raise SystemExit(main())
