"""The notebook's Python on ssh hosts whose ``python3`` is another minor version: installed once, reused, and
``--ssh-python`` still wins, against real ``sshd`` processes on loopback addresses (``tests/ssh_hosts``).

Nothing is downloaded from the internet: uv itself comes from the package index (pip, on the host, as on a host
without uv), and the Python it installs from a downloads list of the test's own (``UV_PYTHON_DOWNLOADS_JSON_URL``,
in the hosts' login environment as a user's mirror would be), whose one entry is an archive laid out as
python-build-standalone's are (``python/bin/python3.X``, ``python/lib/...``), made once per test run from this
machine's CPython of the notebook's version, with its sha256. Each host's ``python3`` is Python 3.10, and a
``python3.X`` of the notebook's version lies on its ``PATH`` (``/usr/bin``) where uv would find it unless told to
take only a managed one.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time

import pytest

import kinetic_nb
from kinetic_nb.backends.ssh.connections import Connections
from kinetic_nb.backends.ssh.pool import close_pools
from kinetic_nb.backends.ssh.probe import probe_hosts
from kinetic_nb.backends.ssh.python_install import PYTHONS_DIR, install_pythons
from kinetic_nb.errors import SshHostError

from ..conftest import ssh_warm_agents
from ..ssh_hosts import SshTestHosts


def _other_python() -> tuple[str, str]:
    """A CPython 3.10 of this machine and its full version (``("", "")`` when there is none): pyenv's, uv's, or
    one on the PATH, whichever answers first."""
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10.*/bin/python3.10")), reverse=True)
    uv = shutil.which("uv")
    if uv is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            found = subprocess.run([uv, "python", "find", "--no-project", "3.10"], capture_output=True, text=True,
                                   timeout=20, check=False).stdout.strip()
            candidates += [found] if found else []
    candidates += [path for path in [shutil.which("python3.10")] if path]
    for path in candidates:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            version = subprocess.run([path, "-c", "import platform; print(platform.python_version())"],
                                     capture_output=True, text=True, timeout=20, check=False).stdout.strip()
            if version.startswith("3.10."):
                return path, version
    return "", ""


#: The hosts' default ``python3``: another minor version than the notebook's (and its full version).
OTHER_PYTHON, OTHER_PYENV_VERSION = _other_python()
NOTEBOOK = f"{sys.version_info[0]}.{sys.version_info[1]}"
#: What a cell says of the Python it runs on.
WHICH_PYTHON = "import sys\n(sys.base_prefix, sys.executable, tuple(sys.version_info[:2]))"
#: Left out of the stand-in archive: big, and nothing a host's cell needs (pip comes with the hosts' packages).
_LEFT_OUT = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "lib2to3", "__pycache__"}

pytestmark = pytest.mark.skipif(not OTHER_PYTHON or sys.version_info[:2] == (3, 10),
                                reason="needs a CPython 3.10 on this machine (pyenv's, uv's or on the PATH: "
                                       "`uv python install 3.10`), another minor version than the test's")


def standalone_archive(folder: pathlib.Path) -> pathlib.Path:
    """This machine's CPython of the notebook's version (the test interpreter's base), laid out as a
    python-build-standalone ``install_only`` archive is."""
    base = pathlib.Path(sys.base_prefix)
    library = f"python{NOTEBOOK}"
    archive = folder / f"cpython-{platform.python_version()}-stand-in.tar.gz"

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if _LEFT_OUT & set(info.name.split("/")[3:]) else info

    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(base / "bin" / library, f"python/bin/{library}")
        for shared in (base / "lib").glob("libpython*.so*"):
            tar.add(shared, f"python/lib/{shared.name}")
        tar.add(base / "lib" / library, f"python/lib/{library}", filter=keep)
    return archive


def downloads_list(folder: pathlib.Path, archive: pathlib.Path, *, sha256: str | None = None) -> pathlib.Path:
    """uv's downloads list (its ``download-metadata.json`` format) with one entry: ``archive``."""
    major, minor, patch = sys.version_info[:3]
    machine = platform.machine()
    entry = {"name": "cpython", "arch": {"family": machine, "variant": None}, "os": "linux", "libc": "gnu",
             "major": major, "minor": minor, "patch": patch, "prerelease": "", "url": archive.as_uri(),
             "sha256": sha256 or hashlib.sha256(archive.read_bytes()).hexdigest(), "variant": None,
             "build": "stand-in"}
    listing = folder / f"downloads-{len(list(folder.glob('downloads-*')))}.json"
    listing.write_text(json.dumps({f"cpython-{major}.{minor}.{patch}-linux-{machine}-gnu": entry}))
    return listing


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("python-downloads")
    return standalone_archive(folder)


def hosts_lacking_python(folder: pathlib.Path, count: int, downloads: pathlib.Path) -> SshTestHosts:
    """``count`` test hosts whose ``python3`` is :data:`OTHER_PYTHON`, each with a cache of its own, their uv's
    downloads list ``downloads``, and the test interpreter's packages on ``PYTHONPATH`` (jax, cloudpickle: built for
    the notebook's version, as a machine with them installed for it has them)."""
    import sysconfig

    bin_folder = folder / "bin"
    bin_folder.mkdir(exist_ok=True)
    if not (bin_folder / "python3").exists():
        (bin_folder / "python3").symlink_to(OTHER_PYTHON)
    # PYENV_VERSION: where the login's shell puts pyenv's shims first on PATH (a ~/.bashrc), they run it too
    environment = {"PATH": f"{bin_folder}:/usr/bin:/bin", "PYENV_VERSION": OTHER_PYENV_VERSION,
                   "PYTHONPATH": sysconfig.get_paths()["purelib"],
                   "XDG_CACHE_HOME": str(folder / "cache"), "UV_PYTHON_DOWNLOADS_JSON_URL": str(downloads)}
    return SshTestHosts(count, environment)


def prove_nothing_left(hosts: SshTestHosts) -> None:
    """The notebook's connections to ``hosts``, and the warm agents on them, end with its pools (other test runs'
    on other hosts are not these tests' to judge)."""
    close_pools()
    deadline = time.monotonic() + 15
    while left := ssh_warm_agents(hosts.environment["XDG_CACHE_HOME"], hosts.config):
        assert time.monotonic() < deadline, f"ssh hosts' warm agents survived their pools: {left}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def lacking(tmp_path_factory, stand_in):
    """Three test hosts whose ``python3`` is 3.10 (h0 and h1 run the jobs; h2 is asked twice at once)."""
    folder = tmp_path_factory.mktemp("hosts-lacking-python")
    with hosts_lacking_python(folder, 3, downloads_list(stand_in.parent, stand_in)) as hosts:
        try:
            yield hosts
        finally:
            prove_nothing_left(hosts)


def pythons_folder(hosts: SshTestHosts, index: int) -> pathlib.Path:
    return pathlib.Path(hosts.environment["XDG_CACHE_HOME"]) / f"host{index}" / PYTHONS_DIR


def installs_on(hosts: SshTestHosts, index: int) -> tuple[int, list[str]]:
    """What shows host ``index``'s installs: its record's mtime (written once per install) and uv's installations."""
    folder = pythons_folder(hosts, index)
    record = folder / f"kinetic-python{NOTEBOOK}.json"
    return record.stat().st_mtime_ns, sorted(path.name for path in folder.glob("cpython-*") if not path.is_symlink())


def on(hosts: SshTestHosts, count: int, **options) -> dict:
    return {"backend": "ssh", "framework": "none", "quiet": True,
            "backend_options": {"ssh_hosts": ",".join(hosts.targets[:count]), "ssh_config": hosts.config, **options}}


def test_a_host_lacking_the_notebooks_python_gets_it_once_a_later_job_reuses_it_and_ssh_python_wins(
        lacking, monkeypatch, capsys):
    monkeypatch.delenv("KINETIC_SSH_PYTHON", raising=False)
    close_pools()
    handle = kinetic_nb.submit(WHICH_PYTHON, **on(lacking, 2))
    # The wait for the install is said before it, in the cell's output (not an error's red).
    assert (f"kinetic_nb: hosts 0-1 run Python 3.10; this notebook's {NOTEBOOK} is used there instead, installed "
            "once per host with uv's managed Pythons (a minute the first time)\n") in capsys.readouterr().out
    base, executable, version = handle.result(timeout=600)
    installed = pythons_folder(lacking, 0)
    assert version == sys.version_info[:2]
    # uv's (its link for the minor version, to the patch release installed), not the python3.X in /usr/bin
    assert base.startswith(f"{installed}/cpython-"), base
    assert os.path.realpath(base).startswith(f"{installed}/cpython-{platform.python_version()}-"), base
    assert "/kinetic_nb/environments/python" in executable
    first = [installs_on(lacking, index) for index in range(2)]
    assert all(len(installations) == 1 for _, installations in first), first  # one install on each host

    close_pools()  # another notebook: connects, probes and bootstraps again
    again = kinetic_nb.submit(WHICH_PYTHON, **on(lacking, 2)).result(timeout=600)
    assert again == (base, executable, version)
    assert [installs_on(lacking, index) for index in range(2)] == first  # found, not installed again

    named = os.path.join(sys.base_prefix, "bin", f"python{NOTEBOOK}")
    third = kinetic_nb.submit(WHICH_PYTHON, **on(lacking, 2, ssh_python=named)).result(timeout=600)
    assert third[0] == sys.base_prefix and third[2] == version  # the one named, as it is
    assert "/kinetic_nb/environments/python" in third[1] and third[1] != executable  # its own environments
    assert [installs_on(lacking, index) for index in range(2)] == first


def test_two_notebooks_at_once_install_once(lacking):
    """Two notebooks open the same host at once: one installs, the other waits for it and finds it."""
    found = []

    def notebook() -> None:
        with Connections([lacking.targets[2]], config=lacking.config) as connections:
            facts = probe_hosts(connections, other_versions=True)
            assert facts[0].python[:2] == (3, 10)
            found.append(install_pythons(connections, facts, [0], sys.version_info[:2])[0])

    threads = [threading.Thread(target=notebook) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert len(found) == 2 and found[0].executable == found[1].executable
    assert sorted(each.installed_now for each in found) == [False, True]


def test_a_python_that_cannot_be_installed_is_one_line_naming_the_host_and_the_way_out(
        tmp_path, stand_in, monkeypatch):
    """uv's downloads list names an archive whose sha256 is not the archive's: uv refuses it, and the cell's
    error says which host, what was tried, what uv said, and what to do."""
    monkeypatch.delenv("KINETIC_SSH_PYTHON", raising=False)
    wrong = downloads_list(stand_in.parent, stand_in, sha256="0" * 64)
    with hosts_lacking_python(tmp_path, 1, wrong) as hosts:
        try:
            with pytest.raises(SshHostError) as caught:
                kinetic_nb.submit("'never'", **on(hosts, 1))
        finally:
            prove_nothing_left(hosts)
    message = str(caught.value)
    assert "\n" not in message, message
    assert re.match(rf"host 0 \(h0\) runs Python {OTHER_PYENV_VERSION} \(/\S+\), not this notebook's {NOTEBOOK}, and "
                    rf"installing {NOTEBOOK} there failed \(uv python install {NOTEBOOK}: ", message), message
    assert f"Hash mismatch for `cpython-{platform.python_version()}-" in message, message  # uv's own reason
    assert message.endswith(f"install python{NOTEBOOK} there and name it with --ssh-python, or let the host reach "
                            "uv's Python downloads (a mirror: UV_PYTHON_INSTALL_MIRROR)"), message


def test_a_tpu_vms_workers_on_the_images_python_get_the_notebooks_and_run_the_cell(lacking, monkeypatch, tmp_path):
    """A TPU VM image's Python is 3.10: the slice's workers (two of the hosts lacking the notebook's Python, as a
    v4-16's) are probed for busy chips, and run the cell, with the Python installed for them."""
    from .tpu_api_double import answering_as_google, tpu_node

    monkeypatch.delenv("KINETIC_SSH_PYTHON", raising=False)
    close_pools()
    nodes = {("ml-team", "us-central2-b", "v4-16"): tpu_node(lacking.addresses[:2], accelerator_type="v4-16")}
    with answering_as_google(monkeypatch, nodes, client_key=lacking.client_key, project="ml-team",
                             known_hosts=str(tmp_path / "google_compute_known_hosts")):
        options = {"backend": "tpu-vm", "framework": "none", "quiet": True,
                   "backend_options": {"tpu": "v4-16", "zone": "us-central2-b", "ssh_config": lacking.config}}
        try:
            handle = kinetic_nb.submit(WHICH_PYTHON, **options)
            base, _, version = handle.result(timeout=600)
        finally:
            close_pools()
    assert handle.plan.hosts == 2 and version == sys.version_info[:2]
    assert base.startswith(f"{pythons_folder(lacking, 0)}/cpython-"), base
