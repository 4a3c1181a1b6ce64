"""The one HTTP client attnprof has: every URL-reading command (``snapshot --url``,
``suggest-window --url`` and ``--prometheus``), the demo's own server checks and the traffic
it sends (:func:`get`, :func:`post_json`).

Whatever comes back (a refused connection, a timeout, an answer that is not HTTP, a body cut
short, an error status, a body that is not JSON) ends as :class:`HttpError` with one line;
the CLI prints it and exits 2. The API key goes in an ``Authorization: Bearer`` header that
is never forwarded on a redirect and never appears in a message.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

from attnprof.contracts.redact import redact_value

__all__ = [
    "API_KEY_ENV",
    "MAX_ANSWER_BYTES",
    "HttpError",
    "check_url",
    "get",
    "get_json",
    "get_text",
    "parse_json",
    "post_json",
    "resolve_api_key",
    "stream_json",
]

API_KEY_ENV = ("ATTNPROF_API_KEY", "VLLM_API_KEY")
"""Where the key comes from when ``--api-key`` is not given, first set wins."""
MAX_ANSWER_BYTES = 256 << 20
"""A larger answer is refused (a snapshot with head statistics is a few MiB)."""
_AUTH_HINT = "pass --api-key or set ATTNPROF_API_KEY"


class HttpError(ValueError):
    """A URL that cannot be read, or an answer that is not what was asked for (one line).
    ``status`` is the HTTP status when the server answered with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def resolve_api_key(flag: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """``--api-key`` if given, else ``$ATTNPROF_API_KEY``, else ``$VLLM_API_KEY`` (the same key
    vLLM's ``--api-key`` reads); None when none is set. :class:`HttpError` when the key holds
    characters an HTTP header cannot carry (the message does not repeat the key)."""
    env = os.environ if env is None else env
    for where, value in (("--api-key", flag), *((n, env.get(n)) for n in API_KEY_ENV)):
        if value:
            if not all(0x20 < ord(c) < 0x7F for c in value):
                raise HttpError(f"the API key from {where} contains spaces, control or "
                                "non-ASCII characters; an HTTP header cannot carry it")
            return value
    return None


def check_url(url: str, flag: str = "--url") -> str:
    """``url`` if it is an http(s) URL with a host (and a valid port), else :class:`HttpError`."""
    try:
        parts = urllib.parse.urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        parts, port_ok = None, False
    shown = redact_value(url[:200])  # never echo user:password or a ?token=
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or not port_ok or any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url)):
        raise HttpError(f"{flag} {shown!r} is not an http:// or https:// URL with a host "
                        "(e.g. http://127.0.0.1:8000)")
    if "@" in parts.netloc:
        # urllib would take "user:pass@host" for a host name and fail to resolve it, and the
        # error would print the password into logs; a key travels as a bearer token instead.
        raise HttpError(f"{flag} {shown!r}: credentials in the URL are not supported; pass "
                        "the key with --api-key or ATTNPROF_API_KEY")
    return url


def _status_message(url: str, code: int, sent_key: bool, auth: bool, detail: str) -> str:
    if auth and code == 403 and detail:
        # attnprof's 403: the route is off on the server (no key there to check), so a key
        # passed here cannot help; the server's own sentence says what to set, and where.
        return f"{url}: HTTP 403: {detail}"
    if auth and code in (401, 403):
        if sent_key:
            return (f"{url}: HTTP {code}: the server refused the API key; {_AUTH_HINT} with "
                    "the server's key")
        return f"{url}: HTTP {code}: this server requires an API key: {_AUTH_HINT}"
    return f"{url}: HTTP {code}{(' ' + detail) if detail else ''}"


def _error_detail(err: urllib.error.HTTPError) -> str:
    """Prometheus puts the reason of a 4xx/5xx in ``{"error": ...}``; one line of it."""
    try:
        body = err.read(65536)
        msg = json.loads(body).get("error", "")
    except Exception:  # any answer at all: the status alone is the message
        return ""
    finally:
        err.close()
    return " ".join(str(msg).split())[:300] if msg else ""


def get(url: str, *, timeout: float = 30.0, api_key: str | None = None, auth: bool = False,
        max_bytes: int = MAX_ANSWER_BYTES) -> bytes:
    """The body of ``GET url`` (status 2xx, complete); :class:`HttpError` otherwise.

    ``api_key``: sent as ``Authorization: Bearer`` (not on redirects). ``auth``: the URL is an
    attnprof route, so 401/403 name the API key flag and variables.
    """
    return _fetch(urllib.request.Request(url, headers={"Accept": "application/json"}), url,
                  timeout=timeout, api_key=api_key, auth=auth, max_bytes=max_bytes)


def get_text(url: str, timeout: float = 10.0, *, api_key: str | None = None) -> str:
    """The body of ``GET url`` as text (``/metrics``, ``/health``); :class:`HttpError`
    otherwise, as :func:`get`."""
    return get(url, timeout=timeout, api_key=api_key).decode()


