"""What a notebook keeps open to its ssh hosts between jobs: the connections, what the hosts said, a warm agent each.

A job's start on ssh hosts costs a handshake per host, a probe, the bootstrap
checking the kept environment, and the agent's imports: about a second on
loopback, more on a real network. A notebook works in small steps, so it
keeps, per set of hosts (:func:`pool_for`), what the first job opened:

- the control masters (:class:`~kinetic_nb.backends.ssh.connections.Connections`)
  and what each host said of itself (its Python, checked once: where the
  default ``python3`` is another minor version than the notebook's, the
  notebook's, installed there once by :mod:`python_install`);
- once a job has installed (or found) the environment on every host, a warm
  agent on each (``python -m kinetic_nb.agent.warm --stdio`` in that
  environment), over its host's master: the next job with the same
  environment (the same wheel and requirements: the install record's hash) is
  one line to each, answered with the pid of the job's agent it forked, past
  its imports. A job with another environment goes the bootstrap's way, and
  the warm agents are replaced for it.

Every job still runs by storage alone: the agents the warm agents fork are
detached, so a dropped connection ends no cell. A warm agent ends when its
channel does, so nothing outlives the notebook: its masters close when a
session on those hosts stops (:func:`release_pool`), after :data:`IDLE_CLOSE_S`
without a job, at the notebook's exit, or
:data:`~kinetic_nb.backends.ssh.connections.CONTROL_PERSIST_S` after a killed
notebook's last channel closed.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from kinetic_nb.backends.ssh.connections import CONTROL_PERSIST_S, Connections
from kinetic_nb.backends.ssh.probe import DEFAULT_PYTHON, HostFacts, probe_hosts
from kinetic_nb.backends.ssh.python_install import install_pythons, name_interpreters
from kinetic_nb.errors import SshHostError
from kinetic_nb.runner import protocol

__all__ = ["ENVIRONMENTS_DIR", "HostPool", "close_pools", "pool_for", "release_pool"]

#: Where a host keeps the environments it installed, under its user's cache directory (``$XDG_CACHE_HOME``, else
#: ``~/.cache``): a folder per interpreter (``HostFacts.environments_key``: another ``--ssh-python`` never finds
#: the first one's), and in it one per content (the bootstrap's ``--environments``, :meth:`HostPool.environments`).
ENVIRONMENTS_DIR = "kinetic_nb/environments"
#: A pool with no job for this long closes its connections (its warm agents end with them).
IDLE_CLOSE_S = CONTROL_PERSIST_S
#: How long a warm agent that said it is ready may take to answer a request (a fork, or a port probe).
ANSWER_TIMEOUT_S = 15.0
#: Ports found this recently are used; older ones are asked for again (another program may have taken them).
PORTS_FRESH_S = 30.0


class RemoteWarmAgent:
    """A warm agent on one host, in one kept environment (``digest``, in the folder ``environments`` of the
    host's cache directory), over the host's control master."""

    def __init__(self, connections: Connections, index: int, digest: str, environments: str):
        self.host = connections.hosts[index]
        self.digest = digest
        python = f'"${{XDG_CACHE_HOME:-$HOME/.cache}}/{environments}/{digest[:16]}/venv/bin/python"'
        self.process = subprocess.Popen(
            connections.command(index, f"exec {python} -m kinetic_nb.agent.warm --stdio"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)  # an interrupt of the notebook must not reach it
        self._pending = b""
        self.ready = False
        #: Its pid on the host, once it said it is ready.
        self.remote_pid: int | None = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float) -> bool:
        """Whether it has said it is ready (its imports done), waiting up to ``timeout`` for it."""
        if not self.ready and self.alive():
            said = self._line(timeout) or {}
            self.ready, self.remote_pid = bool(said.get("ready")), said.get("pid")
        return self.ready and self.alive()

    def ask(self, request: dict) -> dict:
        """Its answer to ``request``; ``SshHostError`` when none comes (the connection or the agent is gone)."""
        self.send(request)
        return self.receive()

    def send(self, request: dict) -> None:
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
        except OSError:
            raise SshHostError(f"{self.host}: its warm agent is gone (the connection closed)") from None

    def receive(self) -> dict:
        answer = self._line(ANSWER_TIMEOUT_S)
        if answer is None:
            self.stop()
            raise SshHostError(f"{self.host}: its warm agent did not answer within {ANSWER_TIMEOUT_S:.0f} s")
        if "error" in answer:
            raise SshHostError(f"{self.host}: its warm agent refused the request: {answer['error']}")
        return answer

    def _line(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while b"\n" not in self._pending:
                if not selector.select(max(0.0, deadline - time.monotonic())):  # timeout 0: what came already
                    return None
                chunk = os.read(self.process.stdout.fileno(), 65536)
                if not chunk:
                    return None
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def stop(self) -> None:
        """Close its channel (it ends at its standard input's end) and wait for the ssh client."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        with contextlib.suppress(OSError):
            self.process.stdout.close()


class HostPool:
    """One set of hosts' connections, their facts, and their warm agents (for one environment at a time)."""

    def __init__(self, targets: Sequence[str], *, config: str | None, python: str, options: Sequence[str] = (),
                 host_options: Sequence[Sequence[str]] = (), hint: Callable[[str], str] = str):
        self.connections = Connections(targets, config=config, options=options, host_options=host_options)
        #: The interpreter named for every host (``--ssh-python``, else :data:`DEFAULT_PYTHON`).
        self.python = python
        #: Each host's interpreter: :attr:`python`, or the notebook's own version installed there for kinetic_nb
        #: where the default one is another (:mod:`python_install`).
        self.pythons: list[str] = [python] * len(self.connections.hosts)
        self.lock = threading.RLock()
        try:
            self.connections.open()
        except SshHostError as error:  # the platform's advice (a TPU VM's key gcloud has not pushed yet)
            raise SshHostError(hint(str(error))) from None
        try:
            self.facts: list[HostFacts] = self._probe_installing_pythons()
        except BaseException:
            self.connections.close()
            raise
        #: The ports the opening probe found on host 0, for the first job (later ones ask a warm agent, or probe).
        self._fresh_ports: tuple[int, ...] | None = self.facts[0].ports
        #: file:// roots every host was seen to share.
        self.shared_roots: set[str] = set()
        #: Where the other hosts reach host 0, once resolved (``ssh -G``, a process: not once a job).
        self.host0_address: str | None = None
        self.warm: list[RemoteWarmAgent] = []
        #: When host 0's warm agent was asked for the next job's ports, its answer not read yet.
        self._ports_asked: float | None = None
        self.closed = False
        self._timer: threading.Timer | None = None
        self._used_at = time.monotonic()
        self.touch()

    def _probe_installing_pythons(self) -> list[HostFacts]:
        """Every host's facts; where the default interpreter (no ``--ssh-python``) is another minor version than
        the notebook's, those of the notebook's version, installed there once (or found installed) and from then on
        the host's interpreter (:attr:`pythons`). A named interpreter is taken as it is: another version is refused
        in one line."""
        notebook = sys.version_info[:2]
        facts = probe_hosts(self.connections, python=self.pythons, other_versions=self.python == DEFAULT_PYTHON)
        lacking = [index for index, found in enumerate(facts) if found.python[:2] != notebook]
        if not lacking:
            return facts
        others = sorted({".".join(map(str, facts[index].python[:2])) for index in lacking})
        print(f"kinetic_nb: {protocol.hosts_named(lacking)} "
              f"run{'' if len(lacking) > 1 else 's'} Python {', '.join(others)}; this notebook's "
              f"{notebook[0]}.{notebook[1]} is used there instead, installed once per host with uv's managed "
              "Pythons (a minute the first time)", flush=True)
        installed = install_pythons(self.connections, facts, lacking, notebook)
        for index, found in installed.items():
            self.pythons[index] = found.executable
        facts = probe_hosts(self.connections, python=self.pythons)
        name_interpreters(self.connections, {index: self.pythons[index] for index in installed},
                          {index: f"{ENVIRONMENTS_DIR}/{facts[index].environments_key()}" for index in installed})
        return facts

    def touch(self) -> None:
        """A job used it: its idle close starts again (one timer a pool, which looks again when it fires: a
        thread started for every job cost each about a millisecond)."""
        self._used_at = time.monotonic()
        if self._timer is None:
            self._close_after(IDLE_CLOSE_S)

    def _close_after(self, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self._close_if_idle)
        self._timer.daemon = True
        self._timer.start()

    def _close_if_idle(self) -> None:
        with self.lock, _pools_lock:  # after a launch that holds it, not during one
            idle = time.monotonic() - self._used_at
            if self.closed:
                return
            if idle < IDLE_CLOSE_S:  # used since this timer was set: look again when it will have been idle
                self._close_after(IDLE_CLOSE_S - idle)
                return
            close_pool(self)

    def healthy(self) -> bool:
        """Whether its connections still work: its warm agents run (they ride on them), or every master answers."""
        if self.warm and all(agent.alive() for agent in self.warm):
            return True
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(self.connections.hosts), 32)) as pool:
            return all(pool.map(self.connections.master_alive, range(len(self.connections.hosts))))

    def host0_ports(self) -> tuple[int, ...]:
        """Two ports free on host 0 (the coordinator's, a session hub's): the opening probe's for the first job,
        then those host 0's warm agent was asked for as the last job started (recent ones: else asked now), or a
        new probe."""
        if self._fresh_ports is not None:
            ports, self._fresh_ports = self._fresh_ports, None
            return ports
        with contextlib.suppress(SshHostError):  # a warm agent gone: the probe's way
            asked, self._ports_asked = self._ports_asked, None
            if asked is not None:
                ports = tuple(self.warm[0].receive()["ports"])
                if time.monotonic() - asked < PORTS_FRESH_S:
                    return ports
            if self.warm and self.warm[0].wait_ready(0):
                return tuple(self.warm[0].ask({"ports": 2})["ports"])
        return probe_hosts(self.connections, python=self.pythons)[0].ports

    def _ask_ports_ahead(self) -> None:
        """Ask host 0's warm agent for the next job's ports now, off that job's path (read by
        :meth:`host0_ports`)."""
        if self._ports_asked is None and self.warm and self.warm[0].wait_ready(0):
            with contextlib.suppress(SshHostError):
                self.warm[0].send({"ports": 2})
                self._ports_asked = time.monotonic()

    def environments(self, index: int) -> str:
        """Where host ``index`` keeps the environments of the interpreter it runs kinetic_nb with, under its cache
        directory: the bootstrap's ``--environments``."""
        return f"{ENVIRONMENTS_DIR}/{self.facts[index].environments_key()}"

    def check_shared(self, path: str) -> None:
        """``SshHostError`` in one line unless every host sees, and its user can use, the job's ``file://`` directory
        ``path``; asked once per storage root (the directory above a job's): the next job's directory is there too."""
        root = os.path.dirname(path.rstrip("/"))
        if root not in self.shared_roots:
            probe_hosts(self.connections, python=self.pythons, storage_path=path, ports=0)
            self.shared_roots.add(root)

    def launch_warm(self, digest: str, request_for: Callable[[int], dict]) -> list[int]:
        """Have each host's warm agent for environment ``digest`` fork its job agent (``request_for(index)``);
        the hosts it could not ask (none ready for that environment), whose agents start the bootstrap's way.
        ``SshHostError`` for a host that was asked and did not answer."""
        if self._ports_asked is not None:  # an answer still on its way comes first (a gone agent: none)
            self._ports_asked = None
            with contextlib.suppress(SshHostError):
                self.warm[0].receive()
        ready = [index for index, agent in enumerate(self.warm)
                 if agent.digest == digest and agent.wait_ready(0)]
        for index in ready:  # every host forks at once; then each answer is read
            self.warm[index].send({"launch": request_for(index)})
        for index in ready:
            self.warm[index].receive()
        self._ask_ports_ahead()
        return [index for index in range(len(self.connections.hosts)) if index not in ready]

    def warm_up(self, digest: str) -> None:
        """Start a warm agent on every host in environment ``digest`` (which every host now has), for the next
        job; they import while this job runs."""
        if self.warm and all(agent.digest == digest and agent.alive() for agent in self.warm):
            return
        self._stop_warm()
        self.warm = [RemoteWarmAgent(self.connections, index, digest, self.environments(index))
                     for index in range(len(self.connections.hosts))]

    def _stop_warm(self) -> None:
        for agent in self.warm:
            agent.stop()
        self.warm = []
        self._ports_asked = None

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._stop_warm()
        self.connections.close()


