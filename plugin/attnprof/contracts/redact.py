"""Secrets out of a command line: the one redaction every captured argv goes through.

A process's command line is copied into provenance, and from there into snapshots, records,
reports and diffs. :func:`redact_argv` reads each option word the way vLLM's own parser does
and replaces with ``<redacted>``:

- the values of vLLM's secret options (``--api-key``: every word up to the next flag;
  ``--hf-token``: its one value), under any name vLLM accepts for them: exact, ``_`` for
  ``-``, and every unique prefix (argparse's abbreviations ``--api-k``, ``--hf-tok``). vLLM's
  option table (each option's nargs and whether it is secret) ships as data read from the
  installed vLLM's parser (:mod:`attnprof.capture.vllm.option_table`); an option vLLM knows
  and calls not secret stays readable whatever its name (``--allow-credentials`` is a switch:
  the model after it stays; ``--long-prefill-token-threshold 2048`` stays);
- for options vLLM does not know (or an ambiguous prefix): every value of a flag whose name
  is secret by :func:`is_secret_name`, up to the next flag, ``=`` and space forms;
  ``--hf-overrides.auth_token X`` (a dotted key) by the key's last part;
- ``NAME=value`` (environment style) whose NAME is secret, as a word, as an ``=`` flag's
  value or inside any string (``HF_TOKEN=hf_...`` in a JSON string);
- URL credentials (``//user:p@ss@`` up to the last ``@`` before the host) and secret query
  parameters (``?api_key=``, ``?jwt=``, ``%``-encoded names such as ``api%5Fkey``) anywhere;
- ``Bearer``/``Basic``/``Token``/``ApiKey`` credentials and ``Header-Name: value`` words
  with a secret name;
- a value that is itself a command line (``--baseline-args "--api-key X"``, a flag whose
  value is vLLM's own words, abbreviated or not): its shell words redacted as an argv
  (:func:`redact_command`), the word unchanged when nothing in it is secret;
- in a value that parses as a JSON object or array (``--hf-overrides``, ``-cc``, ...): keys
  stay, string and number values under a secret key are redacted at any depth, and every
  string is cleaned as above.

A name is secret (:func:`is_secret_name`) when its last part (split on ``-``, ``_``, ``.``
and camelCase; trailing digits and ``value``/``b64``-style suffixes skipped) is one of key,
token, secret(s), password(s), passwd, pwd, passphrase, auth, authorization, credential(s),
creds, bearer, cookie(s), signature, sig, jwt, optionally run together with a qualifier
(``apikey``, ``hftoken``, ``secretkey``); plurals ``tokens``/``keys`` and the word ``pass``
only after a qualifier (``api_tokens``, ``db_pass``) or alone (``pass``). So counts and
tuning values stay: ``max_tokens``, ``--max-num-batched-tokens``, ``token_threshold``,
``pass_config``, ``--tokenizer``, ``--ssl-keyfile`` (a path). Idempotent: redacting twice
gives the same words.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

__all__ = ["REDACTED", "VLLM_OPTIONS_PATH", "is_secret_name", "redact_argv", "redact_command",
           "redact_value", "vllm_option"]

REDACTED = "<redacted>"
VLLM_OPTIONS_PATH = Path(__file__).resolve().parent / "data" / "vllm_serve_options.json"

_WORDS = (r"key|token|secrets?|passwords?|passwd|pwd|passphrases?|auth|authorization|"
          r"credentials?|creds|bearer|cookies?|signature|sig|jwt")
# Words that make the next (or run-together) word a credential: api_tokens, db_pass, hftoken.
_QUALS = (r"api|hf|access|auth|bearer|refresh|session|id|oauth|github|gh|client|private|"
          r"secret|master|admin|app|bot|service|user|personal|db|smtp|redis|mysql|pg|"
          r"postgres|ftp|proxy|mail|ldap|root|basic|http")
_SECRET_SEG = re.compile(rf"(?:{_QUALS})?(?:{_WORDS})\d*")
_QUALIFIED_SEG = re.compile(rf"(?:{_QUALS})(?:tokens|keys|pass)\d*")
_QUAL_SEG = re.compile(rf"(?:{_QUALS})")
_PLURAL_SEG = re.compile(r"(?:tokens|keys|pass)\d*")
# Parts after the secret word that still name the secret itself (API_KEY_B64, TOKEN_2).
_SUFFIXES = frozenset({"value", "b64", "base64", "hex", "raw", "str", "string", "plain",
                       "plaintext"})
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_SPLIT = re.compile(r"[-_.\s:/]+")
_FLAG = re.compile(r"--?[A-Za-z]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
# Up to the last @ before the host: a password may hold an @ (//user:p@ss@host).
_URL_CREDS = re.compile(r"//[^/?#\s\"']*@")
_QUERY = re.compile(r"([?&#;])([^=&#;?\s\"']+)=([^&#;\s\"']*)")
_ENV_ASSIGN = re.compile(r"(?<![\w%.-])([A-Za-z_%][A-Za-z0-9_.%-]*)=([^\s&;,\"']+)")
_AUTH_SCHEME = re.compile(r"\b(Bearer|Basic|Token|ApiKey|Api-Key)(\s+)(?!<redacted>)"
                          r"[^\s\"',;]+", re.I)
_HEADER = re.compile(r"\s*([A-Za-z0-9_-]+)\s*:\s*(\S.*)", re.S)
# Quoted "key": "value" pairs in a value that looked like JSON but did not parse.
_QUOTED_PAIR = re.compile(r"([\"'])([^\"']+)\1(\s*[:=]\s*)([\"'])(.*?)\4")


def is_secret_name(name: str) -> bool:
    """True when a flag, variable, JSON key or query parameter name names a secret
    (``--api-key``, ``HF_TOKEN``, ``apiKey``, ``hftoken``, ``api_tokens``, ``pwd``,
    ``api%5Fkey``, ``hf-overrides.auth_token``); False for ``--max-num-batched-tokens``,
    ``--tokenizer``, ``--long-prefill-token-threshold``, ``pass_config``."""
    parts = [p for p in _SPLIT.split(_CAMEL.sub("_", unquote(name).lstrip("-")).lower()) if p]
    while parts and (parts[-1].isdigit() or parts[-1] in _SUFFIXES):
        parts.pop()
    if not parts:
        return False
    last = parts[-1]
    if _SECRET_SEG.fullmatch(last) or _QUALIFIED_SEG.fullmatch(last) or parts == ["pass"]:
        return True
    return bool(_PLURAL_SEG.fullmatch(last) and len(parts) > 1
                and _QUAL_SEG.fullmatch(parts[-2]))


@functools.lru_cache(maxsize=1)
def _vllm_table() -> tuple[dict[str, tuple[str, bool]], tuple[str, ...], bool]:
    """vLLM's option table (option string -> (nargs, secret)), its long options for prefix
    matching, and whether vLLM's parser takes abbreviations; empty when the data is missing
    (every option then falls back to the name pattern)."""
    try:
        doc = json.loads(VLLM_OPTIONS_PATH.read_text())
        opts = {str(k): (str(v[0]), bool(v[1])) for k, v in doc["options"].items()}
        abbrev = bool(doc.get("allow_abbrev", True))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return {}, (), False
    return opts, tuple(o for o in opts if o.startswith("--")), abbrev


def _vllm_spelling(flag: str) -> str:
    """``flag`` as vLLM's FlexibleArgumentParser hands it to argparse: ``_`` read as ``-``
    in a long option's name."""
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def vllm_option(flag: str) -> tuple[str, str, bool] | None:
    """The vLLM option that ``flag`` (a word before any ``=``) names as vLLM's parser reads
    it: ``(option, nargs, secret)`` for an exact name (``_`` read as ``-``, as vLLM's
    FlexibleArgumentParser does) or a unique prefix (argparse's abbreviation); None for an
    option vLLM does not know or an ambiguous prefix. nargs is argparse's: '0', '1', '?',
    '+' or '*'."""
    opts, longs, abbrev = _vllm_table()
    flag = _vllm_spelling(flag)
    hit = opts.get(flag)
    if hit is not None:
        return flag, *hit
    if not abbrev or not flag.startswith("--") or len(flag) < 3:
        return None
    found = [o for o in longs if o.startswith(flag)]
    if len(found) != 1:
        return None
    return found[0], *opts[found[0]]


