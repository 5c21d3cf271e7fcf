"""The notebook's Python on an ssh host that lacks it: a uv-managed CPython, installed once into the host's cache.

Cells and their values travel pickled, and pickled code does not cross minor
versions, so every host runs kinetic_nb with the notebook's minor version. A
host whose default ``python3`` is another (every TPU VM image ships 3.10) gets
that version installed into ``~/.cache/kinetic_nb/pythons/`` (under
``$XDG_CACHE_HOME`` when set) by the host's own Python, behind a lock (two
notebooks at once install it once), and every later job finds it there: no
second install. An interpreter named with ``--ssh-python`` is always used as it
is, and nothing is installed for it.

Why uv's managed Pythons (``uv python install 3.X``): they are
python-build-standalone's relocatable CPython builds, which run from any folder
a user can write to, with no root, no compiler and no distribution package
(Ubuntu's ``python3.X`` lacks ``venv`` without another package, and pyenv
builds from source for minutes); uv checks each archive's sha256 against its
own list before unpacking it, and uv itself is one static binary, taken from
the host's ``PATH`` or else pip-installed into the cache with the host's own
Python. Its mirrors (``UV_PYTHON_INSTALL_MIRROR``) and its downloads list
(``UV_PYTHON_DOWNLOADS_JSON_URL``) are the host's login environment's, as for
any uv the user runs. Only a managed Python is taken (``--python-preference
only-managed``), never a stray ``python3.X`` uv would find on ``PATH`` or in
``/usr/bin``: such a one may lack ``venv`` and ``ensurepip``, carries its
distribution's packages, and changes with the machine's package updates, while
the managed one is the same build on every host of the slice.

The environments a host keeps are per interpreter
(:meth:`~kinetic_nb.backends.ssh.probe.HostFacts.environments_key`); the folder
of the managed one's names it (:data:`~kinetic_nb.agent.bootstrap.INTERPRETER_RECORD`),
so the bootstrap, whichever Python runs it, makes its environments with that
interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
from collections.abc import Mapping, Sequence

from kinetic_nb.agent.bootstrap import INTERPRETER_RECORD
from kinetic_nb.backends.ssh.connections import Connections
from kinetic_nb.backends.ssh.probe import HostFacts
from kinetic_nb.errors import SshHostError

__all__ = ["PYTHONS_DIR", "HostPython", "install_pythons", "name_interpreters"]

logger = logging.getLogger(__name__)

#: Where a host keeps the Pythons installed for kinetic_nb (uv's ``UV_PYTHON_INSTALL_DIR``), under its user's
#: cache directory; beside it, ``uv/`` holds uv itself when the host had none, and uv's own cache.
PYTHONS_DIR = "kinetic_nb/pythons"
#: How long one host's install may take: uv downloads a ~30 MB archive (and pip uv itself, ~15 MB, at first).
INSTALL_TIMEOUT_S = 600
#: The longest line a failure quotes from uv or pip (a URL, a TLS error), so the error stays one readable line.
MAX_SAID_CHARS = 300

#: Runs on each host with its own Python (``-I``: the login's ``PYTHONPATH`` is not this script's), argv[1] the
#: minor version ("3.11"), argv[2] the pythons folder under the cache, argv[3] :data:`MAX_SAID_CHARS`. Prints
#: one JSON line: the interpreter's path, and whether this run installed it; else one line on standard error, what
#: was tried and the last line it said.
_ENSURE = r"""
import fcntl, json, os, shutil, subprocess, sys, time
version, folder, longest = sys.argv[1], sys.argv[2], int(sys.argv[3])
cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
pythons = os.path.join(cache, folder)
tools = os.path.join(os.path.dirname(pythons), "uv")
record_path = os.path.join(pythons, f"kinetic-python{version}.json")
def fail(tried, done):
    # uv says "error: WHAT" then "  cause: WHY" lines, the deepest last (pip: "ERROR: ..." lines): the first and
    # the deepest, else the last line it said
    said = [line.strip() for line in (done.stderr + done.stdout).decode(errors="replace").splitlines() if line.strip()]
    reasons = [line.split(":", 1)[1].strip() for line in said
               if line.lower().startswith(("error:", "cause:", "caused by:"))]
    why = ": ".join(dict.fromkeys([reasons[0], reasons[-1]])) if reasons else (said[-1] if said else "")
    print(f"{tried}: {why[:longest] or f'exit code {done.returncode}'}", file=sys.stderr)
    sys.exit(1)
