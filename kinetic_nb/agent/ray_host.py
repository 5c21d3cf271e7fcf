"""One host of a job on a Ray cluster: the body of the actor that starts that host's agent.

The ``ray`` backend places one actor per host (``ray.remote(RayHost)``, in a
placement group); the actor does only what the platform must: it reports
where it landed, picks the coordinator's port on host 0's node, and starts
``python -m kinetic_nb.agent --job URI`` as its child with the host's
environment, the job's key and the ``-e`` values among them (handed over in
a method call, never in a ``runtime_env``). The agent, the same as on every
backend, runs and supervises the runner and beats its heartbeat (so a host
whose framework holds its GIL is never lost). The agent is tied to the actor's
life (it gets SIGKILL when the actor's process dies), and the runner to the
agent's, so a killed actor or a lost node takes its host with it; the
backend then records that host's end as Ray reports it.

When its agent has ended, the actor ends itself; the last one to end
removes the job's placement group, so a job leaves nothing in the cluster
even when no notebook is watching.

Host-safe: ``ray`` is imported only inside the methods, which run only on a
Ray worker; importing this module loads the standard library and kinetic_nb's
host side alone.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing

from kinetic_nb.runner import protocol
from kinetic_nb.runner.channel import CHANNEL_ENV
from kinetic_nb.runner.host_variables import host_environment, resolve_host_index
from kinetic_nb.runner.job_keys import KEY_ENV
from kinetic_nb.runner.logs import last_lines
from kinetic_nb.runner.protocol import JobPlan
from kinetic_nb.storage import open_storage

#: The variable that tells a host which Ray node it runs on (the tests check spreading with it).
NODE_ID_ENV = "KINETIC_RAY_NODE_ID"
#: Lines of the agent's own output kept for a record of an agent that died.
AGENT_LOG_LINES = 8
#: The most of the agent's output read for those lines.
AGENT_TAIL_BYTES = 16384


#: How long an actor outlives its agent before it ends itself: the client's one call per host (``agent_exit``)
#: is answered as the agent ends, and an actor that ended first would turn that answer into "actor died".
ANSWER_GRACE_S = 2.0
#: Host 0's actor serves a notebook's pipe to the hub beside its other calls: a receive waits up to a few
#: seconds for the hub, a send must not wait behind it.
ACTOR_CONCURRENCY = 8


class _Pipe:
    """One TCP connection to the hub, as calls can use it: what arrives is kept until asked for."""

    def __init__(self, address: tuple[str, int]):
        self._sock = socket.create_connection(address, timeout=10)
        self._sock.settimeout(None)
        self._received = bytearray()
        self._closed = False
        self._arrived = threading.Condition()
        threading.Thread(target=self._read, name="kinetic-pipe", daemon=True).start()

    def _read(self) -> None:
        try:
            while data := self._sock.recv(1 << 16):
                with self._arrived:
                    self._received += data
                    self._arrived.notify_all()
        except OSError:
            pass
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()

    def send(self, data: bytes) -> bool:
        try:
            self._sock.sendall(data)
        except OSError:
            return False
        return True

    def receive(self, wait_s: float) -> bytes | None:
        with self._arrived:
            self._arrived.wait_for(lambda: self._received or self._closed, wait_s)
            data = bytes(self._received)
            self._received.clear()
            return None if self._closed and not data else data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class StorageNotSharedError(RuntimeError):
    """The job's ``file://`` storage is not visible on this node."""


