"""JSON over HTTP to one SGLang server (stdlib only), with bounded retries of transient failures.

Transient, retried with exponential backoff: HTTP 5xx and 429, refused or reset connections (a server busy
restarting a worker, a proxy hiccup). Not retried: 4xx (the request is wrong: retrying cannot help) and timeouts
(a hung server: retrying would multiply the wait; the caller decides). Every call is bounded by ``timeout`` per
attempt and ``max_retries`` attempts, so the worst case is known.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from .errors import RequestFailed, ServerDied, ServerUnresponsive

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0

    def delay(self, attempt: int) -> float:
        """Seconds before retry ``attempt`` (1-based): doubling, capped, with +-20% jitter against lockstep."""
        base = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        return base * random.uniform(0.8, 1.2)


class Transient(Exception):
    """One attempt failed in a way worth retrying."""


def _is_refused(error: BaseException) -> bool:
    reason = getattr(error, "reason", error)
    return isinstance(reason, (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError))


def _is_timeout(error: BaseException) -> bool:
    reason = getattr(error, "reason", error)
    return isinstance(reason, (TimeoutError, socket.timeout))


class HttpClient:
    """``get(path)`` / ``post(path, body)`` returning decoded JSON (or None for an empty body)."""

    def __init__(self, url: str, retry: RetryPolicy = RetryPolicy(), timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.retry = retry
        self.timeout = timeout

    def get(self, path: str, timeout: float | None = None, retry: RetryPolicy | None = None,
            cancelled: threading.Event | None = None) -> Any:
        return self._call("GET", path, None, timeout, retry, cancelled)

    def post(self, path: str, body: dict | None = None, timeout: float | None = None,
             retry: RetryPolicy | None = None, cancelled: threading.Event | None = None) -> Any:
        """``cancelled``: set by the caller when nobody waits for the answer any more: no further retries."""
        return self._call("POST", path, body if body is not None else {}, timeout, retry, cancelled)

    def _call(self, method: str, path: str, body: dict | None, timeout: float | None, retry: RetryPolicy | None,
              cancelled: threading.Event | None = None):
        retry = retry or self.retry
        timeout = timeout or self.timeout
        cancelled = cancelled or threading.Event()
        where = f"{method} {self.url}{path}"
        last: BaseException | None = None
        for attempt in range(retry.max_retries + 1):
            if attempt:
                wait = retry.delay(attempt)
                if not cancelled.is_set():
                    log.warning("%s: %s; retry %d/%d in %.1f s", where, last, attempt, retry.max_retries, wait)
                if cancelled.wait(wait):
                    raise RequestFailed(f"{where}: given up ({last}): the caller no longer waits for it")
            try:
                return self._once(method, path, body, timeout)
            except Transient as e:
                last = e.__cause__ or e
        if last is not None and _is_refused(last):
            raise ServerDied(f"{where}: the server refuses connections ({last}) after {retry.max_retries} retries: "
                             "is it running?", url=self.url) from last
        raise RequestFailed(f"{where} failed after {retry.max_retries} retries: {last}", url=self.url) from last

    def _once(self, method: str, path: str, body: dict | None, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        where = f"{method} {self.url}{path}"
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            if e.code in RETRY_STATUS:
                raise Transient() from RequestFailed(f"HTTP {e.code}: {detail}")
            raise RequestFailed(f"{where}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            if _is_timeout(e):
                raise ServerUnresponsive(f"{where}: no answer within {timeout:.0f} s (server hung or overloaded)",
                                         url=self.url) from e
            if _is_refused(e) or isinstance(e, (urllib.error.URLError, ConnectionError)):
                raise Transient() from e
            raise
        except http_client_errors() as e:  # the connection dropped mid-answer (a server killed while answering)
            raise Transient() from ConnectionResetError(f"connection dropped: {e!r}")
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode(errors="replace")


def http_client_errors() -> tuple[type[BaseException], ...]:
    import http.client

    return (http.client.RemoteDisconnected, http.client.IncompleteRead, http.client.BadStatusLine)
