"""An agent's scratch folder is held while its agent (or a host it forked) lives, and the next agent's sweep removes
the folder of one that was killed before it could: real processes, SIGKILLed."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

import kinetic_nb
from kinetic_nb.agent import scratch

#: A process that makes a scratch folder in the folder it is given, forks a child that holds it too (as a forked
#: host does), says both, and waits.
HOLDER = """
import os, sys, time
from kinetic_nb.agent.scratch import Scratch
held = Scratch("kn-20260101-000000-abcdef", folder=sys.argv[1])
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
print(held.path, child, flush=True)
time.sleep(600)
"""


def start_holder(folder) -> tuple[subprocess.Popen, str, int]:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    path, child = holder.stdout.readline().split()
    return holder, path, int(child)


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def gone(pid: int, timeout: float = 10) -> bool:
    """Whether process ``pid`` has ended (a zombie has: its descriptors are closed), within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def test_a_killed_agents_scratch_is_swept_once_nothing_of_it_lives_and_a_living_ones_stays(tmp_path):
    holder, path, child = start_holder(tmp_path)
    living, living_path, living_child = start_holder(tmp_path)
    try:
        assert sorted(os.listdir(path)) == [scratch.ALIVE]  # the lock has its name only once it is held
        kill(holder.pid)
        holder.wait()
        assert scratch.sweep_abandoned(str(tmp_path)) == []  # its forked child still holds it
        assert os.path.isdir(path)
        kill(child)
        assert gone(child)  # reaped by init: an orphan
        assert scratch.sweep_abandoned(str(tmp_path)) == [path]
        assert not os.path.exists(path) and os.path.isdir(living_path)
    finally:
        for pid in (holder.pid, child, living.pid, living_child):
            kill(pid)
        holder.wait()
        living.wait()
    assert gone(living_child)
    assert scratch.sweep_abandoned(str(tmp_path)) == [living_path]
    assert os.listdir(tmp_path) == []


def test_a_removal_cut_short_keeps_the_lock_file_so_the_next_sweep_finishes_it(tmp_path, monkeypatch):
    holder, path, child = start_holder(tmp_path)
    os.makedirs(os.path.join(path, "workdir-x", "pkg"))  # the shipped folder's copy
    pathlib.Path(path, "workdir-x", "pkg", "module.py").write_text("")
    pathlib.Path(path, "stacks-0.txt").write_text("")
    for pid in (child, holder.pid):
        kill(pid)
    holder.wait()
    assert gone(child)

    def killed_meanwhile(*args, **kwargs):
        raise KeyboardInterrupt  # as an agent SIGKILLed in the middle of its removal would stop

    with monkeypatch.context() as patched:
        patched.setattr(scratch.shutil, "rmtree", killed_meanwhile)
        with pytest.raises(KeyboardInterrupt):
            scratch.remove_lock_last(path)
    assert os.path.exists(os.path.join(path, scratch.ALIVE))
    removed = []
    unlink = os.unlink

    def recorded(name, *args, **kwargs):
        removed.append(os.path.basename(name))
        return unlink(name, *args, **kwargs)

    for index in range(20):  # an order that put the lock file anywhere but last would show
        pathlib.Path(path, f"stacks-{index}.txt").write_text("")
    with monkeypatch.context() as patched:
        patched.setattr(os, "unlink", recorded)
        assert scratch.sweep_abandoned(str(tmp_path)) == [path]
    assert removed[-1] == scratch.ALIVE and len(removed) == 22, removed
    assert os.listdir(tmp_path) == []


def test_the_sweep_leaves_what_is_not_an_agents_scratch_it_can_prove_abandoned(tmp_path):
    unlocked = tmp_path / "kinetic-kn-20260101-000000-abcdef-agent-starting"  # made, its lock not yet named
    unlocked.mkdir()
    (unlocked / f"{scratch.ALIVE}-claiming").write_text("")
    other = tmp_path / "kinetic-kn-20260101-000000-abcdef-workdir-x1"  # not an agent's scratch
    other.mkdir()
    (other / scratch.ALIVE).write_text("")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / scratch.ALIVE).write_text("")
    (tmp_path / "kinetic-kn-20260101-000000-abcdef-agent-link").symlink_to(target)  # never followed
    assert scratch.sweep_abandoned(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == sorted([unlocked.name, other.name, "elsewhere",
                                                   "kinetic-kn-20260101-000000-abcdef-agent-link"])


def test_a_job_started_after_an_agent_was_killed_sweeps_its_scratch_and_leaves_its_own_none(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the agents' temporary folder: this test's alone
    holder, _, child = start_holder(tmp_path)
    kill(child)
    kill(holder.pid)
    holder.wait()
    assert gone(child)
    handle = kinetic_nb.submit("41 + 1", hosts=2, framework="none")
    assert handle.result() == 42
    handle.wait()
    deadline = time.monotonic() + 10  # the agent ends a moment after its hosts: its sweep and its own scratch
    while (left := [name for name in os.listdir(tmp_path) if name.startswith("kinetic-")]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == []  # the killed one's, swept, and the job's own, removed at its end