class RayHost:
    """What one host's actor does; see the module's docstring."""

    def __init__(self) -> None:
        self.agent: subprocess.Popen | None = None
        #: The agent's stdout and stderr: a file with no name (nothing of it outlives this actor, however it
        #: ends), whose last lines :meth:`agent_exit` reports.
        self.agent_output: typing.IO[bytes] | None = None
        #: Set once :meth:`start` has started the agent, or failed to: :meth:`agent_exit` waits for it.
        self._start_over = threading.Event()
        #: Host 0's actor: connections to the session's hub that a notebook off the cluster's network makes
        #: through it (``pipe_*``), by number.
        self._pipes: dict[int, _Pipe] = {}
        self._pipe_numbers = itertools.count(1)

    # -- a notebook's way to the session's hub, where it cannot dial host 0's node -------------------------

    def pipe_open(self, address: str) -> int:
        """Connect to the session's hub at ``address`` (on this node) for a notebook; the pipe's number."""
        host, port = address.rsplit(":", 1)
        number = next(self._pipe_numbers)
        self._pipes[number] = _Pipe((host, int(port)))
        return number

    def pipe_send(self, number: int, data: bytes) -> bool:
        """Pass ``data`` to the hub; False once the pipe is closed (the notebook's end then closes too)."""
        pipe = self._pipes.get(number)
        return pipe is not None and pipe.send(data)

    def pipe_receive(self, number: int, wait_s: float) -> bytes | None:
        """What the hub sent since the last call, waiting up to ``wait_s`` for some (``b""``: nothing yet);
        None once the pipe is closed and drained."""
        pipe = self._pipes.get(number)
        return None if pipe is None else pipe.receive(wait_s)

    def pipe_close(self, number: int) -> None:
        pipe = self._pipes.pop(number, None)
        if pipe is not None:
            pipe.close()

    def where(self) -> dict[str, str]:
        """This actor's node: its id and its address."""
        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "address": ray.util.get_node_ip_address()}

    def reserve_coordinator(self) -> str:
        """``address:port`` on this node (host 0's) for the framework's coordinator.

        The port is free when chosen; the hosts start moments later, as the
        local backend's do.
        """
        address = self.where()["address"]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
            return f"{address}:{probe.getsockname()[1]}"

    def start(self, job_uri: str, plan_json: bytes, bundle_index: int, coordinator: str,
              secrets: dict[str, str], channel: str = "") -> dict[str, object]:
        """Start this host's agent; returns the host's ``index`` and its ``node_id``.

        The index is the bundle's, unless the node says otherwise (a TPU VM's
        ``TPU_WORKER_ID``, which the runner reads first on every backend).

        Raises
        ------
        StorageNotSharedError
            The job's ``file://`` storage is not on this node's filesystem.
        """
        try:
            return self._start(job_uri, plan_json, bundle_index, coordinator, secrets, channel)
        finally:
            self._start_over.set()

    def _start(self, job_uri: str, plan_json: bytes, bundle_index: int, coordinator: str,
               secrets: dict[str, str], channel: str) -> dict[str, object]:
        path = open_storage(job_uri).local_path(protocol.PLAN)
        where = self.where()
        if path is not None and not os.path.exists(path):
            raise StorageNotSharedError(
                f"the job's storage {job_uri} is not on node {where['node_id'][:8]} ({where['address']}): "
                "this cluster's nodes do not share that path; use --storage gs://BUCKET/PREFIX")
        plan = JobPlan.from_json(plan_json)
        index = resolve_host_index(os.environ)
        index = bundle_index if index is None else index
        host, port = coordinator.rsplit(":", 1)
        key_hex = secrets.get(KEY_ENV, "")  # to the agent through a pipe: never in an environment
        # The host's environment, as its first process's: the agent gives each of its processes its own rank.
        env = host_environment(plan, plan.ranks_of(index)[0], job_uri, "",
                               {**os.environ, **{name: value for name, value in secrets.items() if name != KEY_ENV}})
        env.update({"KINETIC_COORDINATOR_ADDRESS": coordinator, "JAX_COORDINATOR_ADDRESS": coordinator,
                    "MASTER_ADDR": host, "MASTER_PORT": port, NODE_ID_ENV: where["node_id"]})
        if channel:  # a session's hub, on host 0's node: its agent listens there, every other host joins it
            env[CHANNEL_ENV] = channel
        self.agent_output = tempfile.TemporaryFile(prefix=f"kinetic-{plan.job_id}-{index}-")  # noqa: SIM115
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "kinetic_nb.agent", "--job", job_uri, "--parent", str(os.getpid()), "--key-stdin"],
            env=env, stdin=subprocess.PIPE, stdout=self.agent_output, stderr=self.agent_output, close_fds=True,
            start_new_session=True,  # its own group: a signal to the worker's group spares it
        )
        self.agent.stdin.write(key_hex.encode() + b"\n")
        self.agent.stdin.close()
        threading.Thread(target=self._end_when_the_agent_ends, args=(job_uri, plan.world_size),
                         name="kinetic-agent-watch", daemon=True).start()
        return {"index": index, "node_id": where["node_id"]}

    def agent_exit(self) -> tuple[int | None, list[str]]:
        """Wait until this host's agent has ended; its exit code and the last lines of its own output ((None, [])
        where it never started: the start's own error says why). The client calls it once per host, as the host
        starts, and learns each host's end by one ``ray.wait`` over all of them: nothing per host per look."""
        self._start_over.wait()
        if self.agent is None:
            return None, []
        return self.agent.wait(), self._agent_tail()

    def stop(self) -> None:
        """SIGTERM to the agent: it stops its host and records it as stopped."""
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)

    def _agent_tail(self) -> list[str]:
        """The last lines the agent wrote, read at their offset: the agent's own writes go on where they were."""
        try:
            descriptor = self.agent_output.fileno()
            size = os.fstat(descriptor).st_size
            data = os.pread(descriptor, AGENT_TAIL_BYTES, max(0, size - AGENT_TAIL_BYTES))
        except (OSError, ValueError):  # closed: this actor is being ended
            return []
        return last_lines(data.decode(errors="replace"), AGENT_LOG_LINES)

    def _end_when_the_agent_ends(self, job_uri: str, hosts: int) -> None:
        """Once the agent has ended: remove the job's placement group if every host has ended (the last
        actor takes the others with it), else end this actor alone."""
        import ray

        self.agent.wait()
        time.sleep(ANSWER_GRACE_S)
        storage = open_storage(job_uri)
        try:
            every_host_ended = all(storage.exists(protocol.host_exit(index)) for index in range(hosts))
        except Exception:  # noqa: BLE001 - the client's cleanup removes the group then
            every_host_ended = False
        context = ray.get_runtime_context()
        if every_host_ended and context.get_placement_group_id():
            from ray.util.placement_group import PlacementGroup

            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(
                context.get_placement_group_id())))
        else:
            ray.kill(context.current_actor, no_restart=True)
