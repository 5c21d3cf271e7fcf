"""The ssh backend's connections, against four real ``sshd`` processes on loopback addresses (``tests/ssh_hosts``).

One control master per host, opened in parallel and reused by every command
after it (each sshd logs one login, however many commands ran); standard input
reaches the remote command (the way the job's key will travel); an unreachable
host, a refused key and a changed host key each fail before anything runs, in
one line naming the host; nothing of ours is left running when the
connections are closed.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from kinetic_nb.backends.ssh.connections import Connections
from kinetic_nb.errors import SshHostError

from ..ssh_hosts import SshTestHosts


@pytest.fixture(scope="module")
def ssh_hosts():
    with SshTestHosts(4) as hosts:
        yield hosts


def our_ssh_processes(connections: Connections) -> list[psutil.Process]:
    """The ssh client processes (control masters) that name this connection set's socket directory."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        with __import__("contextlib").suppress(psutil.Error):
            if any(connections._directory in part for part in process.info["cmdline"] or ()):
                found.append(process)
    return found


def masters_left(connections: Connections, wait_s: float = 10.0) -> list[psutil.Process]:
    """:func:`our_ssh_processes` once they have had ``wait_s`` to end: a master told ``-O exit`` answers, then
    exits a moment later."""
    deadline = time.monotonic() + wait_s
    while (left := our_ssh_processes(connections)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_every_host_is_one_connection_opened_at_once_and_reused(ssh_hosts):
    before = [ssh_hosts.accepted(index) for index in range(4)]
    connections = Connections(ssh_hosts.targets, config=ssh_hosts.config)
    started = time.monotonic()
    connections.open()
    opened_in = time.monotonic() - started
    try:
        for _ in range(3):
            answers = connections.run_all(["sh", "-c", "echo $SSH_CONNECTION"])
            assert [answer.returncode for answer in answers] == [0] * 4
            assert [answer.stdout.decode().split()[2] for answer in answers] == ssh_hosts.addresses
        assert [ssh_hosts.accepted(index) - before[index] for index in range(4)] == [1] * 4  # one login each
        assert all(connections.master_alive(index) for index in range(4))
        assert len(our_ssh_processes(connections)) == 4
    finally:
        connections.close()
    assert masters_left(connections) == []
    assert opened_in < 4 * 15  # not four handshakes' timeouts in a row (a guard, not a benchmark)


def test_standard_input_reaches_the_remote_command_and_never_its_command_line(ssh_hosts):
    secret = "00112233445566778899aabbccddeeff"
    with Connections(ssh_hosts.targets[:1], config=ssh_hosts.config) as connections:
        answer = connections.run(0, ["sh", "-c", "read key; echo ${#key}; cat /proc/$$/cmdline | tr '\\0' ' '"],
                                 input=f"{secret}\n".encode())
    assert answer.returncode == 0
    length, command_line = answer.stdout.decode().split("\n", 1)
    assert length == str(len(secret)) and secret not in command_line


def test_a_remote_commands_own_failure_is_its_exit_status_not_an_ssh_error(ssh_hosts):
    with Connections(ssh_hosts.targets[:2], config=ssh_hosts.config) as connections:
        answer = connections.run(1, ["sh", "-c", "echo gone >&2; exit 3"])
    assert answer.returncode == 3 and answer.stderr.decode().strip() == "gone"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nobody", "host 1 (nobody) cannot be reached: nothing listens for ssh there (connection refused)"),
        ("wrong-key", "host 1 (wrong-key): the key was refused (") ,
        ("no-such-host.invalid", "host 1 (no-such-host.invalid) cannot be reached: its name does not resolve"),
    ],
)
def test_a_host_that_cannot_be_used_fails_before_anything_runs_in_one_line(ssh_hosts, target, message):
    connections = Connections(["h0", target, "h2"], config=ssh_hosts.config)
    with pytest.raises(SshHostError) as caught:
        connections.open()
    text = str(caught.value)
    assert text.startswith(message) and "\n" not in text
    assert masters_left(connections) == []  # the hosts that did connect were closed again


def test_a_changed_host_key_is_named_with_the_fix():
    with SshTestHosts(2) as rebuilt:  # servers of its own: the others' keys stay as the client knows them
        rebuilt.forget_host_key(1)
        connections = Connections(rebuilt.targets, config=rebuilt.config)
        with pytest.raises(SshHostError) as caught:
            connections.open()
    assert str(caught.value) == (
        "host 1 (h1): its host key changed since it was last seen (a rebuilt machine, or someone in between): check "
        "it, then remove the old one with `ssh-keygen -R h1`")
    assert masters_left(connections) == []


def test_no_hosts_is_one_line():
    with pytest.raises(ValueError, match=r"^no ssh hosts given: name them, host 0 first"):
        Connections([])


def test_the_test_servers_are_real_sshd(ssh_hosts):
    version = subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr
    assert "OpenSSH" in version
    assert all(psutil.Process(process.pid).name() == "sshd" for process in ssh_hosts.processes)


# -- what each host is -----------------------------------------------------------------------------------------


def test_every_host_says_its_python_and_host_0_a_free_port_for_the_coordinator(ssh_hosts, tmp_path):
    from kinetic_nb.backends.ssh.probe import probe_hosts

    with Connections(ssh_hosts.targets, config=ssh_hosts.config) as connections:
        facts = probe_hosts(connections, storage_path=str(tmp_path))
    assert all(fact.python[:2] == tuple(sys.version_info[:2]) and fact.sees_storage for fact in facts)
    assert len(set(facts[0].ports)) == 2 and [fact.ports for fact in facts[1:]] == [()] * 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"storage_path": "/nowhere/kinetic-jobs"},
         "host 0 (h0) does not see the job storage /nowhere/kinetic-jobs: a file:// root must be a directory every "
         "host shares; use --storage gs://BUCKET/PREFIX"),
        ({"notebook_python": (3, 9)}, "host 0 (h0) runs Python {version} ("),
        ({"python": "python9"}, "host 0 (h0) has no python9: install Python {minor} there, or name one with "
                                "--ssh-python"),
    ],
)
def test_a_host_that_cannot_run_the_job_is_one_line_naming_it(ssh_hosts, options, message):
    from kinetic_nb.backends.ssh.probe import probe_hosts

    with Connections(ssh_hosts.targets[:2], config=ssh_hosts.config) as connections:
        with pytest.raises(SshHostError) as caught:
            probe_hosts(connections, **options)
    minor = f"{options.get('notebook_python', sys.version_info[:2])[0]}.{options.get('notebook_python', sys.version_info[:2])[1]}"
    expected = message.format(version=".".join(map(str, sys.version_info[:3])), minor=minor)
    assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)


def test_a_killed_notebooks_control_directory_goes_with_the_next_notebooks_connections(monkeypatch, tmp_path):
    """A notebook killed before it closed its connections left its directory in /tmp: the next one removes it
    (its pid is gone), never a live notebook's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    stale = tmp_path / f"kinetic-ssh-{ended.pid}-abc123"
    live = tmp_path / f"kinetic-ssh-{os.getpid()}-def456"
    other = tmp_path / "kinetic-ssh-notapid"
    for directory in (stale, live, other):
        directory.mkdir()
        (directory / "0").write_text("")
    connections = Connections(["worker-0"])
    try:
        assert not stale.exists() and live.exists() and other.exists()
        assert os.path.basename(connections._directory).startswith(f"kinetic-ssh-{os.getpid()}-")
    finally:
        connections.close()
    assert not pathlib.Path(connections._directory).exists()

