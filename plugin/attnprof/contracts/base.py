"""The machinery every contract shares: a kind and a version on the wire, one
``to_json``/``from_json`` pair, typed decoding, and a JSON Schema generated from the types.

Wire form: ``{"schema_version": "<kind>/<major>.<minor>", ...fields}``. A reader accepts any
minor version of its major (unknown fields are ignored, missing optional fields default) and
refuses another kind or another major with one line (:class:`ContractError`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import math
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import (
    Annotated,
    Any,
    ClassVar,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

__all__ = [
    "ContractError",
    "Document",
    "Fraction",
    "NonNegative",
    "Record",
    "decode",
    "json_schema",
    "parse_version",
]

T = TypeVar("T")
D = TypeVar("D", bound="Document")

Fraction = Annotated[float, {"minimum": 0, "maximum": 1}]
"""A ratio in [0, 1] (the bounds are published in the schema)."""
NonNegative = Annotated[int, {"minimum": 0}]
"""A count or a size in bytes."""


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
    # JSON has no NaN/Infinity (Starlette's JSONResponse refuses them): send null. A float
    # field reads null back as NaN, so what to_json writes from_json reads.
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _fields_json(value: Any) -> dict[str, Any]:
    return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)
            if not f.name.startswith("_")}


def _encode(value: Any) -> Any:
    if isinstance(value, Document):
        return value.to_json()  # a document inside another one keeps its version tag
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _fields_json(value)
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        value = value.item()  # numpy scalars (json.dumps refuses int64)
    return _finite(value)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


def _strip(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _at(where: str) -> str:
    return where or "value"


def _one_line(text: str) -> str:
    """A message with the newlines of quoted keys or values escaped (it is printed as one
    line), and cut to a readable length."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= 400 else text[:397] + "..."


