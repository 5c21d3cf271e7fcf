"""The notebook's side of its warm agent (``kinetic_nb.agent.warm``): start it, hand it a local job, replace it.

One per notebook process, started beside the first local job (which starts
its own agent, as every job does without one) and used from the next on. A
job goes to it only when it would start the agent a fresh interpreter would:
the same Python, and the same variables that act when a process starts
(``PYTHON*``, the dynamic loader's ``LD_*``: :func:`startup_variables`);
otherwise, or when it does not answer at once, the job's agent starts afresh
and the warm agent is replaced for the next job. ``KINETIC_WARM_AGENT=0`` turns it off.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping

from kinetic_nb.agent.warm import peer_credentials

logger = logging.getLogger(__name__)

__all__ = ["WARM_AGENT_ENV", "launch_warm", "startup_variables", "stop_warm_agent", "warm_agent_wanted"]

#: ``0`` starts every local job's agent afresh.
WARM_AGENT_ENV = "KINETIC_WARM_AGENT"
#: Environment variables that act when a process starts, not after (see :func:`startup_variables`).
STARTUP_PREFIXES = ("PYTHON", "LD_", "GLIBC_TUNABLES", "MALLOC_")
#: A warm agent answers at once or not at all: past this, the job's agent starts afresh.
ANSWER_TIMEOUT_S = 2.0


class WarmAgent:
    """A running warm agent, and what it was started with."""

    def __init__(self, python: str, startup: Mapping[str, str]):
        self.python = python
        self.startup = dict(startup)
        self.owner = os.getpid()
        self.name = f"kinetic-warm-{os.getuid()}-{secrets.token_hex(8)}"
        self.process = subprocess.Popen(
            [python, "-m", "kinetic_nb.agent.warm", "--parent", str(self.owner), "--name", self.name],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in the notebook's process group: an interrupt must not reach it
            close_fds=True,
        )

    def serves(self, python: str, startup: Mapping[str, str]) -> bool:
        return (self.owner == os.getpid() and self.process.poll() is None and python == self.python
                and dict(startup) == self.startup)

    def launch(self, argv: list[str], env: Mapping[str, str], cwd: str, key_hex: str, log: str) -> int | None:
        """The pid of the job's agent it forked, or None if it did not (not ready yet, or not itself)."""
        request = json.dumps({"argv": argv, "env": dict(env), "cwd": cwd, "key": key_hex, "log": log}).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.settimeout(ANSWER_TIMEOUT_S)
                connection.connect("\0" + self.name)
                if peer_credentials(connection) != (self.process.pid, os.getuid()):
                    logger.warning("the warm agent's socket %s is held by another process", self.name)
                    return None
                connection.sendall(request)
                connection.shutdown(socket.SHUT_WR)
                return int(connection.recv(64))
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.process.wait(5)


def warm_agent_wanted() -> bool:
    """Whether ``KINETIC_WARM_AGENT`` allows a warm agent (unset or 1); ``ValueError`` naming any other value."""
    setting = os.environ.get(WARM_AGENT_ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{WARM_AGENT_ENV} must be 0 (start every local job's agent afresh) or 1, got {setting!r}")
    return setting == "1"


def startup_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that act only when a process starts: the interpreter's (``PYTHON*``) and the C
    library's (the dynamic loader's ``LD_*``, ``GLIBC_TUNABLES``, ``MALLOC_*``). A warm agent forks; it
    does not start again, so a job whose variables differ from its own gets an agent started afresh."""
    return {name: value for name, value in env.items() if name.startswith(STARTUP_PREFIXES)}


_warm: WarmAgent | None = None
_lock = threading.Lock()


def launch_warm(argv: list[str], env: Mapping[str, str], key_hex: str, log: str) -> bool:
    """Have this notebook's warm agent fork the agent ``python -m kinetic_nb.agent ARGV`` would start; False
    when it cannot (there is none yet, it is stale, or it did not answer): start one then, for the next job."""
    if not warm_agent_wanted():
        return False
    global _warm
    startup = startup_variables(env)
    with _lock:
        if _warm is not None and _warm.serves(sys.executable, startup):
            # One that does not answer is still importing: this job starts its own agent, the next uses it.
            return _warm.launch(argv, env, os.getcwd(), key_hex, log) is not None
        if _warm is not None and _warm.owner == os.getpid():  # gone, or started for another Python
            _warm.stop()
        try:
            _warm = WarmAgent(sys.executable, startup)
        except OSError as error:
            logger.info("no warm agent: %s", error)
            _warm = None
        return False


def stop_warm_agent() -> None:
    """Stop this notebook's warm agent (it also ends with the notebook); the agents it forked go on."""
    global _warm
    with _lock:
        if _warm is not None and _warm.owner == os.getpid():
            _warm.stop()
        _warm = None


atexit.register(stop_warm_agent)  # it would end with this process anyway: stopped and reaped first