def _flag_rule(name: str) -> tuple[bool, str | None]:
    """(secret, nargs) of a flag word's name; nargs None: unknown, every word up to the
    next flag is its value. A prefix vLLM would expand is also secret when its own name is
    (fail closed: the word may be attnprof's own flag, which vLLM never sees)."""
    base, dot, path = name.partition(".")
    hit = vllm_option(base)
    if dot:  # --hf-overrides.auth_token X: one value, secret by the key or the option
        return (hit is not None and hit[2]) or is_secret_name(path.rstrip("+")) \
            or is_secret_name(base), "1" if hit is not None else None
    if hit is None:
        return is_secret_name(name), None
    opt, nargs, secret = hit
    return secret or (opt != _vllm_spelling(name) and is_secret_name(name)), nargs


def _redact_text(text: str) -> str:
    text = _URL_CREDS.sub("//" + REDACTED + "@", text)
    text = _QUERY.sub(lambda m: m.group(0) if not is_secret_name(m.group(2))
                      else f"{m.group(1)}{m.group(2)}={REDACTED}", text)
    text = _ENV_ASSIGN.sub(lambda m: m.group(0) if not is_secret_name(m.group(1))
                           else f"{m.group(1)}={REDACTED}", text)
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


def redact_command(text: str) -> str:
    """``text`` read as a command line (shell words), redacted as :func:`redact_argv`
    redacts an argv and joined again; unchanged when nothing in it is secret; text that does
    not split (an open quote) as one value (:func:`redact_value`)."""
    try:
        words = shlex.split(text)
    except ValueError:
        return redact_value(text)
    try:
        clean = redact_argv(words)
    except RecursionError:  # quotes nested past the stack: fail closed
        return REDACTED
    return text if clean == words else shlex.join(clean)