def post_json(url: str, body: Mapping[str, Any], *, timeout: float = 600.0,
              api_key: str | None = None, max_bytes: int = MAX_ANSWER_BYTES) -> Any:
    """``POST url`` with ``body`` as JSON; the answer parsed as JSON. :class:`HttpError`
    (one line, ``status`` set for an error status) for anything else."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Accept": "application/json"})
    return parse_json(_fetch(req, url, timeout=timeout, api_key=api_key, auth=False,
                             max_bytes=max_bytes), url)


def _authorize(req: urllib.request.Request, url: str, api_key: str | None) -> None:
    """Check ``url`` and put the key on ``req`` as a bearer token that no redirect carries."""
    check_url(url)
    if api_key:
        resolve_api_key(api_key, {})  # refuses a key that would break the header
        req.add_unredirected_header("Authorization", f"Bearer {api_key}")


def _fetch(req: urllib.request.Request, url: str, *, timeout: float, api_key: str | None,
           auth: bool, max_bytes: int) -> bytes:
    _authorize(req, url, api_key)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            chunks: list[bytes] = []
            total = 0
            while True:
                b = r.read(1 << 16)
                if not b:
                    break
                total += len(b)
                if total > max_bytes:
                    raise HttpError(f"{url}: the answer is larger than "
                                    f"{max_bytes >> 20} MiB; refused")
                chunks.append(b)
            declared = r.headers.get("Content-Length")
    except HttpError:
        raise
    except Exception as err:  # every failure of the exchange ends as one line
        raise _one_line(err, url, timeout, bool(api_key), auth) from None
    body = b"".join(chunks)
    if declared is not None and declared.strip().isdigit() and len(body) < int(declared):
        raise HttpError(f"{url}: the answer was cut short ({len(body)} of {int(declared)} "
                        "bytes)")
    return body


def _one_line(err: BaseException, url: str, timeout: float, sent_key: bool,
              auth: bool) -> BaseException:
    """The :class:`HttpError` an exchange's failure reads as (anything unexpected is
    returned as is, to be raised: a bug, not a network answer)."""
    if isinstance(err, urllib.error.HTTPError):
        return HttpError(_status_message(url, err.code, sent_key, auth, _error_detail(err)),
                         status=err.code)
    if isinstance(err, urllib.error.URLError):
        return HttpError(f"cannot reach {url}: {_reason(err.reason)}")
    if isinstance(err, http.client.IncompleteRead):
        return HttpError(f"{url}: the answer was cut short (truncated)")
    if isinstance(err, http.client.RemoteDisconnected):
        return HttpError(f"{url}: the server closed the connection without answering")
    if isinstance(err, http.client.HTTPException):
        return HttpError(f"{url}: the answer is not valid HTTP ({type(err).__name__})")
    if isinstance(err, TimeoutError):
        return HttpError(f"{url}: no answer within {timeout:g} s")
    if isinstance(err, OSError):
        return HttpError(f"cannot read {url}: {_reason(err)}")
    if isinstance(err, ValueError):  # a bad URL in a redirect, a header value urllib refuses
        return HttpError(f"cannot read {url}: {type(err).__name__}")
    return err


def stream_json(url: str, body: Mapping[str, Any], *, timeout: float = 600.0,
                api_key: str | None = None,
                max_bytes: int = MAX_ANSWER_BYTES) -> Iterator[tuple[float, Any]]:
    """``POST url`` with ``body`` (``"stream": true`` set) and yield ``(monotonic arrival
    time, event)`` for each server-sent ``data:`` event until ``[DONE]``: what the what-if
    runner times first tokens and inter-token gaps with. :class:`HttpError` as
    :func:`post_json` for a failed exchange, an error status or an event that is not JSON."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json",
                                                         "Accept": "text/event-stream"})
    _authorize(req, url, api_key)
    total = 0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            while True:
                line = r.readline(max_bytes)
                if not line:
                    return
                total += len(line)
                if total > max_bytes:
                    raise HttpError(f"{url}: the stream is larger than "
                                    f"{max_bytes >> 20} MiB; refused")
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield time.monotonic(), parse_json(data, url, " events")
    except HttpError:
        raise
    except Exception as err:
        raise _one_line(err, url, timeout, bool(api_key), False) from None


def _reason(reason: Any) -> str:
    if isinstance(reason, OSError) and reason.strerror:
        return str(reason.strerror)
    text = " ".join(str(reason).split()) or type(reason).__name__
    return text[:300]


def parse_json(body: bytes, url: str, hint: str = "") -> Any:
    """``body`` as JSON, or :class:`HttpError` naming ``url`` (one line)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise HttpError(f"{url} did not return JSON{hint}") from None


def get_json(url: str, *, timeout: float = 30.0, api_key: str | None = None,
             auth: bool = False, hint: str = "") -> Any:
    return parse_json(get(url, timeout=timeout, api_key=api_key, auth=auth), url, hint)
