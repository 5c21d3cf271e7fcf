"""Two unprivileged users on this machine, a victim and an attacker, for the trust tests.

The tests run as root, and root skips the very checks under test (file modes,
owners, ``O_NOFOLLOW`` on a directory another user made), so each side of an
attack runs in a forked child that drops to a uid of its own: ``run`` calls a
function there and brings back its value or its exception. The uids need no
entry in ``/etc/passwd``: each user's ``HOME`` and ``XDG_CACHE_HOME`` lie in a
0700 directory it owns, below a directory every user can traverse.

The fixture proves that nothing either user started survives the test.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest

#: Far above the ids Debian gives to people and services, so no real user is borrowed.
VICTIM_UID = 61_001
ATTACKER_UID = 61_002
#: How long one side of an attack may take before the test fails instead of hanging.
RUN_TIMEOUT_S = 180.0
#: How long the users' job processes get to end by themselves after a test.
SURVIVOR_WAIT_S = 15.0


class RemoteFailure(Exception):
    """An exception raised as the other user that could not be brought back as itself."""


@dataclasses.dataclass(frozen=True)
class User:
    """One unprivileged user: its uid and its own 0700 home."""

    name: str
    uid: int
    home: Path

    def environment(self) -> dict[str, str]:
        """What the user's processes see in place of root's: their own home and cache."""
        return {"HOME": str(self.home), "XDG_CACHE_HOME": str(self.home / ".cache"), "USER": self.name,
                "LOGNAME": self.name}

    def run(self, func: Callable[..., Any], *args: Any, timeout: float = RUN_TIMEOUT_S, **kwargs: Any) -> Any:
        """``func(*args, **kwargs)`` as this user, in a forked child; its value, or its exception raised here."""
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: become the user, run, send back the outcome, and never return into pytest
            os.close(read_end)
            code = 0
            try:
                os.setgroups([])
                os.setgid(self.uid)
                os.setuid(self.uid)
                os.environ.update(self.environment())
                os.chdir(self.home)
                try:
                    outcome = ("value", func(*args, **kwargs))
                except BaseException as error:  # sent back whole
                    outcome = ("error", error, traceback.format_exc())
                try:
                    data = cloudpickle.dumps(outcome)
                except Exception:  # an unpicklable exception still comes back as text
                    data = cloudpickle.dumps(("error", None, outcome[-1] if outcome[0] == "error" else repr(outcome)))
                with open(write_end, "wb") as pipe:
                    pipe.write(data)
            except BaseException:  # the child must never return into pytest
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(write_end)
        with open(read_end, "rb") as pipe:
            deadline = time.monotonic() + timeout
            chunks = []
            os.set_blocking(read_end, False)
            while True:
                try:
                    chunk = pipe.read()
                except BlockingIOError:
                    chunk = None
                if chunk:
                    chunks.append(chunk)
                elif chunk == b"":
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    pytest.fail(f"{self.name} ({func.__name__}) ran past {timeout:g} s")
                time.sleep(0.01)
        os.waitpid(pid, 0)
        data = b"".join(chunks)
        if not data:
            raise RemoteFailure(f"{self.name} ({func.__name__}) ended without an outcome")
        outcome = cloudpickle.loads(data)
        if outcome[0] == "value":
            return outcome[1]
        error, text = outcome[1], outcome[2]
        if error is None:
            raise RemoteFailure(text)
        error.add_note(f"raised as {self.name} (uid {self.uid}):\n{text}")
        raise error


@dataclasses.dataclass(frozen=True)
class TwoUsers:
    victim: User
    attacker: User
    #: A directory both may write (0777, not sticky): the shared storage root of the attacks.
    shared: Path


def _reachable_by_everyone(paths: list[Path]) -> list[tuple[Path, int]]:
    """Give every directory on the way to ``paths`` the search bit for others (not read), as changed.

    The interpreter may live below root's 0700 home (pyenv does that): the
    other users must reach it, and this checkout, to run anything at all.
    """
    changed = []
    for path in paths:
        for directory in [*reversed(path.resolve().parents), path.resolve()]:
            mode = directory.stat().st_mode
            if directory.is_dir() and not mode & 0o001:
                directory.chmod(mode | 0o001)
                changed.append((directory, mode))
    return changed


def _processes_of(uids: set[int]) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid", "uids"]):
        try:
            if process.info["uids"] and process.info["uids"].real in uids:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture
def two_users() -> Iterator[TwoUsers]:
    """A victim, an attacker and a shared 0777 root; fails the test if a process of either survives it."""
    if os.geteuid() != 0:
        pytest.skip("switching between two users needs root (CI and these machines run the tests as root)")
    opened = _reachable_by_everyone([Path(sys.executable), Path(sys.base_prefix), Path(sys.prefix),
                                     Path(__file__).parent.parent])
    base = Path(tempfile.mkdtemp(prefix="kinetic-two-users-"))
    base.chmod(0o755)
    users = []
    for name, uid in (("victim", VICTIM_UID), ("attacker", ATTACKER_UID)):
        home = base / name
        home.mkdir(mode=0o700)
        os.chown(home, uid, uid)
        users.append(User(name, uid, home))
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    try:
        yield TwoUsers(users[0], users[1], shared)
    finally:
        uids = {VICTIM_UID, ATTACKER_UID}
        deadline = time.monotonic() + SURVIVOR_WAIT_S
        survivors = _processes_of(uids)
        while survivors and time.monotonic() < deadline:
            time.sleep(0.1)
            survivors = _processes_of(uids)
        described = []
        for process in survivors:
            try:
                described.append(f"{process.pid}: {' '.join(process.cmdline())}")
                process.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(base, ignore_errors=True)
        for directory, mode in reversed(opened):
            directory.chmod(mode)
        if described:
            pytest.fail(f"processes of the two users survived the test: {described}")
