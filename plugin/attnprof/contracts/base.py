"""The machinery every contract shares: a kind and a version on the wire, one
``to_json``/``from_json`` pair, typed decoding, and a JSON Schema generated from the types.

Wire form: ``{"schema_version": "<kind>/<major>.<minor>", ...fields}``. A reader accepts any
minor version of its major (unknown fields are ignored, missing optional fields default) and
refuses another kind or another major with one line (:class:`ContractError`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

__all__ = ["ContractError", "Document", "Record", "decode", "json_schema", "parse_version"]

T = TypeVar("T")
D = TypeVar("D", bound="Document")


class ContractError(ValueError):
    """A document of the wrong kind or version, or a field of the wrong type (one line)."""


def parse_version(tag: Any) -> tuple[str, int, int]:
    """``"attnprof.snapshot/1.2"`` -> (``"attnprof.snapshot"``, 1, 2); ``"k/1"`` means 1.0."""
    if not isinstance(tag, str) or "/" not in tag:
        raise ContractError(f"schema_version {tag!r} is not of the form 'kind/major.minor'")
    kind, _, ver = tag.rpartition("/")
    major, _, minor = ver.partition(".")
    try:
        return kind, int(major), int(minor or 0)
    except ValueError:
        raise ContractError(f"schema_version {tag!r} has no numeric version") from None


def _finite(x: Any) -> Any:
    # JSON has no NaN/Infinity (Starlette's JSONResponse refuses them): send null.
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.name.startswith("_")}
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return _finite(value)


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def decode(tp: Any, value: Any, where: str = "") -> Any:
    """Build ``tp`` (a dataclass, list/dict/tuple of them, Optional, a primitive or Any)
    from JSON data; :class:`ContractError` naming the path on a mismatch."""
    if tp is Any or tp is object:
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return decode(a, value, where)
            except ContractError as err:
                errors.append(str(err))
        raise ContractError(errors[0] if errors else f"{where or 'value'}: unexpected null")
    if origin is typing.Literal:
        if value not in get_args(tp):
            raise ContractError(f"{where or 'value'}: {value!r} is not one of {get_args(tp)}")
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list):
            raise ContractError(f"{where or 'value'}: expected a list, got {type(value).__name__}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return tuple(decode(a, v, f"{where}[{i}]") for i, (a, v) in
                         enumerate(zip(args, value, strict=False)))
        item = args[0] if args else Any
        out = [decode(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ContractError(f"{where or 'value'}: expected an object, got "
                                f"{type(value).__name__}")
        args = get_args(tp)
        kt, vt = args if args else (str, Any)
        return {decode(kt, k, where) if kt is not str else k: decode(vt, v, f"{where}.{k}")
                for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ContractError(f"{where or tp.__name__}: expected an object, got "
                                f"{type(value).__name__}")
        hints = _hints(tp)
        kw = {}
        for f in dataclasses.fields(tp):
            if f.name.startswith("_") or not f.init:
                continue
            if f.name in value:
                kw[f.name] = decode(hints[f.name], value[f.name], f"{where}.{f.name}".lstrip("."))
            elif (f.default is dataclasses.MISSING
                  and f.default_factory is dataclasses.MISSING):
                raise ContractError(f"{tp.__name__}: missing field {f.name!r}"
                                    + (f" at {where}" if where else ""))
        return tp(**kw)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ContractError(f"{where or 'value'}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ContractError(f"{where or 'value'}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ContractError(f"{where or 'value'}: expected true/false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ContractError(f"{where or 'value'}: expected a string, got {value!r}")
        return value
    return value


class Record:
    """A typed part of a document (no version of its own)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = _encode(self)
        return out

    @classmethod
    def from_json(cls: type[T], data: Any) -> T:
        out: T = decode(cls, data, "")
        return out


class Document(Record):
    """A versioned document. Subclasses set ``KIND`` and ``VERSION`` ((major, minor))."""

    KIND: ClassVar[str] = ""
    VERSION: ClassVar[tuple[int, int]] = (1, 0)

    @classmethod
    def version_tag(cls) -> str:
        return f"{cls.KIND}/{cls.VERSION[0]}.{cls.VERSION[1]}"

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": self.version_tag(), **super().to_json()}

    @classmethod
    def check_version(cls, data: Any) -> None:
        if not isinstance(data, Mapping):
            raise ContractError(f"not a {cls.KIND} document: expected a JSON object")
        kind, major, _minor = parse_version(data.get("schema_version"))
        if kind != cls.KIND:
            raise ContractError(f"this is a {kind} document, not {cls.KIND}")
        if major != cls.VERSION[0]:
            raise ContractError(
                f"{cls.KIND} version {major} is not supported (this attnprof reads version "
                f"{cls.VERSION[0]}); use a matching attnprof")

    @classmethod
    def from_json(cls: type[D], data: Any) -> D:
        cls.check_version(data)
        body = {k: v for k, v in data.items() if k != "schema_version"}
        out: D = decode(cls, body, "")
        return out


# ----- JSON Schema from the types -----
def _schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    if tp is Any or tp is object:
        return {}
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return {"anyOf": [_schema(a, defs) for a in get_args(tp)]}
    if tp is type(None):
        return {"type": "null"}
    if origin is typing.Literal:
        return {"enum": list(get_args(tp))}
    if origin in (list, tuple) or tp in (list, tuple):
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return {"type": "array", "prefixItems": [_schema(a, defs) for a in args]}
        return {"type": "array", "items": _schema(args[0], defs) if args else {}}
    if origin is dict or tp is dict:
        args = get_args(tp)
        return {"type": "object",
                "additionalProperties": _schema(args[1], defs) if args else {}}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}  # placeholder against recursion
            hints = _hints(tp)
            props, required = {}, []
            for f in dataclasses.fields(tp):
                if f.name.startswith("_"):
                    continue
                props[f.name] = _schema(hints[f.name], defs)
                doc = _field_doc(tp, f.name)
                if doc:
                    props[f.name]["description"] = doc
                if (f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING):
                    required.append(f.name)
            body: dict[str, Any] = {"type": "object", "properties": props}
            if required:
                body["required"] = required
            if tp.__doc__:
                body["description"] = " ".join(tp.__doc__.split())
            defs[name] = body
        return {"$ref": f"#/$defs/{name}"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    return {}


def _field_doc(cls: type, name: str) -> str | None:
    docs: dict[str, str] = getattr(cls, "__field_docs__", {})
    return docs.get(name)


def json_schema(cls: type[Document]) -> dict[str, Any]:
    """Draft 2020-12 JSON Schema of a document, generated from its dataclass types."""
    defs: dict[str, Any] = {}
    ref = _schema(cls, defs)
    root = defs.pop(cls.__name__)
    root["properties"] = {
        "schema_version": {"type": "string",
                           "pattern": f"^{cls.KIND.replace('.', '[.]')}/{cls.VERSION[0]}"
                                      r"(\.[0-9]+)?$"},
        **root["properties"]}
    root["required"] = ["schema_version", *root.get("required", [])]
    del ref
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://attnprof.dev/schema/{cls.KIND}/{cls.VERSION[0]}",
            "title": cls.KIND, **root, "$defs": defs}
