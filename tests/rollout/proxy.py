"""A loopback HTTP proxy in front of a real SGLang server that fails the first requests to chosen paths with a
given status: how the tests make a real server's answers look transiently (or permanently) broken. ``on_request``
(path, body bytes), called before a request is forwarded, lets a test record the requests or hold one back."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FailingProxy:
    def __init__(self, upstream: str, fail_paths: tuple[str, ...] = ("/generate",), failures: int = 2,
                 status: int = 503, port: int = 0, on_request=None):
        self.upstream = upstream.rstrip("/")
        self.on_request = on_request
        self.fail_paths, self.failures, self.status = fail_paths, failures, status
        self.failed = 0  # requests answered with ``status``
        self.forwarded = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _handle(self, method):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else None
                with proxy._lock:
                    fail = self.path in proxy.fail_paths and (proxy.failures < 0 or proxy.failed < proxy.failures)
                    if fail:
                        proxy.failed += 1
                    else:
                        proxy.forwarded += 1
                if fail:
                    payload = b'{"error": "injected by the test proxy"}'
                    self.send_response(proxy.status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if proxy.on_request is not None:
                    proxy.on_request(self.path, body)
                request = urllib.request.Request(proxy.upstream + self.path, data=body, method=method,
                                                 headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=120) as answer:
                        status, payload = answer.status, answer.read()
                except urllib.error.HTTPError as e:
                    status, payload = e.code, e.read()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
