"""A loopback HTTP server answering every GET with JSON behind a bearer token, like a vLLM
server's /attnprof/* routes with --api-key: what the CLIs' key handling is tested against."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class BearerJsonServer:
    """``answer(n)`` (n: how many authorised GETs came before) for the right bearer token,
    401 otherwise. ``seen``: every Authorization header received (None: none sent);
    ``served``: every document answered."""

    def __init__(self, key: str, answer: Callable[[int], dict[str, Any]],
                 refusal: tuple[int, dict[str, Any]] = (401, {"error": "Unauthorized"})) -> None:
        seen: list[str | None] = []
        served: list[dict[str, Any]] = []

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                auth = self.headers.get("Authorization")
                seen.append(auth)
                ok = auth == f"Bearer {key}"
                doc = answer(len(served)) if ok else refusal[1]
                if ok:
                    served.append(doc)
                body = json.dumps(doc).encode()
                self.send_response(200 if ok else refusal[0])
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        self.seen, self.served = seen, served
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
