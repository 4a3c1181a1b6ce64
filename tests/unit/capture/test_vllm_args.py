"""The vLLM adapter reads each supported version's argument positions: fake argument tuples
shaped like that version's calls, and the installed vLLM's own signatures."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from attnprof.capture.vllm import args as vargs
from tests.conftest import run_py


class _Tokens:
    def __init__(self, n: int) -> None:
        self.shape = (n,)


# ----- vLLM 0.32 -----
def _impl_forward_032(*a: Any, **k: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What ``unified_attention_with_output`` passes in 0.32: six positionals, then the
    output buffers by keyword."""
    return a, k


def test_032_impl_call_reads_every_position() -> None:
    md = SimpleNamespace(num_actual_tokens=3)
    a, k = _impl_forward_032("layer", "q", "k", "v", "kv", md, output="o", output_scale=None,
                             output_block_scale=None)
    call = vargs.VLLM_0_32.impl_call(a, k)
    assert call == vargs.ImplCall("layer", "q", "k", "v", "kv", md)
    assert call.attn_metadata is md


def test_032_impl_call_by_keyword_and_dummy_runs() -> None:
    a, k = _impl_forward_032("layer", "q", "k", "v", kv_cache="kv", attn_metadata=None,
                             output="o")
    call = vargs.VLLM_0_32.impl_call(a, k)
    assert (call.kv_cache, call.attn_metadata) == ("kv", None)  # None: warm-up, not timed
    assert vargs.VLLM_0_32.impl_call(a, k).attn_metadata is None
    assert vargs.VLLM_0_32.impl_call((), {}) == vargs.ImplCall(None, None, None, None, None,
                                                                None)


def test_032_step_tokens() -> None:
    ad = vargs.VLLM_0_32
    assert ad.step_tokens((), {"input_ids": _Tokens(7), "positions": _Tokens(7)}) == 7
    assert ad.step_tokens((), {"input_ids": None, "inputs_embeds": _Tokens(5)}) == 5
    assert ad.step_tokens((_Tokens(4),), {}) == 4
    assert ad.step_tokens((), {}) == 0
    assert {"input_ids": "ids"}.get(ad.step_ids_key) == "ids"


def test_version_lookup() -> None:
    assert vargs.for_version("0.32.0+cpu") is vargs.VLLM_0_32
    assert vargs.for_version("0.32") is vargs.VLLM_0_32
    assert vargs.for_version("0.320.0") is vargs.VLLM_0_32  # not 0.32: the newest one
    assert vargs.for_version(None) is vargs.VLLM_0_32


def test_metadata_readers() -> None:
    md = SimpleNamespace(num_actual_tokens=7, max_query_len=4, seq_lens=[4, 3],
                         query_start_loc=[0, 4, 7])
    shape = vargs.batch_shape(md)
    assert shape.num_tokens == 7 and shape.num_reqs == 2 and shape.whole_prompts == ((0, 4),
                                                                                     (4, 3))
    assert vargs.shape_inputs(md).seq_lens == [4, 3]
    assert vargs.kv_cache_bytes(None) == 0
    assert not vargs.on_cuda(SimpleNamespace(device=SimpleNamespace(type="cpu")))


# ----- the installed vLLM -----
_SIGNATURES = r"""
import inspect, json
import vllm
from vllm.v1.attention.backend import AttentionImpl
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
after_self = lambda f: list(inspect.signature(f).parameters)[1:]
print("RESULT " + json.dumps({
    "version": vllm.__version__,
    "impl": [after_self(c.forward) for c in (AttentionImpl, CPUAttentionBackendImpl)],
    "model_forward": after_self(GPUModelRunner._model_forward)}))
"""


@pytest.mark.slow
def test_installed_vllm_signatures_match_the_adapter() -> None:
    """The positions the adapter reads are the installed vLLM's (a vLLM upgrade that moves
    an argument fails here, not silently in a server). In a fresh process: importing vLLM
    here would change what other tests' fake layers see (``"vllm" in sys.modules``)."""
    pytest.importorskip("vllm")
    proc = run_py(_SIGNATURES, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(x for x in proc.stdout.splitlines()
                          if x.startswith("RESULT ")).removeprefix("RESULT "))
    ad = vargs.for_version(got["version"])
    assert any(got["version"].startswith(v + ".") for v in ad.versions), got["version"]
    for params in got["impl"]:
        assert tuple(params[:len(ad.impl_forward)]) == ad.impl_forward
    assert tuple(got["model_forward"][:len(ad.model_forward)]) == ad.model_forward
