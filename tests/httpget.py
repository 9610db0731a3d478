"""Blocking HTTP requests for tests against a live frontend or worker (real servers, real jobs).

The one HTTP client of the tests' own (blocking) code: ``request`` returns an error status with
its body instead of raising; ``get_json`` raises on one (``urllib.error.HTTPError``, an
``OSError``, as a refused connection is). A timeout is the caller's bound on a loaded box: a
first page waits for the frontend's store connection and every rank.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any


def request(url: str, *, method: str = "GET", headers: Mapping[str, str] | None = None,
            timeout: float = 30) -> tuple[int, str]:
    """(status, body) of one request; an HTTP error status is returned, not raised."""
    req = urllib.request.Request(url, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def post(url: str, timeout: float = 30) -> tuple[int, str]:
    """(status, body) of a POST with no body (a worker's handler); an error status is returned."""
    return request(url, method="POST", timeout=timeout)


def timed_get(url: str, accept: str = "*/*", timeout: float = 20) -> tuple[int, str, float]:
    """(status, body, seconds taken) of a GET; an HTTP error status is returned, not raised."""
    t0 = time.monotonic()
    status, body = request(url, headers={"Accept": accept}, timeout=timeout)
    return status, body, time.monotonic() - t0


def get_json(url: str, method: str = "GET", headers: Mapping[str, str] | None = None,
             timeout: float = 30) -> Any:
    """The JSON body of a request asking for JSON; an HTTP error status raises."""
    req = urllib.request.Request(url, method=method,
                                 headers={"Accept": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())