def recorded():
    try:
        with open(record_path) as file:
            executable = json.load(file)["executable"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return executable if os.access(executable, os.X_OK) else None
def uv_program():
    own = os.path.join(tools, "tool", "bin", "uv")
    found = own if os.access(own, os.X_OK) else shutil.which("uv")
    if found:
        return found
    done = subprocess.run([sys.executable, "-I", "-m", "pip", "install", "--no-input", "--disable-pip-version-check",
                           "--quiet", "--target", os.path.join(tools, "tool"), "uv"],
                          capture_output=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        fail(f"{os.path.basename(sys.executable)} -m pip install uv (the host has no uv)", done)
    return own
os.makedirs(pythons, mode=0o700, exist_ok=True)
with open(os.path.join(pythons, "kinetic-install.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # another notebook's install of it finishes first, and is found
    executable = recorded()
    installed = executable is None
    if installed:
        uv = uv_program()
        env = dict(os.environ, UV_PYTHON_INSTALL_DIR=pythons, UV_CACHE_DIR=os.path.join(tools, "cache"),
                   UV_PYTHON_BIN_DIR=os.path.join(tools, "python-bin"))
        # "find" without --system would take a virtual environment active in the login, or in its home
        for step in (["install"], ["find", "--system", "--no-project"]):
            done = subprocess.run([uv, "python", *step, "--python-preference", "only-managed", version], env=env,
                                  capture_output=True, stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                fail(f"uv python {step[0]} {version}", done)
        executable = done.stdout.decode().strip().splitlines()[-1]
        with open(record_path + ".tmp", "w") as file:
            json.dump({"executable": executable, "version": version, "uv": uv, "installed_at": time.time()}, file)
        os.replace(record_path + ".tmp", record_path)
print(json.dumps({"executable": executable, "installed": installed}))
"""

#: Run by the installed interpreter: argv[1] is the folder (under the cache) of its environments, where it writes
#: its own path for the bootstrap into the file argv[2].
_NAME_INTERPRETER = r"""
import os, sys
cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
folder, record = os.path.join(cache, sys.argv[1]), sys.argv[2]
os.makedirs(folder, mode=0o700, exist_ok=True)
with open(os.path.join(folder, record + ".tmp"), "w") as file:
    file.write(sys.executable)
os.replace(os.path.join(folder, record + ".tmp"), os.path.join(folder, record))
"""


@dataclasses.dataclass(frozen=True)
class HostPython:
    """The notebook's Python on one host: its path there, and whether it was installed now (else found)."""

    executable: str
    installed_now: bool


def install_pythons(connections: Connections, facts: Sequence[HostFacts], lacking: Sequence[int],
                    version: tuple[int, int]) -> dict[int, HostPython]:
    """The notebook's Python (minor ``version``) on each host of ``lacking``, installed now where it was not yet,
    by that host's own Python (``facts[index].executable``), by host. ``SshHostError`` in one line for the lowest
    host where it could not be installed, naming what was tried and what to do instead."""
    wanted = f"{version[0]}.{version[1]}"
    answers = connections.run_each(lambda index: [facts[index].executable, "-I", "-c", _ENSURE, wanted, PYTHONS_DIR,
                                                          str(MAX_SAID_CHARS)],
                                   timeout=INSTALL_TIMEOUT_S, only=lacking)
    found = {}
    for index, answer in zip(lacking, answers, strict=True):
        if answer.returncode != 0:
            said = [line.strip() for line in answer.stderr.decode(errors="replace").splitlines() if line.strip()]
            raise SshHostError(install_failure(connections.hosts[index], facts[index], wanted,
                                               said[-1] if said else f"exit code {answer.returncode}"))
        said = json.loads(answer.stdout.decode().strip().splitlines()[-1])
        found[index] = HostPython(said["executable"], bool(said["installed"]))
        if found[index].installed_now:
            logger.info("%s: installed Python %s for kinetic_nb at %s", connections.hosts[index], wanted,
                        found[index].executable)
    return found


def install_failure(host: object, found: HostFacts, wanted: str, said: str) -> str:
    """One line for a host whose Python is another minor version than the notebook's, and where installing the
    notebook's failed (``said``: what was tried and its own last line)."""
    return (f"{host} runs Python {'.'.join(map(str, found.python))} ({found.executable}), not this notebook's "
            f"{wanted}, and installing {wanted} there failed ({said}): install python{wanted} there and name it "
            "with --ssh-python, or let the host reach uv's Python downloads (a mirror: UV_PYTHON_INSTALL_MIRROR)")


def name_interpreters(connections: Connections, pythons: Mapping[int, str], environments: Mapping[int, str]) -> None:
    """Write, in each host's environments folder (``environments[index]``, under its cache), the path of the
    interpreter ``pythons[index]`` they are made with, which the bootstrap makes them with whichever Python runs
    it; ``SshHostError`` in one line for a host where it could not."""
    hosts = sorted(pythons)
    answers = connections.run_each(lambda index: [pythons[index], "-I", "-c", _NAME_INTERPRETER, environments[index],
                                                           INTERPRETER_RECORD],
                                   timeout=60, only=hosts)
    for index, answer in zip(hosts, answers, strict=True):
        if answer.returncode != 0:
            said = [line.strip() for line in answer.stderr.decode(errors="replace").splitlines() if line.strip()]
            raise SshHostError(f"{connections.hosts[index]}: {shlex.quote(pythons[index])} could not name itself in "
                               f"its environments folder: {said[-1] if said else 'no message'}")
