"""The keyless snapshot's allow-list (attnprof.exporters.snapshot_public): every field of the
snapshot contract is either kept, by name, or withheld, by name. A field added to the
contract later fails here until someone decides which, so nothing new reaches anonymous
clients by default."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from attnprof.contracts.snapshot import Snapshot
from attnprof.exporters import snapshot_public
from attnprof.exporters.snapshot_public import PUBLIC, WITHHELD, public_snapshot


def _dataclasses_in(tp: Any) -> list[type]:
    """The dataclasses a field's annotation holds (through Optional, list, dict, unions)."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return [tp]
    out: list[type] = []
    for arg in typing.get_args(tp):
        out += _dataclasses_in(arg)
    return out


def _unclassified(cls: type, rule: Any, path: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if cls is Snapshot:
        names.append("schema_version")
    missing = []
    for name in names:
        if name in WITHHELD.get(cls.__name__, ()):
            assert name not in rule, f"{path}.{name} is both kept and withheld"
            continue
        if name not in rule:
            missing.append(f"{path}.{name} ({cls.__name__})")
            continue
        sub = rule[name]
        if isinstance(sub, tuple):
            sub = sub[0]
        for inner in _dataclasses_in(hints.get(name)):
            if isinstance(sub, dict):
                missing += _unclassified(inner, sub, f"{path}.{name}")
            elif sub is True:
                missing += _changed_whole(inner, f"{path}.{name}")
    return missing


def _changed_whole(cls: type, path: str) -> list[str]:
    """A class kept whole must have exactly the fields KEPT_WHOLE names (at any depth)."""
    have = tuple(f.name for f in dataclasses.fields(cls))
    if snapshot_public.KEPT_WHOLE.get(cls.__name__) != have:
        return [f"{path} ({cls.__name__} kept whole: {have})"]
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        for inner in _dataclasses_in(hints.get(f.name)):
            out += _changed_whole(inner, f"{path}.{f.name}")
    return out


def test_every_snapshot_field_is_kept_or_withheld_by_name() -> None:
    missing = _unclassified(Snapshot, PUBLIC, "snapshot")
    assert missing == [], ("new snapshot fields: name each in PUBLIC (shown without a key) or "
                           f"WITHHELD in {snapshot_public.__file__}: {missing}")


def test_the_walk_finds_a_field_left_unnamed() -> None:
    # The check above can fail: drop one kept name and it is reported.
    rule = {k: v for k, v in PUBLIC.items() if k != "roofline"}
    assert _unclassified(Snapshot, rule, "snapshot") == ["snapshot.roofline (Snapshot)"]
    worker = dict(PUBLIC["workers"][0])
    worker["layers"] = ({**worker["layers"][0], "phases": ({"calls": True},)},)
    rule = {**PUBLIC, "workers": (worker,)}
    missing = _unclassified(Snapshot, rule, "snapshot")
    assert "snapshot.workers.layers.phases.time_s (PhaseStats)" in missing
    # ... and a field added to a class kept whole (SamplerStats under each worker).
    sampler = snapshot_public.KEPT_WHOLE["SamplerStats"]
    try:
        snapshot_public.KEPT_WHOLE["SamplerStats"] = sampler[:-1]
        missing = _unclassified(Snapshot, PUBLIC, "snapshot")
        assert [m.split(" ")[0] for m in missing] == ["snapshot.workers.sampler"]
    finally:
        snapshot_public.KEPT_WHOLE["SamplerStats"] = sampler


def test_unknown_keys_and_odd_values_never_pass() -> None:
    doc = {"schema_version": "attnprof.snapshot/1.8", "time": 1.0, "model": "m",
           "enabled": True, "future_field": "secret", "head_stats": {"x": 1},
           "workers": [{"pid": 1, "future": 3, "layers": "not-a-list", "error": None}],
           "requests": ["not", "an", "object"],
           "errors": {"api_server": {"endpoint": 1}, "collective_rpc": "no type here"}}
    out = public_snapshot(doc, "hint")
    assert json.loads(json.dumps(out)) == {
        "schema_version": "attnprof.snapshot/1.8", "time": 1.0, "model": "m",
        "enabled": True, "workers": [{"pid": 1, "layers": None, "error": None}],
        "requests": None, "errors": {"api_server": {"endpoint": 1}, "collective_rpc": "error"},
        "restricted": "hint"}
    assert doc["future_field"] == "secret"  # the input is not changed


def test_an_error_keeps_only_an_exception_type_never_a_one_word_message() -> None:
    kind = snapshot_public.error_kind
    assert kind("TimeoutError: workers did not answer within 10 s") == "TimeoutError"
    assert kind("vllm.RPCError: /secret/path") == "vllm.RPCError"
    assert kind("hf_AbCdSecret123") == "error"  # one word: a message, maybe a key
    assert kind("/models/llama: not found") == "error" and kind(None) is None
