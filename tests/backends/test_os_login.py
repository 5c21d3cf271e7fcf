"""``-b tpu-vm`` on a slice whose workers use OS Login: a real login as the POSIX user the OS Login API names.

The test hosts accept one login only, a user made for the run (``tests/ssh_hosts``) under the name the OS Login
double (``tests/backends/tpu_api_double``) gives the account; this machine's user is refused there, as OS Login
refuses a user it does not know.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import time

import pytest

import kinetic_nb
from kinetic_nb.backends.ssh.pool import close_pools

from ..ssh_hosts import SshTestHosts
from .tpu_api_double import answering_as_google, tpu_node

PROJECT, ZONE = "ml-team", "us-west4-a"
#: The account's POSIX user, as OS Login spells one (its email's characters turned to ``_``), of this run alone.
POSIX_USER = f"alice_example_com_{os.getpid()}"
SOURCE = ("import os, pwd\n"
          "me = pwd.getpwuid(os.getuid()).pw_name\n"
          "print('worker', os.environ['KINETIC_HOST_INDEX'], 'runs as', me, flush=True)\n"
          "me")


def files_of(uid: int) -> list[str]:
    """What ``uid`` owns directly under the shared temporary folders (an ssh socket's folder, a lock)."""
    found = []
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        with contextlib.suppress(FileNotFoundError), os.scandir(folder) as entries:
            found += [entry.path for entry in entries if _owner(entry) == uid]
    return found


def _owner(entry: os.DirEntry) -> int | None:
    try:
        return entry.stat(follow_symlinks=False).st_uid
    except FileNotFoundError:  # another test's file, gone since it was listed
        return None


def processes_of(user: str) -> list[int]:
    import psutil

    return [process.pid for process in psutil.process_iter(["username"]) if process.info["username"] == user]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                    reason="the workers' OS Login user is made with useradd, which needs root (CI runs as root)")
def test_workers_with_os_login_are_logged_in_as_the_posix_user_the_api_names(gcs_root, monkeypatch, tmp_path):
    """A v4-16 (2 workers) with ``enable-oslogin: TRUE``, each worker accepting only the account's POSIX user:
    the cell runs as that user on every worker, and nothing of that user is left after."""
    with SshTestHosts(2, users=[POSIX_USER] * 2) as hosts, answering_as_google(
            monkeypatch, {(PROJECT, ZONE, "os-login"): {**tpu_node(hosts.addresses, accelerator_type="v4-16"),
                                                        "metadata": {"enable-oslogin": "TRUE"}}},
            client_key=hosts.client_key, known_hosts=str(tmp_path / "google_compute_known_hosts"),
            project=PROJECT) as api:
        api.posix_user = POSIX_USER
        options = {"storage": gcs_root, "framework": "none", "quiet": True, "backend": "tpu-vm",
                   "backend_options": {"tpu": "os-login", "zone": ZONE, "ssh_config": hosts.config,
                                       "ssh_python": "venv/bin/python"}}
        uid = pwd.getpwnam(POSIX_USER).pw_uid
        try:
            handle = kinetic_nb.submit(SOURCE, **options)
            assert handle.result(timeout=600) == POSIX_USER
            for index in range(2):
                said = [line for line in handle.logs(index).splitlines() if line.startswith("worker ")]
                assert said == [f"worker {index} runs as {POSIX_USER}"]
            assert [hosts.accepted(index) > 0 for index in range(2)] == [True, True]
        finally:
            close_pools()
        deadline = time.monotonic() + 15
        while left := processes_of(POSIX_USER):
            assert time.monotonic() < deadline, f"processes of {POSIX_USER} survived: {left}"
            time.sleep(0.1)
        home = hosts.homes[0]
    with pytest.raises(KeyError):
        pwd.getpwnam(POSIX_USER)
    assert not home.exists() and files_of(uid) == []
