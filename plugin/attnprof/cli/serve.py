"""``attnprof serve``: vLLM's OpenAI server with attnprof inside."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from attnprof.cli._common import CliError, StopSignals

__all__ = ["add_parser", "resolve_or_fail"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="start vLLM's OpenAI server with attnprof enabled",
        description="Start vLLM's OpenAI-compatible server with attnprof enabled. Arguments "
                    "after `--` go to vLLM unchanged.")
    p.add_argument("--model", default="smollm2",
                   help="local Hugging Face checkpoint directory or 'smollm2' (default)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--eager", action="store_true",
                   help="pass --enforce-eager (starts ~30 s faster on CPU)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- extra vLLM arguments")
    p.set_defaults(func=_run)


def resolve_or_fail(spec: str) -> tuple[str, str | None]:
    from attnprof.tools import models

    try:
        path = models.resolve_model(spec)
    except models.ModelCacheError as err:
        raise CliError(str(err)) from None
    return str(path), ("smollm2" if spec == models.DEFAULT_MODEL else None)


def check_config() -> None:
    from attnprof.config import ConfigError, api_tokens
    from attnprof.host.vllm.runtime import config_from_env

    try:
        config_from_env(check_otlp=True)
        api_tokens()  # an ATTNPROF_API_KEY no bearer header can carry
    except ConfigError as err:
        raise CliError(f"invalid configuration: {err}") from None


def _key_note(vllm_args: list[str]) -> str:
    """What the snapshot line should add about keys: the server reads the same environment
    and ``vllm_args`` (vLLM's own ``--api-key``, under any name its parser takes, opens the
    routes when ``ATTNPROF_API_KEY`` is unset)."""
    import os

    from attnprof.contracts.redact import vllm_option

    if os.environ.get("ATTNPROF_API_KEY"):
        return " (bearer: $ATTNPROF_API_KEY)"
    if os.environ.get("VLLM_API_KEY") or any(
            (hit := vllm_option(a.partition("=")[0])) is not None and hit[0] == "--api-key"
            for a in vllm_args if a.startswith("--")):
        return ("\n            (bearer: vLLM's API key: every inference key opens it; set "
                "ATTNPROF_API_KEY to a separate monitoring key)")
    return ("\n            (no ATTNPROF_API_KEY: only what /metrics shows; set one to a "
            "monitoring key for the rest)")


def _run(args: argparse.Namespace) -> int:
    from attnprof.tools.server import ServerError, StopRequested, VllmServer, port_error

    if not 0 < args.port < 65536:
        raise CliError(f"--port {args.port} is not a TCP port")
    check_config()
    model, served = resolve_or_fail(args.model)
    # Before vLLM's minute of start-up: a taken port would otherwise end it with a traceback,
    # or worse, the other server's answers would look like a ready vLLM.
    problem = port_error(args.host, args.port)
    if problem:
        raise CliError(problem)
    extra = [a for a in args.vllm_args if a != "--"] if args.vllm_args else []
    srv = VllmServer(model, port=args.port, host=args.host, served_name=served,
                     extra_args=extra, eager=args.eager)

    # SIGTERM and SIGHUP (terminal closed) stop vLLM like Ctrl-C. Installed before start() so
    # no window leaves the default action; if the wrapper dies anyway (SIGKILL), the
    # server's watchdog and parent-death signal stop vLLM. A second signal while stopping
    # only raises the flag again, so it cannot cut stop() short.
    hup = [signal.SIGHUP] if hasattr(signal, "SIGHUP") else []
    with StopSignals(*hup) as stop:
        print(f"attnprof: starting vLLM for {model}", file=sys.stderr)
        try:
            srv.start()
            secs = srv.wait_ready(timeout=900, stop=lambda: stop.requested)
            print(f"attnprof: ready in {secs:.0f} s\n"
                  f"  API:      {srv.base_url}/v1\n"
                  f"  metrics:  {srv.base_url}/metrics\n"
                  f"  snapshot: {srv.base_url}/attnprof/snapshot{_key_note(extra)}\n"
                  f"Ctrl-C stops the server and all its processes.", file=sys.stderr)
            assert srv.proc is not None
            while (rc := srv.proc.poll()) is None:
                if stop.nap(0.5):
                    raise StopRequested
            return rc
        except StopRequested:
            print("attnprof: stopping vLLM", file=sys.stderr)
            return 0
        except ServerError as err:
            raise CliError(str(err)) from None
        finally:
            srv.stop()
