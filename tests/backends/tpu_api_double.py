"""``TpuApiDouble``: a recording double of the Cloud TPU API's REST ``nodes.get``, served over HTTP on loopback.

The Cloud TPU API cannot be reached here. The double answers
``GET /v2/projects/P/locations/Z/nodes/NAME`` as the API documents a Node
(``state``, ``acceleratorType``, ``networkEndpoints`` with ``ipAddress`` and
``accessConfig.externalIp``, ``id``) or with Google's error body, and the
three calls OS Login needs (a project's metadata from Compute Engine, a
token's account, and that account's OS Login POSIX users), and records
every request with its ``Authorization`` header, so a test goes through the
real request path: google-auth's ``AuthorizedSession`` adding the
credentials' token, ``requests``, HTTP. Whether Google's service accepts the
request is not tested here (docs/ssh.md says so).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import subprocess
import sys
from collections.abc import Iterator

from ..serving import serve_in_background

_NODE = re.compile(r"^/v2/projects/([^/]+)/locations/([^/]+)/nodes/([^/?]+)$")


class TpuApiDouble:
    """``nodes``: ``(project, zone, name)`` -> the Node to answer; ``denied``: names answered 403."""

    def __init__(self, nodes: dict[tuple[str, str, str], dict] | None = None, denied: set[str] = frozenset()):
        self.nodes = dict(nodes or {})
        self.denied = set(denied)
        #: Projects whose common metadata turns OS Login on; the account the tokens are, and its POSIX user.
        self.os_login_projects: set[str] = set()
        self.email = "alice@example.com"
        self.posix_user = "alice_example_com"
        #: How many of the next OS Login API calls fail (503), as a service having a bad moment.
        self.login_profile_outages = 0
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        double = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                double.requests.append(("GET", self.path, self.headers.get("Authorization")))
                status, body = double.answer(self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, path: str) -> tuple[int, dict]:
        path = path.partition("?")[0]
        if path.startswith("/compute/v1/projects/") and path.rsplit("/", 1)[-1] in self.denied:
            return 403, _error(403, "Required 'compute.projects.get' permission", "PERMISSION_DENIED")
        if path.startswith("/compute/v1/projects/"):  # Compute Engine's projects.get: its common metadata
            os_login = path.rsplit("/", 1)[-1] in self.os_login_projects
            return 200, {"commonInstanceMetadata": {"items": [{"key": "enable-oslogin", "value": "TRUE"}]
                                                     if os_login else []}}
        if path == "/v1/userinfo":  # OpenID's userinfo: the account the bearer token is
            return 200, {"sub": "1234", "email": self.email, "email_verified": True}
        if path.startswith("/v1/users/") and path.endswith("/loginProfile") and self.login_profile_outages:
            self.login_profile_outages -= 1
            return 503, _error(503, "The service is currently unavailable", "UNAVAILABLE")
        if path.startswith("/v1/users/") and path.endswith("/loginProfile"):  # the OS Login API
            if path != f"/v1/users/{self.email}/loginProfile":
                return 404, _error(404, "no such user", "NOT_FOUND")
            return 200, {"name": self.email, "posixAccounts": [
                {"username": "other_account", "primary": False},
                {"username": self.posix_user, "uid": "1234", "primary": True}]}
        match = _NODE.match(path)
        if match is None:
            return 404, _error(404, f"no such method: {path}", "NOT_FOUND")
        project, zone, name = match.groups()
        if name in self.denied:
            return 403, _error(403, f"Permission 'tpu.nodes.get' denied on resource '{path[4:]}'",
                               "PERMISSION_DENIED")
        node = self.nodes.get((project, zone, name))
        if node is None:
            return 404, _error(404, f"Resource '{path[4:]}' was not found", "NOT_FOUND")
        return 200, {"name": path[4:], **node}

    def __enter__(self) -> TpuApiDouble:
        serve_in_background(self.server, "tpu-api-double")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _error(code: int, message: str, status: str) -> dict:
    return {"error": {"code": code, "message": message, "status": status}}


def tpu_node(addresses: list[str], *, accelerator_type: str | None = "v5litepod-16", state: str = "READY",
             external: list[str | None] | None = None, node_id: str = "4213374211",
             accelerator_config: dict[str, str] | None = None) -> dict:
    """A Node as the API describes a TPU VM slice whose workers have ``addresses``, worker 0 first.

    ``accelerator_type`` None leaves ``acceleratorType`` out, as for a node made with ``--type/--topology``,
    which the API describes by its ``acceleratorConfig`` (``{"type": "V5P", "topology": "2x2x4"}``) alone.
    """
    external = external or [None] * len(addresses)
    accelerator = {"acceleratorType": accelerator_type} if accelerator_type else {}
    if accelerator_config:
        accelerator["acceleratorConfig"] = accelerator_config
    return {"id": node_id, "state": state, **accelerator, "health": "HEALTHY",
            "runtimeVersion": "v2-alpha-tpuv5-lite",
            "networkEndpoints": [{"ipAddress": address, "port": 8470,
                                  **({"accessConfig": {"externalIp": outside}} if outside else {})}
                                 for address, outside in zip(addresses, external, strict=True)]}


@contextlib.contextmanager
def answering_as_google(monkeypatch, nodes: dict[tuple[str, str, str], dict], *, client_key: str, known_hosts: str,
                        project: str, denied: set[str] = frozenset()) -> Iterator[TpuApiDouble]:
    """The double answering for ``nodes`` (``denied``: 403), reached as ``-b tpu-vm`` reaches the Cloud TPU API;
    the notebook's credentials a token of the test's, in ``project``; gcloud's key ``client_key`` (the one the test
    hosts accept) and its known-hosts file ``known_hosts``."""
    import google.auth
    import google.oauth2.credentials

    from kinetic_nb.backends.ssh import tpu_vm

    with TpuApiDouble(nodes, denied=denied) as double:
        monkeypatch.setenv(tpu_vm.API_ENDPOINT_ENV, double.url)
        credentials = google.oauth2.credentials.Credentials(token="test-token")
        monkeypatch.setattr(google.auth, "default", lambda scopes=None: (credentials, project))
        monkeypatch.setattr(tpu_vm, "GCLOUD_KEY", client_key)
        monkeypatch.setattr(tpu_vm, "GCLOUD_KNOWN_HOSTS", known_hosts)
        yield double


@contextlib.contextmanager
def chips_held(monkeypatch, tmp_path, *command_tail: str) -> Iterator[subprocess.Popen]:
    """A process holding a TPU worker's chips (a file standing in for them, opened), ``command_tail`` after its
    own command line; it is killed after."""
    from kinetic_nb.backends.ssh import tpu_vm

    chip = tmp_path / "accel0"
    chip.write_bytes(b"")
    monkeypatch.setattr(tpu_vm, "TPU_DEVICES", (str(chip),))  # the chips a worker's processes would hold
    holder = subprocess.Popen([sys.executable, "-c", f"import time\nchip = open({str(chip)!r})\nprint('held', flush=True)\n"
                               "time.sleep(120)", *command_tail], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"  # its chip open, as the busy-chips check will find it
        yield holder
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