def _redact_word(value: str) -> str:
    """One value word: as a command line when it holds flags among other words (vLLM's words
    handed to one of our flags), else as one value."""
    if not any(c.isspace() for c in value):
        return redact_value(value)
    try:
        words = shlex.split(value)
    except ValueError:
        return redact_value(value)
    if len(words) > 1 and any(_is_flag(w) for w in words):
        return redact_command(value)
    return redact_value(value)


def _is_flag(word: str) -> bool:
    return word == "--" or bool(_FLAG.match(word))


def _read_as_value(word: str) -> bool:
    """argparse reads a '-' word holding a space as a value (``--api-key "-S77 b"``) unless
    its part before '=' or '.' names an option vLLM knows: after a secret flag such a word
    is hidden, never read as the next flag."""
    if " " not in word:
        return False
    name = word.partition("=")[0]
    return not ("." in name and name.startswith("--")) and vllm_option(name) is None


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with every secret replaced by ``<redacted>`` (see the module docstring); the
    flags themselves and every other word stay, so the command still reads as it was run.
    Never raises on any list of strings."""
    out: list[str] = []
    hide = 0  # words still to hide after a secret flag; -1: every word up to the next flag
    glued = False  # the word after a secret --opt.key: vLLM takes it whatever it looks like
    for word in map(str, argv):
        if glued or (hide and (not _is_flag(word) or _read_as_value(word))):
            glued = False
            hide = -1 if hide < 0 else hide - 1
            out.append(REDACTED)
            continue
        if _is_flag(word):
            name, eq, value = word.partition("=")
            secret, nargs = _flag_rule(name)
            # What vLLM's parser takes as the value: '1'/'?' one word (none after =),
            # '+'/'*'/unknown every word up to the next flag (after = too: a stray word
            # after --api-key=k1 is a key by intent); a dotted --opt.key (no =) the next
            # word, even one starting with '-' (its preprocessing, before argparse).
            many = nargs not in ("0", "1", "?")
            hide = (-1 if many else 0 if eq or nargs == "0" else 1) if secret else 0
            glued = secret and not eq and "." in name
            if not eq:
                # argparse reads '--api-key X' (a space, no known option) as a value: of
                # a flag that takes vLLM's words, so its secrets are redacted as theirs.
                out.append(_redact_word(word) if _read_as_value(word) else word)
            else:
                out.append(f"{name}={REDACTED if secret else _redact_word(value)}")
            continue
        name, eq, value = word.partition("=")
        if eq and _ENV_NAME.fullmatch(name) and is_secret_name(name):
            out.append(f"{name}={REDACTED}")
        else:
            out.append(_redact_word(word))
    return out
