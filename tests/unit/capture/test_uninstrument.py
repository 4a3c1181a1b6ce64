"""``attnprof.uninstrument()`` undoes what instrumenting patched, symmetric to it and
idempotent: vLLM's real classes get their own functions back (identity), and an instrumented
transformers model its configs, registry and module forwards."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import attnprof
from tests.conftest import run_py

_VLLM = r"""
import json
import attnprof
from attnprof.capture.vllm import install
from attnprof.config import Config
from attnprof.host.vllm.runtime import State
from attnprof.host.vllm.worker_rpc import worker_methods  # the host's RPC answers
attnprof.uninstrument()  # nothing instrumented yet: a no-op
install.uninstall()
from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.attention import selector as sel
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.worker_base import WorkerBase
places = [(Attention, "__init__"), (GPUModelRunner, "_model_forward"),
          (sel, "_cached_get_attn_backend"),
          (GPUModelRunner, "_determine_batch_execution_and_padding"),
          (GPUModelRunner, "initialize_kv_cache")]
before = [vars(o)[n] for o, n in places]
state = State(config=Config(enabled=True, sample_rate=1.0, seed=0, model_label="m"))
cap = install.install(state, worker_methods)
again = install.install(state, worker_methods)  # a second install patches nothing more
patched = [vars(o)[n] is not b for (o, n), b in zip(places, before)]
rpc = sorted(n for n in vars(WorkerBase) if n.startswith("attnprof_"))
class Impl:
    def forward(self, *a, **k):
        return "vllm"
class Layer:
    layer_name = "model.layers.0.self_attn.attn"
    def __init__(self):
        self.impl = Impl()
layer = Layer()
cap.wrap_layer(layer)
cap.install_layers()  # as if a sampled step were running
mid_step = "forward" in vars(layer.impl)
attnprof.uninstrument()
restored = [vars(o)[n] is b for (o, n), b in zip(places, before)]
rpc_after = sorted(n for n in vars(WorkerBase) if n.startswith("attnprof_"))
attnprof.uninstrument()  # twice: still fine
restored_twice = [vars(o)[n] is b for (o, n), b in zip(places, before)]
bare_state = State(config=Config(enabled=True, sample_rate=1.0, seed=0, model_label="m"))
install.install(bare_state)  # the hooks alone: capture brings no RPC answers of its own
rpc_bare = sorted(n for n in vars(WorkerBase) if n.startswith("attnprof_"))
install.uninstall()
print("RESULT " + json.dumps({
    "rpc_bare": rpc_bare,
    "patched": patched, "rpc": rpc, "second_install": again is not None,
    "mid_step": mid_step, "restored": restored, "restored_twice": restored_twice,
    "rpc_after": rpc_after, "layer_clean": vars(layer.impl) == {},
    "installed": install.installed(), "state_capture": state.capture is None,
    "impl_call": layer.impl.forward()}))
"""


@pytest.mark.slow
def test_vllm_patches_are_undone_to_the_original_functions() -> None:
    """Installed in a fresh process with the installed vLLM's real classes: every patched
    attribute is vLLM's own object again after uninstrument (twice is fine), the RPC methods
    are gone, and a layer wrapped mid-step runs vLLM's forward with no attnprof mark."""
    pytest.importorskip("vllm")
    proc = run_py(_VLLM, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line.removeprefix("RESULT "))
    assert got["patched"] == [True] * 5
    assert got["rpc"] == ["attnprof_head_stats", "attnprof_poll", "attnprof_set_sampling",
                          "attnprof_snapshot", "attnprof_trace"]
    assert got["mid_step"]
    assert got["restored"] == [True] * 5 and got["restored_twice"] == [True] * 5
    assert got["rpc_after"] == [] and got["layer_clean"] and got["impl_call"] == "vllm"
    assert not got["installed"] and got["state_capture"]
    assert got["rpc_bare"] == []  # the RPC answers are the host's, handed to install


CFG: dict[str, Any] = dict(vocab_size=100, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, max_position_embeddings=256)


def _state(model: Any) -> tuple[Any, ...]:
    """What instrumenting touches: the configs' implementation, the registries' keys, and
    each module's own ``forward`` attribute."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return (model.config._attn_implementation,
            sorted(AttentionInterface._global_mapping),
            sorted(AttentionMaskInterface._global_mapping),
            [m.__dict__.get("forward") for m in model.modules()])


@pytest.mark.parametrize("cls_name", ["LlamaForCausalLM", "GPTNeoForCausalLM"])
def test_transformers_instrument_then_uninstrument_restores_the_model(cls_name: str) -> None:
    """Llama goes through the attention registry, GPT-Neo through the module route (its
    attention module's forward wrapped on the instance): after uninstrument both are exactly
    as before, and their outputs bit-identical."""
    import transformers as tf

    torch.manual_seed(0)
    if cls_name == "LlamaForCausalLM":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**CFG, attn_implementation="sdpa")).eval()
    else:
        model = tf.GPTNeoForCausalLM(tf.GPTNeoConfig(
            vocab_size=100, hidden_size=64, num_layers=2, num_heads=4,
            attention_types=[[["global", "local"], 1]], max_position_embeddings=256)).eval()
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    before = _state(model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        attnprof.uninstrument()  # nothing instrumented: a no-op
        prof = attnprof.instrument(model)
        assert _state(model) != before
        inside = model(input_ids=ids).logits
        attnprof.uninstrument()
        after = model(input_ids=ids).logits
    assert _state(model) == before
    assert all("forward" not in vars(m) and m.forward.__func__ is type(m).forward
               for m in model.modules())  # each module runs its class's own forward
    assert sum(r["calls"] for r in prof.activation_map()) == 2  # it did profile, once
    assert torch.equal(ref, inside) and torch.equal(ref, after)
    attnprof.uninstrument()  # twice: still fine
    prof.uninstrument()  # and the profile's own undo after it too
    assert _state(model) == before
