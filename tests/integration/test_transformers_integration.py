"""The transformers integration on tiny random-weight models: bit-identical outputs,
padding kept, per-layer kernel map, GQA and sliding-window layers, on_call events."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attnprof
from attnprof.capture.transformers import instrument
from attnprof.capture.transformers_records import AttentionCallEvent

COMMON: dict[str, Any] = dict(vocab_size=100, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, max_position_embeddings=256)


def tiny(family: str, impl: str, **extra: Any) -> Any:
    import transformers as tf

    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
    }[family]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**COMMON, **extra, attn_implementation=impl)).eval()


def padded_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 20), generator=g)
    am = torch.ones(2, 20, dtype=torch.long)
    am[1, :5] = 0  # left padding on the second row
    return {"input_ids": ids, "attention_mask": am}


FAMILIES = [("llama", {}), ("mistral", {"sliding_window": 8}),
            ("gemma2", {"sliding_window": 8}),
            ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize(("family", "extra"), FAMILIES)
def test_outputs_bit_identical_with_padding(family: str, extra: dict[str, Any], impl: str
                                            ) -> None:
    m = tiny(family, impl, **extra)
    batch = padded_batch()
    with torch.no_grad():
        ref = m(**batch).logits
        events: list[AttentionCallEvent] = []
        with attnprof.profile(m, on_call=events.append) as prof:
            out = m(**batch).logits
        after = m(**batch).logits
    assert torch.equal(ref, out)  # bit-identical, padding mask kept
    assert torch.equal(ref, after)
    assert m.config._attn_implementation == impl  # uninstrumented
    assert [e.layer_idx for e in events] == [0, 1]
    assert all(e.backend == impl for e in events)
    assert not prof.errors
    rows = prof.activation_map()
    assert [r["layer_idx"] for r in rows] == [0, 1]
    if impl == "eager":
        assert all(r["kernel"] == "eager" and not r["fused"] for r in rows)
        assert all(r["reasons"][0]["code"] == "eager" for r in rows)
    else:
        # Padding gives a bool mask; the CPU fused kernel accepts masks.
        assert all(r["kernel"] == "flash_cpu" and r["fused"] for r in rows)
        assert all(r["mask"] == "bool" for r in rows)
    # Sliding-window layers are mapped per layer.
    windows = [e.kwargs.get("sliding_window") for e in events]
    expected = {"llama": [None, None], "mistral": [8, 8], "gemma2": [8, None],
                "qwen2": [None, 8]}[family]
    assert windows == expected
    assert [r.sliding_window for r in prof.records] == expected


def test_mask_registration_is_required() -> None:
    """Counter-check: the padding mask matters for these inputs, so dropping it would show."""
    m = tiny("llama", "sdpa")
    batch = padded_batch()
    with torch.no_grad():
        ref = m(**batch).logits
        unpadded = m(input_ids=batch["input_ids"]).logits
    assert not torch.equal(ref[1], unpadded[1])


def test_gqa_and_decode_shape_classes() -> None:
    m = tiny("llama", "sdpa")
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad(), attnprof.profile(m) as prof:
        m.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    phases = {(r["layer_idx"], r["phase"]) for r in prof.activation_map()}
    assert phases == {(0, "prefill"), (1, "prefill"), (0, "decode"), (1, "decode")}
    for r in prof.activation_map():
        # No mask: transformers passes is_causal / enable_gqa and the CPU flash kernel runs.
        assert r["kernel"] == "flash_cpu", r
        assert r["sdpa_args"]["enable_gqa"] is True
        assert r["sdpa_args"]["key"][1] == 2 and r["sdpa_args"]["query"][1] == 4
        assert r["ops"] == ["_scaled_dot_product_flash_attention_for_cpu"]
    rec = prof.records[0]
    assert (rec.num_heads, rec.num_kv_heads, rec.head_dim) == (4, 2, 16)


def test_dropout_in_training_falls_back_to_math() -> None:
    m = tiny("llama", "sdpa", attention_dropout=0.1)
    m.train()
    with attnprof.profile(m) as prof:
        m(input_ids=torch.randint(0, 100, (1, 8)))
    rows = prof.activation_map()
    assert all(r["kernel"] == "math" and not r["fused"] for r in rows)
    assert all(r["reasons"][0]["code"] == "dropout" for r in rows)


def test_record_function_ranges_in_trace() -> None:
    m = tiny("llama", "sdpa")
    with torch.no_grad(), instrument(m), torch.profiler.profile() as p:
        m(input_ids=torch.randint(0, 100, (1, 8)))
    names = {e.name for e in p.events()}
    assert {"attn::L0::sdpa", "attn::L1::sdpa"} <= names
    # The trace's own ground truth agrees with the map: the fused CPU op ran under SDPA.
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names


def test_eager_trace_has_no_sdpa_op() -> None:
    m = tiny("llama", "eager")
    with torch.no_grad(), instrument(m) as prof, torch.profiler.profile() as p:
        m(input_ids=torch.randint(0, 100, (1, 8)))
    names = {e.name for e in p.events()}
    assert "attn::L0::eager" in names and "aten::softmax" in names
    assert not any("scaled_dot_product" in n for n in names)
    assert all(not r["fused"] for r in prof.activation_map())


def test_on_call_errors_never_reach_the_model() -> None:
    m = tiny("llama", "sdpa")

    def boom(event: AttentionCallEvent) -> None:
        raise ValueError("hook bug")

    with torch.no_grad(), attnprof.profile(m, on_call=boom) as prof:
        m(input_ids=torch.randint(0, 100, (1, 8)))
    assert prof.errors and "hook bug" in prof.errors[0]


def test_encoder_model_bert() -> None:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    m = BertModel(BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=128,
                             attn_implementation="sdpa")).eval()
    batch = padded_batch()
    with torch.no_grad():
        ref = m(**batch).last_hidden_state
        with attnprof.profile(m) as prof:
            out = m(**batch).last_hidden_state
    assert torch.equal(ref, out)
    assert [r["layer_idx"] for r in prof.activation_map()] == [0, 1]


@pytest.mark.slow
def test_flex_attention_wrapped() -> None:
    m = tiny("llama", "flex_attention")
    batch = padded_batch()
    with torch.no_grad():
        ref = m(**batch).logits
        with attnprof.profile(m) as prof:
            out = m(**batch).logits
    assert torch.equal(ref, out)
    rows = prof.activation_map()
    assert rows and all(r["impl"] == "flex_attention" and r["mask"] == "block_mask"
                        for r in rows)
