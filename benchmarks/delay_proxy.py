"""A loopback HTTP proxy in front of fake-gcs-server that delays every request and logs it.

Point ``STORAGE_EMULATOR_HOST`` at ``proxy.url`` (the notebook and the hosts
it starts inherit it) and each request to the emulator takes ``delay_s`` more,
as a request to Cloud Storage takes tens of milliseconds. Each request is
logged with its time, method, kind and object name, so a benchmark can count
what a cell or an idle second costs and how often one object is written. It is
the tests' fault proxy (``tests/gcs_emulator.py``) with a delay and a log.

A cell's time on a store ``D`` seconds away is about ``t0 + k·D``: ``k`` is
the number of requests on its critical path, fitted by :func:`fit_k` from
cells timed at several delays.

    with DelayProxy(emulator, delay_s=0.025) as proxy:
        os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
        mark = proxy.mark()
        ...
        requests = proxy.since(mark)
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import re
import statistics
import threading
import time
import urllib.parse
from typing import Any

from tests.gcs_emulator import FaultProxy, GcsEmulator

__all__ = ["DelayProxy", "Request", "RequestLog", "fit_k", "most_writes_per_second"]

#: An object's name in a JSON API path (``/storage/v1/b/BUCKET/o/NAME``, ``/download/...`` too).
_OBJECT_PATH = re.compile(r"/b/[^/]+/o/([^?]+)")
#: An upload's object name, in its multipart body's metadata part.
_UPLOAD_NAME = re.compile(rb'"name"\s*:\s*"([^"]+)"')
#: One request in the emulator's own log (``-log-level info``): logrus's time, then the access log's line in its
#: message (``time=2026-12-07T00:37:41.867Z level=INFO msg="127.0.0.1 - - [...] \"GET /storage/v1/b/B/o HTTP/1.1\"
#: 200 27\n"``).
_LOGGED_REQUEST = re.compile(r'time=(\S+) level=INFO msg="[^"\\]*\\"([A-Z]+) (\S+) HTTP/[0-9.]+\\" ([0-9]{3}) ')


@dataclasses.dataclass(frozen=True)
class Request:
    """One request the proxy forwarded."""

    at: float
    method: str
    #: ``read``, ``write``, ``list``, ``delete``, or ``other`` (a bucket's metadata, say).
    kind: str
    #: The object's name (empty for a listing, whose prefix is in ``prefix``).
    name: str
    prefix: str = ""
    status: int = 0


def describe(method: str, path: str, body: bytes) -> tuple[str, str, str]:
    """The kind of a JSON API request, its object's name and a listing's prefix."""
    url = urllib.parse.urlsplit(path)
    query = urllib.parse.parse_qs(url.query)
    match = _OBJECT_PATH.search(url.path)
    if match:
        name = urllib.parse.unquote(match.group(1))
        return ("delete" if method == "DELETE" else "read" if method == "GET" else "other"), name, ""
    if url.path.startswith("/upload/"):
        found = _UPLOAD_NAME.search(body)
        return "write", query.get("name", [found.group(1).decode() if found else ""])[0], ""
    if method == "GET" and url.path.endswith("/o"):
        return "list", "", query.get("prefix", [""])[0]
    return "other", url.path, ""


class DelayProxy(FaultProxy):
    """Forward each request to ``upstream`` after ``delay_s`` seconds (changed at any time); log it."""

    def __init__(self, upstream: GcsEmulator, delay_s: float = 0.0):
        super().__init__(upstream, faults=[])
        self.delay_s = delay_s
        self.log: list[Request] = []
        self._log_lock = threading.Lock()

    def _take(self, method: str, path: str) -> None:
        time.sleep(self.delay_s)  # every request, on its way in: no fault

    def _forward(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, list, bytes]:
        status, answer_headers, data = super()._forward(method, path, headers, body)
        kind, name, prefix = describe(method, path, body)
        with self._log_lock:
            self.log.append(Request(time.monotonic(), method, kind, name, prefix, status))
        return status, answer_headers, data

    def mark(self) -> int:
        """A place in the log: :meth:`since` returns what came after it."""
        with self._log_lock:
            return len(self.log)

    def since(self, mark: int) -> list[Request]:
        with self._log_lock:
            return self.log[mark:]


class RequestLog:
    """The requests an emulator started with ``log_requests=True`` logged itself, read as :class:`DelayProxy`'s
    log is (``mark``, ``since``), with no process between its clients and it: a proxy in Python, a thread per
    connection, spent more than a core of two at a thousand hosts' start and held their requests up. An upload's
    object name is not in its line (it is in the request's body): a write's ``name`` is empty; ``at`` is the
    wall clock, to the millisecond."""

    def __init__(self, emulator: GcsEmulator):
        if not emulator.log_requests:
            raise ValueError("the emulator logs no requests: start it with log_requests=True")
        self._path = emulator.log_path

    def mark(self) -> int:
        """A place in the log (a request is logged once it is answered): :meth:`since` returns what came after."""
        return self._path.stat().st_size

    def since(self, mark: int) -> list[Request]:
        with open(self._path, "rb") as log:
            log.seek(mark)
            text = log.read().decode(errors="replace")
        requests = []
        for at, method, path, status in _LOGGED_REQUEST.findall(text):
            kind, name, prefix = describe(method, path, b"")
            when = datetime.datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
            requests.append(Request(when, method, kind, name, prefix, int(status)))
        return requests


def fit_k(delays: list[float], seconds: list[float]) -> tuple[float, float]:
    """The least-squares line ``seconds = t0 + k·delay``: ``(t0, k)``."""
    slope, intercept = statistics.linear_regression(delays, seconds)
    return intercept, slope


def most_writes_per_second(requests: list[Request]) -> tuple[int, str]:
    """The most writes (uploads and deletes) one object name took within any one second, and that name."""
    times: dict[str, list[float]] = collections.defaultdict(list)
    for request in requests:
        if request.kind in ("write", "delete"):
            times[request.name].append(request.at)
    most, worst = 0, ""
    for name, ats in times.items():
        ats.sort()
        start = 0
        for end, at in enumerate(ats):
            while at - ats[start] >= 1.0:
                start += 1
            if end - start + 1 > most:
                most, worst = end - start + 1, name
    return most, worst
