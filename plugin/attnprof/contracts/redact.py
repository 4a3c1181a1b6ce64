"""Secrets out of a command line: the one redaction every captured argv goes through.

A process's command line is copied into provenance, and from there into snapshots, records,
reports and diffs. :func:`redact_argv` replaces with ``<redacted>``:

- every value of a flag whose name has a secret segment, ``=`` and space forms: every word up
  to the next flag (``--api-key k1 k2``, vLLM takes several; after ``--api-key=k1`` too, as a
  stray ``k2`` is a key by intent), ``--hf-token=X``, ``--hf-overrides.auth_token X``;
- ``NAME=value`` words (environment style) whose NAME is secret (``OPENAI_API_KEY=sk-...``);
- URL credentials (``//user:pass@``) and secret query parameters (``?api_key=...``) anywhere;
- ``Bearer``/``Basic`` credentials and ``Header-Name: value`` words with a secret name;
- in a value that parses as a JSON object or array (``--hf-overrides``, ``-cc``, ...): keys
  stay, string and number values under a secret key are redacted at any depth, and every
  string is cleaned of URL credentials as above.

Secret segments: key, api-key, token, secret, password, passwd, auth, authorization,
credential(s), bearer, cookie, signature, sig, split on ``-``, ``_``, ``.`` and camelCase
(``apiKey``, ``HFToken``).
Plurals that are counts are not secrets: ``--max-num-batched-tokens``, ``max_tokens`` (the
segment is ``tokens``), nor are ``--tokenizer``/``--tokenizer-mode`` (``tokenizer``): they are
real settings a diff must show. Idempotent: redacting twice gives the same words.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["REDACTED", "is_secret_name", "redact_argv", "redact_value"]

REDACTED = "<redacted>"

# One segment of a name (split on - _ . and camelCase). "tokens", "tokenizer", "keyfile" are
# other words: only a whole segment counts.
_SECRET_SEGMENT = re.compile(
    r"(?:^|[-_.])(?:api[-_]?keys?|apikey|key|token|secrets?|password|passwd|auth|"
    r"authorization|credentials?|bearer|cookie|signature|sig)(?:$|[-_.])", re.I)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_FLAG = re.compile(r"--?[A-Za-z]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_URL_CREDS = re.compile(r"//[^/@\s\"']+@")
_QUERY = re.compile(r"([?&#;])([^=&#;?\s\"']+)=([^&#;\s\"']*)")
_AUTH_SCHEME = re.compile(r"\b(Bearer|Basic|Token)(\s+)(?!<redacted>)[^\s\"',;]+", re.I)
_HEADER = re.compile(r"\s*([A-Za-z0-9_-]+)\s*:\s*(\S.*)", re.S)
# Quoted "key": "value" pairs in a value that looked like JSON but did not parse.
_QUOTED_PAIR = re.compile(r"([\"'])([^\"']+)\1(\s*[:=]\s*)([\"'])(.*?)\4")


def is_secret_name(name: str) -> bool:
    """True when a flag, variable, JSON key or query parameter name has a secret segment
    (``--api-key``, ``HF_TOKEN``, ``apiKey``, ``hf-overrides.auth_token``); False for
    ``--max-num-batched-tokens``, ``--tokenizer``, ``--tokenizer-mode``."""
    return bool(_SECRET_SEGMENT.search(_CAMEL.sub("_", name.lstrip("-"))))


def _redact_text(text: str) -> str:
    text = _URL_CREDS.sub("//" + REDACTED + "@", text)
    text = _QUERY.sub(lambda m: m.group(0) if not is_secret_name(m.group(2))
                      else f"{m.group(1)}{m.group(2)}={REDACTED}", text)
    return _AUTH_SCHEME.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)


def _redact_json(obj: Any, secret: bool) -> Any:
    if isinstance(obj, dict):
        return {k: _redact_json(v, secret or (isinstance(k, str) and is_secret_name(k)))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact_json(v, secret) for v in obj]
    if isinstance(obj, bool) or obj is None:  # a switch or a null reveals nothing
        return obj
    if secret:
        return REDACTED
    return _redact_text(obj) if isinstance(obj, str) else obj


def redact_value(value: str) -> str:
    """One value with its secrets redacted: a JSON object or array by key (kept compact and
    otherwise unchanged when nothing in it is secret), a ``Header: value`` with a secret
    name, URL credentials and secret query parameters, auth schemes."""
    head = value.lstrip()[:1]
    if head in ("{", "["):
        try:
            doc = json.loads(value)
        except (ValueError, RecursionError):
            doc = None
            value = _QUOTED_PAIR.sub(
                lambda m: m.group(0) if not is_secret_name(m.group(2)) else
                f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{m.group(4)}{REDACTED}"
                f"{m.group(4)}", value)
        if isinstance(doc, (dict, list)):
            try:
                clean = _redact_json(doc, False)
            except RecursionError:  # nested past the stack: fail closed
                return REDACTED
            return value if clean == doc else json.dumps(clean, separators=(",", ":"))
    header = _HEADER.fullmatch(value)
    if header is not None and is_secret_name(header.group(1)):
        return f"{header.group(1)}: {REDACTED}"
    return _redact_text(value)


def _is_flag(word: str) -> bool:
    return word == "--" or bool(_FLAG.match(word))


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with every secret replaced by ``<redacted>`` (see the module docstring); the
    flags themselves and every other word stay, so the command still reads as it was run.
    Never raises on any list of strings."""
    out: list[str] = []
    hiding = False  # after a secret flag: every word up to the next flag is one of its values
    for word in map(str, argv):
        if _is_flag(word):
            name, eq, value = word.partition("=")
            hiding = is_secret_name(name)
            if not eq:
                out.append(word)
            else:
                out.append(f"{name}={REDACTED if hiding else redact_value(value)}")
            continue
        if hiding:
            out.append(REDACTED)
            continue
        name, eq, value = word.partition("=")
        if eq and _ENV_NAME.fullmatch(name) and is_secret_name(name):
            out.append(f"{name}={REDACTED}")
        else:
            out.append(redact_value(word))
    return out