_pools: dict[tuple, HostPool] = {}
_pools_lock = threading.Lock()


def pool_for(targets: Sequence[str], *, config: str | None, python: str, options: Sequence[str] = (),
             host_options: Sequence[Sequence[str]] = (), hint: Callable[[str], str] = str) -> HostPool:
    """The open pool for these hosts (opened now, or again when its connections broke); ``SshHostError`` in one
    line for a host that cannot be reached (``hint`` adds the platform's advice) or cannot run the job."""
    key = _pool_key(targets, config, python, options, host_options)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is not None and (pool.closed or not pool.healthy()):
            close_pool(pool)
            pool = None
        if pool is None:
            pool = HostPool(targets, config=config, python=python, options=options, host_options=host_options,
                            hint=hint)
            _pools[key] = pool
        pool.touch()
        return pool


def release_pool(targets: Sequence[str], *, config: str | None, python: str, options: Sequence[str] = (),
                 host_options: Sequence[Sequence[str]] = ()) -> bool:
    """Close the open pool for these hosts now (their control masters and warm agents), as :func:`pool_for` names
    it; whether one was closed. None open: nothing is opened to close it. One a launch holds (its lock taken by
    another thread) is left to that launch, and closes when idle."""
    with _pools_lock:
        pool = _pools.get(_pool_key(targets, config, python, options, host_options))
        if pool is None or not pool.lock.acquire(blocking=False):
            return False
        try:
            close_pool(pool)
        finally:
            pool.lock.release()
        return True


def _pool_key(targets: Sequence[str], config: str | None, python: str, options: Sequence[str],
              host_options: Sequence[Sequence[str]]) -> tuple:
    return tuple(targets), config, python, tuple(options), tuple(map(tuple, host_options))


def close_pool(pool: HostPool) -> None:
    """Close ``pool`` and forget it (the next job on its hosts connects again)."""
    for key, held in list(_pools.items()):
        if held is pool:
            del _pools[key]
    pool.close()


def close_pools() -> None:
    """Close every pool of this notebook (at its exit; the jobs they started run on)."""
    with _pools_lock:
        for pool in list(_pools.values()):
            close_pool(pool)


atexit.register(close_pools)