def _short(value: Any) -> str:
    """``repr(value)`` cut to one short line: a message quotes the value, not a whole file."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def decode(tp: Any, value: Any, where: str = "") -> Any:
    """Build ``tp`` (a dataclass, list/dict/tuple of them, Optional, Literal, a primitive or
    Any) from JSON data; :class:`ContractError` naming the field's path on a mismatch."""
    tp = _strip(tp)
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
        raise ContractError(errors[0] if errors else f"{_at(where)}: unexpected null")
    if origin is typing.Literal:
        # 1 == True in Python: compare the JSON type too.
        if not any(value == a and type(value) is type(a) for a in get_args(tp)):
            raise ContractError(f"{_at(where)}: {_short(value)} is not one of "
                                f"{', '.join(map(repr, get_args(tp)))}")
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list):
            raise ContractError(f"{_at(where)}: expected a list, got {type(value).__name__}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ContractError(f"{_at(where)}: expected {len(args)} items, got "
                                    f"{len(value)}")
            return tuple(decode(a, v, f"{where}[{i}]") for i, (a, v) in
                         enumerate(zip(args, value, strict=True)))
        item = args[0] if args else Any
        out = [decode(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple or tp is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ContractError(f"{_at(where)}: expected an object, got "
                                f"{type(value).__name__}")
        args = get_args(tp)
        kt, vt = (_strip(args[0]), args[1]) if args else (str, Any)
        return {_key(kt, k, where): decode(vt, v, f"{where}.{k}".lstrip("."))
                for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ContractError(f"{where or tp.__name__}: expected an object, got "
                                f"{type(value).__name__}")
        if issubclass(tp, Document) and "schema_version" in value:
            tp.check_version(value)  # a nested document of another major is refused too
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
        if value is None:
            return math.nan  # what _finite wrote for NaN/Infinity
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ContractError(f"{_at(where)}: expected a number, got {_short(value)}")
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float (JSON allows 400 digits)
            raise ContractError(f"{_at(where)}: {_short(value)} is too large for a number"
                                ) from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ContractError(f"{_at(where)}: expected an integer, got {_short(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ContractError(f"{_at(where)}: expected true/false, got {_short(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ContractError(f"{_at(where)}: expected a string, got {_short(value)}")
        return value
    raise TypeError(f"contracts cannot decode type {tp!r}")  # a bug in a contract, not data


def _key(kt: Any, key: Any, where: str) -> Any:
    # JSON object keys are strings; int-keyed maps are written with str(k).
    if kt is int:
        try:
            return int(key)
        except (TypeError, ValueError):
            raise ContractError(f"{_at(where)}: key {key!r} is not an integer") from None
    return key


class Record:
    """A typed part of a document (no version of its own)."""

    def to_json(self) -> dict[str, Any]:
        return _fields_json(self)

    @classmethod
    def from_json(cls: type[T], data: Any) -> T:
        """The record in ``data``; :class:`ContractError` (one line) for a missing field or a
        field of the wrong type."""
        try:
            out: T = decode(cls, data, "")
        except ContractError as err:
            raise ContractError(_one_line(str(err))) from None
        return out


class Document(Record):
    """A versioned document. Subclasses set ``KIND`` and ``VERSION`` ((major, minor))."""

    KIND: ClassVar[str] = ""
    VERSION: ClassVar[tuple[int, int]] = (1, 0)

    @classmethod
    def version_tag(cls) -> str:
        return f"{cls.KIND}/{cls.VERSION[0]}.{cls.VERSION[1]}"

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": self.version_tag(), **_fields_json(self)}

    @classmethod
    def check_version(cls, data: Any) -> None:
        """:class:`ContractError` unless ``data`` is this kind at this major version."""
        if not isinstance(data, Mapping):
            raise ContractError(f"not a {cls.KIND} document: expected a JSON object, got "
                                f"{type(data).__name__}")
        tag = data.get("schema_version")
        if "schema_version" not in data:
            raise ContractError(f"not a {cls.KIND} document: no schema_version")
        kind, major, _minor = parse_version(tag)
        if kind != cls.KIND:
            raise ContractError(f"this is a {kind} document, not {cls.KIND}")
        if major != cls.VERSION[0]:
            raise ContractError(
                f"{cls.KIND} version {major} is not supported (this attnprof reads version "
                f"{cls.VERSION[0]}.x); use a matching attnprof")

    @classmethod
    def from_json(cls: type[D], data: Any) -> D:
        """The document in ``data`` (any minor version of this major); :class:`ContractError`
        (one line) for another kind or major, or a field of the wrong type."""
        try:
            cls.check_version(data)
            body = {k: v for k, v in data.items() if k != "schema_version"}
            out: D = decode(cls, body, "")
        except ContractError as err:
            msg = str(err)
            raise ContractError(_one_line(msg if msg.startswith(("not a", "this is a",
                                                                  cls.KIND))
                                          else f"{cls.KIND}: {msg}")) from None
        return out


# ----- JSON Schema from the types -----
def _schema(tp: Any, defs: dict[str, Any], owners: dict[str, type]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    while get_origin(tp) is Annotated:
        for meta in get_args(tp)[1:]:
            if isinstance(meta, dict):
                extra.update(meta)
        tp = get_args(tp)[0]
    out = _schema_bare(tp, defs, owners)
    return {**out, **extra} if extra else out


def _schema_bare(tp: Any, defs: dict[str, Any], owners: dict[str, type]) -> dict[str, Any]:
    if tp is Any or tp is object:
        return {}
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return {"anyOf": [_schema(a, defs, owners) for a in get_args(tp)]}
    if tp is type(None):
        return {"type": "null"}
    if origin is typing.Literal:
        vals = list(get_args(tp))
        return {"const": vals[0]} if len(vals) == 1 else {"enum": vals}
    if origin in (list, tuple) or tp in (list, tuple):
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return {"type": "array", "prefixItems": [_schema(a, defs, owners) for a in args],
                    "items": False, "minItems": len(args)}
        return {"type": "array", "items": _schema(args[0], defs, owners) if args else {}}
    if origin is dict or tp is dict:
        args = get_args(tp)
        out: dict[str, Any] = {"type": "object",
                               "additionalProperties": (_schema(args[1], defs, owners)
                                                        if args else {})}
        if args and _strip(args[0]) is int:
            out["propertyNames"] = {"pattern": "^-?[0-9]+$"}
        return out
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        name = tp.__name__
        if owners.setdefault(name, tp) is not tp:
            raise TypeError(f"two contract types named {name}: {owners[name]} and {tp}")
        if name not in defs:
            defs[name] = {}  # placeholder against recursion
            hints = _hints(tp)
            docs = _field_docs(tp)
            props: dict[str, Any] = {}
            required = []
            if issubclass(tp, Document):
                props["schema_version"] = _version_schema(tp)
            for f in dataclasses.fields(tp):
                if f.name.startswith("_"):
                    continue
                props[f.name] = _schema(hints[f.name], defs, owners)
                if f.name in docs:
                    props[f.name] = {"description": docs[f.name], **props[f.name]}
                if (f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING):
                    required.append(f.name)
            body: dict[str, Any] = {"type": "object"}
            if tp.__doc__ and not tp.__doc__.startswith(f"{name}("):  # not the dataclass repr
                body["description"] = " ".join(tp.__doc__.split())
            body["properties"] = props
            if required:
                body["required"] = required
            defs[name] = body
        return {"$ref": f"#/$defs/{name}"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": ["number", "null"]}  # null: NaN/Infinity, which JSON cannot carry
    if tp is str:
        return {"type": "string"}
    raise TypeError(f"contracts cannot describe type {tp!r}")


def _version_schema(cls: type[Document]) -> dict[str, Any]:
    return {"type": "string",
            "pattern": f"^{cls.KIND.replace('.', '[.]')}/{cls.VERSION[0]}" r"(\.[0-9]+)?$"}


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right under a field) of ``cls`` and its bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        out.update(getattr(klass, "__field_docs__", {}))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        stmts = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) \
            else []
        for a, b in itertools.pairwise(stmts):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)):
                out[a.target.id] = " ".join(b.value.value.split())
    return out


def json_schema(cls: type[Record], *, part_of: type[Document] | None = None
                ) -> dict[str, Any]:
    """Draft 2020-12 JSON Schema of a document (or of a record that is ``part_of`` one),
    generated from its dataclass types; field descriptions are the attribute docstrings."""
    defs: dict[str, Any] = {}
    _schema(cls, defs, {})
    root = defs.pop(cls.__name__)
    if issubclass(cls, Document):
        root["required"] = ["schema_version", *root.get("required", [])]
        sid, title = f"{cls.KIND}/{cls.VERSION[0]}", cls.KIND
    elif part_of is not None:
        sid = f"{part_of.KIND}/{part_of.VERSION[0]}/{cls.__name__}"
        title = f"{cls.__name__} (part of {part_of.KIND} {part_of.VERSION[0]}.x)"
    else:
        raise TypeError(f"{cls.__name__} is a Record: say which document it is part_of")
    out = {"$schema": "https://json-schema.org/draft/2020-12/schema",
           "$id": f"https://attnprof.dev/schema/{sid}", "title": title, **root}
    if defs:
        out["$defs"] = dict(sorted(defs.items()))
    return out
