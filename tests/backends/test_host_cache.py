"""An ssh host's kinetic_nb cache stays bounded, and ``%kinetic gc`` prunes the hosts it can reach.

Against two real ``sshd``'s of this module's own (``tests/ssh_hosts``), each host a cache folder of its own: a
job that makes a new environment removes the oldest of its interpreter's beyond the newest few that no process
uses (an environment a process runs stays, however old) and old agent logs; ``gc`` runs the same pruning on the
hosts of the ssh jobs it removes, with their agent logs, and a host it cannot reach is one line of its report.
The environments beyond the real ones are folders made here, with the times of use the test gives them.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import subprocess
import time

import pytest

import kinetic_nb
from kinetic_nb.agent.bootstrap import IN_USE, KEEP_ENVIRONMENTS
from kinetic_nb.backends.ssh.host_cache import CachedHost, prune_hosts
from kinetic_nb.backends.ssh.pool import ENVIRONMENTS_DIR, close_pools
from kinetic_nb.client import catalog

from ..ssh_hosts import NOBODY, SshTestHosts
from .conftest import python_of_the_hosts

DAY = 86400.0


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two test hosts with a cache folder each (``host0``, ``host1``) under one of this module's own."""
    import sysconfig

    cache = tmp_path_factory.mktemp("host-cache")
    environment = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "XDG_CACHE_HOME": str(cache)}
    with SshTestHosts(2, environment) as started:
        try:
            yield started
        finally:
            close_pools()


def cache_of(hosts: SshTestHosts, index: int) -> pathlib.Path:
    return pathlib.Path(hosts.environment["XDG_CACHE_HOME"]) / f"host{index}" / "kinetic_nb"


def on(hosts: SshTestHosts, index: int, storage: str, *, config: str | None = None, **options) -> dict:
    return {"backend": "ssh", "framework": "none", "quiet": True, "storage": storage,
            "backend_options": {"ssh_hosts": hosts.targets[index], "ssh_config": config or hosts.config,
                                "ssh_python": python_of_the_hosts(), **options}}


def environments_of(hosts: SshTestHosts, index: int) -> pathlib.Path:
    """The one interpreter's environments folder host ``index`` has (the hosts' Python's)."""
    (folder,) = (cache_of(hosts, index) / "environments").iterdir()
    assert f"kinetic_nb/environments/{folder.name}" == f"{ENVIRONMENTS_DIR}/{folder.name}"
    return folder


def environments(folder: pathlib.Path) -> set[str]:
    return {path.name for path in folder.iterdir() if path.is_dir()}


def made_environment(folder: pathlib.Path, name: str, last_used_days_ago: float) -> str:
    """A folder shaped like an environment (a venv with 1 MB in it, its records), last used that many days ago."""
    (folder / name / "venv" / "bin").mkdir(parents=True)
    (folder / name / "venv" / "bin" / "payload").write_bytes(b"\0" * 1_000_000)
    (folder / name / "record.json").write_text('{"ok": true}')
    (folder / name / IN_USE).touch()
    used_last(folder / name, last_used_days_ago)
    return name


def used_last(environment: pathlib.Path, days_ago: float) -> None:
    when = time.time() - days_ago * DAY
    os.utime(environment / IN_USE, (when, when))


def agent_log(cache: pathlib.Path, name: str, days_ago: float) -> pathlib.Path:
    path = cache / "agents" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("what an agent said\n")
    when = time.time() - days_ago * DAY
    os.utime(path, (when, when))
    return path


def locked_by_a_process(environment: pathlib.Path) -> bool:
    with open(environment / IN_USE) as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(file, fcntl.LOCK_UN)
        return False


