"""attnprof.facts: the one dtype table, the one attention-shape reader, the model label.

Shape tests build the real transformers config classes, so the reader is checked against the
``layer_types`` transformers derives itself, in three forms: the config object, its
``to_dict()`` and the ``config.json`` an older checkpoint ships (no ``layer_types``).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from attnprof.facts.dtypes import CANONICAL, dtype_bytes, normalize
from attnprof.facts.label import model_label
from attnprof.facts.shape import AttentionShape, ShapeError, layer_windows

transformers = pytest.importorskip("transformers")

_BASE = {"num_hidden_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128}
W = 256


def _slide(*idx: int, n: int = 8, w: int = W) -> tuple[int | None, ...]:
    return tuple(w if i in idx else None for i in range(n))


ALL = _slide(*range(8))
NONE: tuple[int | None, ...] = ()

# (config class, kwargs beyond _BASE, expected per-layer windows)
CASES: list[tuple[str, dict[str, Any], tuple[int | None, ...]]] = [
    # Qwen2/Qwen3: window only with use_sliding_window, on layers >= max_window_layers.
    ("Qwen2Config", {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 5},
     _slide(5, 6, 7)),
    ("Qwen2Config", {"sliding_window": W, "max_window_layers": 5}, NONE),
    ("Qwen2Config", {"use_sliding_window": False, "sliding_window": W}, NONE),
    ("Qwen3Config", {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 2},
     _slide(2, 3, 4, 5, 6, 7)),
    ("Qwen3Config", {"use_sliding_window": True, "sliding_window": W}, NONE),  # default 28
    # Qwen2-MoE: even layers below max_window_layers.
    ("Qwen2MoeConfig", {"use_sliding_window": True, "sliding_window": W,
                        "max_window_layers": 5}, _slide(0, 2, 4)),
    # Qwen3-MoE: every layer (no layer_types; max_window_layers is not read).
    ("Qwen3MoeConfig", {"use_sliding_window": True, "sliding_window": W}, ALL),
    ("Qwen3MoeConfig", {"sliding_window": W}, NONE),
    # Gemma2 / GPT-OSS: even layers.
    ("Gemma2Config", {"sliding_window": W}, _slide(0, 2, 4, 6)),
    ("GptOssConfig", {"sliding_window": W, "num_local_experts": 4}, _slide(0, 2, 4, 6)),
    # Gemma3: sliding_window_pattern (default 6), window halved when bidirectional.
    ("Gemma3TextConfig", {"sliding_window": W, "num_hidden_layers": 12},
     _slide(0, 1, 2, 3, 4, 6, 7, 8, 9, 10, n=12)),
    ("Gemma3TextConfig", {"sliding_window": W, "sliding_window_pattern": 3},
     _slide(0, 1, 3, 4, 6, 7)),
    ("Gemma3TextConfig", {"sliding_window": W, "use_bidirectional_attention": True},
     _slide(0, 1, 2, 3, 4, 6, 7, w=W // 2 + 1)),
    # Cohere2: pattern default 4.
    ("Cohere2Config", {"sliding_window": W}, _slide(0, 1, 2, 4, 5, 6)),
    ("Cohere2Config", {"sliding_window": W, "sliding_window_pattern": 2}, _slide(0, 2, 4, 6)),
    # OLMo3: every 4th layer full; Exaone4: sliding_window_pattern default 4.
    ("Olmo3Config", {"sliding_window": W}, _slide(0, 1, 2, 4, 5, 6)),
    ("Exaone4Config", {"sliding_window": W, "sliding_window_pattern": 2}, _slide(0, 2, 4, 6)),
    # Mistral family: every layer, or none.
    ("MistralConfig", {"sliding_window": W}, ALL),
    ("MistralConfig", {"sliding_window": None}, NONE),
    ("MixtralConfig", {"sliding_window": W}, ALL),
    ("Phi3Config", {"sliding_window": W, "pad_token_id": 0}, ALL),
    ("Starcoder2Config", {"sliding_window": W}, ALL),
    ("MinistralConfig", {"sliding_window": W}, ALL),
    # SmolLM3: the NoPE layers (every 4th) when use_sliding_window.
    ("SmolLM3Config", {"use_sliding_window": True, "sliding_window": W}, _slide(3, 7)),
    ("SmolLM3Config", {"sliding_window": W}, NONE),
    # Llama 4: chunked attention is not a sliding window.
    ("Llama4TextConfig", {"attention_chunk_size": W}, NONE),
]


def _ids(case: tuple[str, dict[str, Any], Any]) -> str:
    return case[0] + ":" + ",".join(f"{k}={v}" for k, v in case[1].items())


def _build(cls_name: str, kwargs: dict[str, Any]) -> Any:
    cls = getattr(transformers, cls_name)
    return cls(**{**_BASE, **kwargs})


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_windows_match_transformers(case: tuple[str, dict[str, Any], tuple[int | None, ...]]
                                    ) -> None:
    cls_name, kwargs, want = case
    cfg = _build(cls_name, kwargs)
    n = cfg.num_hidden_layers
    # transformers' own derivation, where the class has one
    types = getattr(cfg, "layer_types", None)
    if types is not None and cls_name not in ("MistralConfig",):
        sw = getattr(cfg, "sliding_window", None)
        derived = tuple(sw if t == "sliding_attention" else None for t in types)
        assert (derived if any(derived) else ()) == want
    assert AttentionShape.from_config(cfg).layer_windows == want
    d = cfg.to_dict()
    assert AttentionShape.from_config(d).layer_windows == want
    assert AttentionShape.from_config(json.loads(json.dumps(d))).layer_windows == want
    # An older config.json: what the checkpoint author wrote, no derived layer_types.
    raw = {"model_type": cfg.model_type, **_BASE, **kwargs}
    shape = AttentionShape.from_config(raw)
    assert shape.layer_windows == want
    assert shape.num_layers == n and shape.num_heads == 4 and shape.num_kv_heads == 2
    assert shape.head_dim == 16 and shape.group_size == 2


def test_multimodal_config_reads_text_tower(tmp_path: Path) -> None:
    cfg = transformers.Gemma3Config(text_config={**_BASE, "sliding_window": W,
                                                 "num_hidden_layers": 12})
    want = _slide(0, 1, 2, 3, 4, 6, 7, 8, 9, 10, n=12)
    assert AttentionShape.from_config(cfg).layer_windows == want
    assert AttentionShape.from_config(cfg.to_dict()).layer_windows == want
    cfg.save_pretrained(tmp_path)
    shape = AttentionShape.from_model_dir(tmp_path)
    assert shape.layer_windows == want and shape.num_layers == 12
    assert shape.layer_types[5] == "full_attention" and shape.window(0) == W


def test_config_json_conventions_without_transformers() -> None:
    base = {**_BASE, "sliding_window": 64}
    # Older Gemma3/Cohere2 files: interleaved_sliding_window + sliding_window_pattern.
    old = {**_BASE, "model_type": "cohere2", "interleaved_sliding_window": 64,
           "sliding_window_pattern": 4}
    assert layer_windows(old, 8) == _slide(0, 1, 2, 4, 5, 6, w=64)
    # Exaone4's string pattern: L local, G global, last layer always global.
    ex = {**base, "model_type": "exaone4", "sliding_window_pattern": "LLG"}
    assert layer_windows(ex, 8) == _slide(0, 1, 3, 4, 6, w=64)
    # Class defaults when the key is absent (GPT-OSS: 128), none for Llama.
    assert layer_windows({**_BASE, "model_type": "gpt_oss"}, 8) == _slide(0, 2, 4, 6, w=128)
    assert layer_windows({**_BASE, "model_type": "llama"}, 8) == ()
    # An unknown family with sliding_window: every layer; with a pattern: the pattern.
    assert layer_windows({**base, "model_type": "x"}, 8) == _slide(*range(8), w=64)
    assert layer_windows({**base, "model_type": "x", "sliding_window_pattern": 2}, 8) == \
        _slide(0, 2, 4, 6, w=64)
    # Explicit layer_types win over the family default (Gemma2 written by new transformers).
    lt = ["full_attention"] * 7 + ["sliding_attention"]
    assert layer_windows({**base, "model_type": "gemma2", "layer_types": lt}, 8) == \
        _slide(7, w=64)
    # Gemma4 forces its last layer to full attention.
    assert layer_windows({**base, "model_type": "gemma4_text"}, 8) == \
        _slide(0, 1, 2, 3, 4, 6, w=64)


def test_shape_fields_and_errors(tmp_path: Path) -> None:
    s = AttentionShape.from_config({**_BASE, "torch_dtype": "float16"})
    assert s.dtype == "float16" and s.dtype_bytes == 2
    assert s.kv_bytes_per_token_layer == 2 * 2 * 16 * 2
    assert s.layer_windows == () and s.window(3) is None
    assert AttentionShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 4,
                                       "hidden_size": 64}).head_dim == 16
    with pytest.raises(ShapeError, match="num_hidden_layers"):
        AttentionShape.from_config({"num_attention_heads": 4})
    with pytest.raises(ShapeError, match="cannot read"):
        AttentionShape.from_model_dir(tmp_path)


# ---- dtypes ----

def test_dtype_bytes_torch_names_and_vllm_kv_dtypes() -> None:
    torch = pytest.importorskip("torch")
    assert dtype_bytes(torch.float32) == 4 and dtype_bytes(torch.bfloat16) == 2
    assert dtype_bytes(torch.float16) == 2 and dtype_bytes(torch.float64) == 8
    assert dtype_bytes(torch.float8_e4m3fn) == 1
    for name, size in (("float32", 4), ("float", 4), ("half", 2), ("bf16", 2), ("fp16", 2),
                       ("BFloat16", 2), ("torch.bfloat16", 2), ("fp8", 1), ("fp8_e4m3", 1),
                       ("fp8_e5m2", 1), ("float8_e4m3fn", 1), ("int8", 1), ("uint8", 1)):
        assert dtype_bytes(name) == size, name
    assert dtype_bytes("auto", default=2) == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("int3")


def test_normalize_and_rules_use_one_table() -> None:
    from attnprof.analyze import rules

    assert {normalize(n) for n in ("float32", "half", "bfloat16", "float8_e4m3fn")} == \
        {"fp32", "fp16", "bf16", "fp8"}
    assert {"fp64", "fp32", "fp16", "bf16", "fp8", "int8"} == CANONICAL
    # Every dtype name the compatibility matrix uses is canonical (a fixed point).
    for backend in rules.load_matrix()["backends"].values():
        for dt in backend.get("dtypes") or []:
            assert normalize(dt) == dt and rules.normalize_dtype(dt) == dt
    assert rules.normalize_dtype("torch.float16") == "fp16"
    with pytest.raises(ValueError, match="unknown dtype"):
        rules.normalize_dtype("int3")


def test_savings_and_memory_use_the_table() -> None:
    from attnprof.analyze import memory

    assert memory.kv_bytes_per_token(2, 16, "bf16")["per_layer"] == 2 * 2 * 16 * 2
    assert AttentionShape.from_config({**_BASE, "torch_dtype": "float32"}).dtype_bytes == 4
    assert AttentionShape.from_config({**_BASE, "dtype": "float8_e4m3fn"}).dtype_bytes == 1


# ---- label ----

def test_model_label() -> None:
    assert model_label(SimpleNamespace(served_model_name=["chat", "alias"], model="/m")) == \
        "chat"
    assert model_label(SimpleNamespace(served_model_name="chat", model="/m")) == "chat"
    assert model_label(SimpleNamespace(served_model_name=None, model="/ckpt/qwen")) == \
        "/ckpt/qwen"
    assert model_label(SimpleNamespace(served_model_name=[], model=None)) == "unknown"
    assert model_label(None) == "unknown"


def test_profile_run_shape_and_kv_use_the_reader() -> None:
    from attnprof.tools.profile_run import _kv_total, _profile_model

    def model(shape: AttentionShape) -> Any:
        return _profile_model(shape, name="m", path="", architecture="?",
                              attn_implementation="sdpa", dtype="float32", static_bytes=0)

    shape = AttentionShape.from_config(transformers.Gemma2Config(**_BASE, sliding_window=W))
    m = model(shape)
    assert m.layer_windows == list(_slide(0, 2, 4, 6))
    assert m.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert m.sliding_window == W and m.vocab_size == 128
    per_layer = 2 * 2 * 16 * 4  # K and V, 2 KV heads, d 16, fp32
    # 4 windowed layers keep W tokens, 4 full layers keep L.
    assert _kv_total(shape, "float32", 1, 1000) == per_layer * (4 * W + 4 * 1000)
    assert _kv_total(shape, "float32", 2, 100) == per_layer * 2 * 8 * 100
    full = AttentionShape.from_config(transformers.LlamaConfig(**_BASE))
    assert model(full).layer_windows is None and model(full).sliding_window is None
    assert _kv_total(full, "bf16", 1, 10) == 2 * 2 * 16 * 2 * 8 * 10


def test_torch_dtype_from_any_alias() -> None:
    import torch

    from attnprof.facts.dtypes import torch_dtype

    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("half") is torch.float16
    assert torch_dtype("torch.float32") is torch.float32
    assert torch_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="not a compute dtype"):
        torch_dtype("fp8_e4m3")


def test_layer_ranges_are_written_one_way() -> None:
    from attnprof.facts.layers import format_layers, ranges_text, runs

    assert runs([5, 0, 1, 2, 2]) == [(0, 2), (5, 5)]
    assert ranges_text([5, 0, 1, 2]) == "0-2,5" and ranges_text([]) == ""
    assert ranges_text([28, 29, 30, 5], ", ", "\u2013", "L") == "L5, L28\u2013L30"
    # Each reader of the one definition: a finding, the demo sentence, a table, the report.
    from attnprof.exporters.report_format import layers_text

    assert format_layers([0, 1, 2, 5]) == "layers 0-2, 5" and format_layers([3]) == "layer 3"
    assert format_layers(iter([0, 1, 2, 5])) == "layers 0-2, 5"  # a one-shot iterator too
    assert layers_text(["L28", "L29", "L30", "L5"]) == "L5, L28\u2013L30"


def test_durations_have_one_unit_table_and_two_grammars() -> None:
    from attnprof.facts.durations import DurationError, promql_range, promql_seconds, seconds

    assert seconds("500ms", "--x") == 0.5 and seconds(" 2 MIN ", "--x") == 120.0
    assert seconds("1.5", "--x") == 1.5
    assert promql_range("1h30m") == "1h30m" and promql_seconds("1h30m") == 5400.0
    assert promql_seconds("1d") == 86400.0 and promql_seconds("1w") == 7 * 86400.0
    for bad, parse in (("1h30m", lambda t: seconds(t, "--duration")),  # not a local duration
                       ("1.5h", promql_range), ("2min", promql_range),  # nor PromQL
                       ("500ms", promql_seconds)):  # under a second
        with pytest.raises(DurationError) as info:
            parse(bad)
        assert "\n" not in str(info.value)
