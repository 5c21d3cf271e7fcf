"""A TPU VM worker's chips that another program holds, as the probe finds them: by the chips' open files, and by
libtpu's lock file, which also names another user's program (its open files are not this user's to read).

The chips are files under a test folder standing in for ``/dev/accel*`` (``tpu_vm.TPU_DEVICES``), and the lock
file one standing in for ``/tmp/libtpu_lockfile`` (``probe.LIBTPU_LOCK_FILES``), locked the way libtpu locks it:
``lockf`` (a POSIX write lock on the whole file), held for the holder's life.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

import kinetic_nb
from kinetic_nb.backends.ssh import probe, tpu_vm
from kinetic_nb.backends.ssh.connections import Connections
from kinetic_nb.backends.ssh.probe import probe_hosts
from kinetic_nb.errors import SshHostError

from .test_tpu_vm_backend import on_tpu_vm, tpu_api  # noqa: F401 - the Cloud TPU API double, for these tests too


@contextlib.contextmanager
def lock_held(lock: pathlib.Path, *command_tail: str, mode: int = 0o644, chip: pathlib.Path | None = None):
    """A process holding libtpu's lock on ``lock`` as libtpu takes it (made with ``mode``, as libtpu makes it:
    0644 by older ones, 0600 by newer ones), and ``chip`` open where given, ``command_tail`` after its own command
    line; killed after, leaving the file."""
    script = ("import fcntl, os, time\n"
              f"fd = os.open({str(lock)!r}, os.O_CREAT | os.O_RDWR, {mode:#o})\n"
              "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"  # lockf(fd, F_TLOCK, 0): fcntl's F_SETLK, F_WRLCK
              + (f"chip = open({str(chip)!r})\n" if chip is not None else "")
              + "print('held', flush=True)\ntime.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", script, *command_tail], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


@pytest.fixture
def tpu_files(monkeypatch, tmp_path) -> pathlib.Path:
    """The workers' chips (a file no process holds) and libtpu's lock file (not there yet: its path)."""
    chip = tmp_path / "accel0"
    chip.write_bytes(b"")
    monkeypatch.setattr(tpu_vm, "TPU_DEVICES", (str(chip),))
    lock = tmp_path / "libtpu_lockfile"
    monkeypatch.setattr(probe, "LIBTPU_LOCK_FILES", (str(lock),))
    return lock


def test_a_held_libtpu_lock_refuses_the_worker_naming_its_holder(ssh_hosts, tpu_api, tpu_files):  # noqa: F811
    """The chips' files are not open (a program between its lock and its chips, or one whose chips the probe
    cannot see): the lock alone refuses the worker, naming the process by its pid."""
    with lock_held(tpu_files) as holder, pytest.raises(SshHostError) as caught:
        kinetic_nb.submit("'never'", framework="none", quiet=True, **on_tpu_vm(ssh_hosts))
    message = str(caught.value)
    assert re.fullmatch(rf"host 0 \({re.escape(ssh_hosts.addresses[0])}\): its TPU is held by process {holder.pid} "
                        rf"\({re.escape(sys.executable)} -c import fcntl, os, time .*\), which holds libtpu's lock "
                        rf"{re.escape(str(tpu_files))}: a job, session or notebook there still runs; stop it "
                        rf"\(kill {holder.pid}\) and run the cell again", message), message


def test_a_stale_libtpu_lock_file_no_process_holds_refuses_nothing(ssh_hosts, tpu_api, tpu_files):  # noqa: F811
    """The file a killed TPU program left behind: nobody holds its lock, so the chips are free."""
    with lock_held(tpu_files):
        pass
    assert tpu_files.exists()
    handle = kinetic_nb.submit("'ran'", framework="none", quiet=True, **on_tpu_vm(ssh_hosts))
    assert handle.result(timeout=300) == "ran"


@pytest.fixture(scope="module")
def host_of_its_own_user():
    """A test host logging in a user of its own (not root, who may read every process's open files)."""
    from ..ssh_hosts import SshTestHosts

    with SshTestHosts(1, users=True) as hosts, Connections(hosts.targets, config=hosts.config) as connections:
        yield connections


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                    reason="a user of its own per test host is made with useradd, which needs root (CI runs as root)")
@pytest.mark.parametrize("mode", [0o644, 0o600], ids=["lock-file-others-read", "lock-file-closed-to-others"])
def test_another_users_program_on_the_chips_is_named_with_its_user(host_of_its_own_user, mode):
    """The host's user cannot read root's open files, so the chips' holder is found by libtpu's lock alone:
    asked of the lock itself where the user can open the file (0644), in ``/proc/locks`` where it cannot (0600);
    the refusal names the process and its user, the way out theirs or root's. Once it ends, the file it left
    refuses nothing."""
    connections = host_of_its_own_user
    shared = pathlib.Path(tempfile.mkdtemp(prefix="kinetic-tpu-"))
    try:
        shared.chmod(0o755)  # the host's user reaches the files; the holder's open files stay closed to it
        chip, lock = shared / "accel0", shared / "libtpu_lockfile"
        chip.write_bytes(b"")

        def chips_probe() -> list:
            return probe_hosts(connections, python="venv/bin/python", ports=0, devices=(str(chip),),
                               device_name="TPU", lock_files=(str(lock),))

        with lock_held(lock, mode=mode, chip=chip) as holder, pytest.raises(SshHostError) as caught:
            chips_probe()
        message = str(caught.value)
        assert re.fullmatch(rf"host 0 \(h0\): its TPU is held by process {holder.pid} of user root "
                            rf"\({re.escape(sys.executable)} -c import fcntl, os, time .*\), which holds libtpu's lock "
                            rf"{re.escape(str(lock))}: a job, session or notebook of theirs still runs there; ask root "
                            rf"to stop it, or stop it as root \(sudo kill {holder.pid}\), and run the cell again",
                            message), message
        assert os.stat(lock).st_mode & 0o777 == mode
        assert chips_probe()[0].holders == ()  # the file stays, no process holds it
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                    reason="a user of its own per test host is made with useradd, which needs root (CI runs as root)")
def test_another_users_kinetic_session_on_the_chips_is_theirs_to_stop(host_of_its_own_user):
    """A kinetic_nb session of another user holds the chips: %kinetic stop is the way out, in their notebook."""
    connections = host_of_its_own_user
    shared = pathlib.Path(tempfile.mkdtemp(prefix="kinetic-tpu-"))
    session_id = "ks-20261206-101010-abc123"
    try:
        shared.chmod(0o755)
        chip, lock = shared / "accel0", shared / "libtpu_lockfile"
        chip.write_bytes(b"")
        with lock_held(lock, "-m", "kinetic_nb.agent", "--job", f"file:///jobs/sessions/{session_id}", mode=0o600,
                       chip=chip) as holder, pytest.raises(SshHostError) as caught:
            probe_hosts(connections, python="venv/bin/python", ports=0, devices=(str(chip),), device_name="TPU",
                        lock_files=(str(lock),))
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert str(caught.value) == (f"host 0 (h0): its TPU is held by user root's kinetic_nb session {session_id} "
                                 f"(process {holder.pid}), which holds libtpu's lock {lock}: ask root to end it with "
                                 "%kinetic stop in its notebook, and run the cell again")
