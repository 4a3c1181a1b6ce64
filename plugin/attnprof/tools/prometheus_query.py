"""Fleet-wide context lengths from a Prometheus server (opens a socket: a tool, not analysis)."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse

from attnprof.analyze.sparsity.inputs import InputError, from_prometheus_response
from attnprof.analyze.sparsity.savings import LengthDistribution
from attnprof.tools.server import http_get

__all__ = ["query_prometheus"]


def query_prometheus(url: str, model: str | None = None, range_: str | None = None,
                     metric: str = "attnprof_request_context_tokens",
                     timeout: float = 30.0) -> LengthDistribution:
    """Fleet-wide distribution: one query summing the histogram over every replica."""
    selector = "{" + f'model="{model}"' + "}" if model else ""
    series = f"{metric}_bucket{selector}"
    inner = f"increase({series}[{range_}])" if range_ else series
    query = f"sum by (le) ({inner})"
    full = url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        body = http_get(full, timeout=timeout)
    except urllib.error.HTTPError as err:
        try:
            msg = json.loads(err.read()).get("error", "")
        except Exception:
            msg = ""
        raise InputError(f"{url}: HTTP {err.code} {msg}".strip()) from None
    except (urllib.error.URLError, OSError) as err:
        raise InputError(f"cannot reach Prometheus at {url}: "
                         f"{getattr(err, 'reason', err)}") from None
    try:
        obj = json.loads(body)
    except ValueError:
        raise InputError(f"{url} did not return JSON (is it a Prometheus server?)") from None
    return from_prometheus_response(obj, source=f"prometheus {url}")