@pytest.fixture
def running_from():
    """Start a process on an environment's own Python, as a warm agent or a job's agent runs; ended after."""
    started = []

    def start(environment: pathlib.Path) -> subprocess.Popen:
        process = subprocess.Popen([str(environment / "venv" / "bin" / "python"), "-c",
                                    "import sys; print('started', flush=True); sys.stdin.read()"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        started.append(process)
        # Its start (the environment's hook, before any code) holds the in-use lock and marks the environment used
        # now: the test's own time of use comes after that mark, not between the lock and it.
        assert process.stdout.readline() == b"started\n", "the process never started"
        assert locked_by_a_process(environment), "the process does not hold its environment"
        return process

    yield start
    for process in started:
        process.stdin.close()
        process.wait(timeout=30)
        process.stdout.close()


def test_a_new_environment_removes_the_oldest_unused_ones_and_old_logs_and_the_one_in_use_stays(
        hosts, running_from, tmp_path):
    storage = f"file://{tmp_path / 'jobs'}"
    assert kinetic_nb.submit("'first'", **on(hosts, 0, storage)).result(timeout=600) == "first"
    close_pools()  # its warm agent ends: what uses the environment from now on is the process started here
    folder = environments_of(hosts, 0)
    (first,) = environments(folder)
    running_from(folder / first)
    used_last(folder / first, 10)  # the oldest of all, but in use
    oldest = made_environment(folder, "00000000000000f1", 5)
    kept = {made_environment(folder, "00000000000000f2", 4), made_environment(folder, "00000000000000f3", 3)}
    old_log = agent_log(cache_of(hosts, 0), "kn-20200101-000000-0a0a0a-0.log", 30)
    new_log = agent_log(cache_of(hosts, 0), "kn-20200101-000000-0b0b0b-0.log", 1)
    assert len(environments(folder)) == KEEP_ENVIRONMENTS + 1  # the next job's new one makes N + 2

    requirements = tmp_path / "requirements.txt"  # another environment's content: installed from what is here
    requirements.write_text("--no-index\ncloudpickle\n")
    assert kinetic_nb.submit("'second'", **on(hosts, 0, storage, requirements=str(requirements))).result(
        timeout=600) == "second"
    (made,) = environments(folder) - kept - {first, oldest}
    assert environments(folder) == {first, made, *kept}  # the oldest unused one went; the one in use stayed
    assert not old_log.exists() and new_log.exists()

    close_pools()  # no warm agent: the kept environment, whole, runs the next job through the bootstrap
    assert kinetic_nb.submit("'again'", **on(hosts, 0, storage)).result(timeout=600) == "again"
    assert environments(folder) == {first, made, *kept}  # found, not installed again


def test_gc_prunes_the_hosts_of_the_ssh_jobs_it_removes_and_an_unreachable_one_is_a_line(hosts, tmp_path):
    storage = f"file://{tmp_path / 'jobs'}"
    reached = kinetic_nb.submit("'reached'", **on(hosts, 1, storage))
    assert reached.result(timeout=600) == "reached"
    gone_config = tmp_path / "ssh_config"  # host 0 as a job reached it, later gone
    gone_config.write_text(pathlib.Path(hosts.config).read_text())
    gone = kinetic_nb.submit("'gone later'", **on(hosts, 0, storage, config=str(gone_config)))
    assert gone.result(timeout=600) == "gone later"
    gone_config.write_text(gone_config.read_text().replace(f"HostName {hosts.addresses[0]}\n",
                                                           f"HostName {NOBODY}\n", 1))
    close_pools()
    folder = environments_of(hosts, 1)
    (real,) = environments(folder)
    used_last(folder / real, 0)
    stale = {made_environment(folder, f"00000000000000e{index}", 20 + index) for index in range(3)}
    cache = cache_of(hosts, 1)
    job_log = cache / "agents" / f"{reached.job_id}-0.log"
    assert job_log.exists()
    other_log = agent_log(cache, "kn-20200101-000000-0c0c0c-0.log", 1)

    report = catalog.gc_report(0, storage=storage)

    assert {job_id for job_id, _ in report.removed} == {reached.job_id, gone.job_id}
    assert len(report.hosts) == 2, report.hosts
    assert "h1: removed 1 environment (1.0 MB) and 1 agent log from its kinetic_nb cache" in report.hosts
    (skipped,) = [line for line in report.hosts if line.startswith("h0")]
    assert skipped.startswith("h0 cannot be reached: ") and skipped.endswith(
        "; skipped, its kinetic_nb cache was left as it is"), skipped
    assert "\n" not in skipped
    assert environments(folder) == {real} | (stale - {"00000000000000e2"})  # the newest 3 by last use
    assert not job_log.exists() and other_log.exists()


def test_a_host_whose_python_cannot_prune_is_a_line(hosts):
    (line,) = prune_hosts({CachedHost(hosts.targets[0], hosts.config, python="/nonexistent/python3"): []})
    assert line.startswith("h0: skipped, /nonexistent/python3 could not prune its kinetic_nb cache ("), line


def test_an_environment_from_before_in_use_locks_is_kept_while_a_process_runs_it(tmp_path):
    """Made by an earlier kinetic_nb (no in-use file, no hook): a process whose program or ``VIRTUAL_ENV`` is its
    venv keeps it; the same environment with none goes."""
    from kinetic_nb.agent.bootstrap import prune_environments

    folder = tmp_path / "python3.11-0123456789ab"
    for index, name in enumerate(("00000000000000a0", "00000000000000a1", "00000000000000a2", "00000000000000a3")):
        made_environment(folder, name, index)
    for name in ("00000000000000b0", "00000000000000b1"):  # the oldest two, from before in-use locks
        made_environment(folder, name, 30)
        (folder / name / IN_USE).unlink()
        os.utime(folder / name / "record.json", (time.time() - 30 * DAY,) * 2)  # its last use, as then
    venv = folder / "00000000000000b0" / "venv"
    runs = subprocess.Popen(["sleep", "60"], env={**os.environ, "VIRTUAL_ENV": str(venv)})
    try:
        assert prune_environments(str(folder), KEEP_ENVIRONMENTS) == (2, 2_000_024)
    finally:
        runs.kill()
        runs.wait()
    assert environments(folder) == {"00000000000000a0", "00000000000000a1", "00000000000000a2", "00000000000000b0"}


def test_gc_reaches_a_tpu_vms_workers_as_its_jobs_did_and_a_deleted_tpu_is_a_line(hosts, monkeypatch, tmp_path):
    """A TPU VM's workers are named by the Cloud TPU API (a double whose v4-16 has the test hosts as its two
    workers) and reached with gcloud's key, as its jobs reached them; a TPU deleted since is one line."""
    import re

    from kinetic_nb.backends.ssh.host_cache import prune_hosts_of_jobs

    from .tpu_api_double import answering_as_google, tpu_node

    folder = cache_of(hosts, 1) / "environments" / "python3.0-000000000000"  # another interpreter's, also pruned
    for index in range(KEEP_ENVIRONMENTS + 1):
        made_environment(folder, f"00000000000000c{index}", 40 + index)
    nodes = {("ml-team", "us-central2-b", "v4-16"): tpu_node(hosts.addresses, accelerator_type="v4-16")}
    with answering_as_google(monkeypatch, nodes, client_key=hosts.client_key, project="ml-team",
                             known_hosts=str(tmp_path / "google_compute_known_hosts")):
        common = {"zone": "us-central2-b", "ssh_config": hosts.config, "ssh_python": python_of_the_hosts()}
        lines = prune_hosts_of_jobs([("kn-20200101-000000-0d0d0d", "tpu-vm", {"tpu": "v4-16", **common}),
                                     ("kn-20200101-000000-0e0e0e", "tpu-vm", {"tpu": "v4-16", **common}),
                                     ("kn-20200101-000000-0f0f0f", "tpu-vm", {"tpu": "deleted", **common})])
    assert len(lines) == 3, lines  # each worker once, however many of its jobs were removed
    assert re.fullmatch(rf"{re.escape(hosts.addresses[0])}: removed \d+ environments? \(\d+\.\d MB\) and \d+ agent "
                        r"logs? from its kinetic_nb cache", lines[0]), lines
    assert lines[1] == f"{hosts.addresses[1]}: removed 1 environment (1.0 MB) and 0 agent logs from its kinetic_nb cache"
    assert lines[2].startswith("-b tpu-vm (tpu deleted, zone us-central2-b): its hosts could not be named (there is "
                               "no TPU VM deleted in project ml-team"), lines
    assert lines[2].endswith("; their caches were left as they are"), lines
    assert environments(folder) == {f"00000000000000c{index}" for index in range(KEEP_ENVIRONMENTS)}
