"""Shared fixtures: an isolated storage root, and proof that no job process survives a test."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import time

import psutil
import pytest

from .fixtures_gcs import gcs_emulator, gcs_root, storage_only  # noqa: F401 - the fake-gcs-server fixtures, for every test
from .fixtures_ray import (  # the 4-node Ray cluster, for every test that asks
    gather_the_clusters_tests,
    ray_cluster,  # noqa: F401
    stop_after_the_clusters_last_test,
)

#: Every local job process carries one of these: the supervisor and the hosts
#: it forks share its command line; anything a cell starts inherits the variable.
_JOB_COMMAND = "kinetic_nb.agent"
_JOB_VARIABLE = "KINETIC_JOB_URI"
#: A notebook's warm agent, whose command line every agent and host it forks keeps (``kinetic_nb.agent.warm``).
_WARM_COMMAND = "kinetic_nb.agent.warm"
#: An ssh host's warm agent (``kinetic_nb.backends.ssh.pool``), kept by the notebook between jobs.
_SSH_WARM_COMMAND = "kinetic_nb.agent.warm --stdio"
#: This session's jobs all live below it (another test run's jobs are not ours to judge).
_session_root = ""
#: How long a finished job's supervisor may take to exit after the test.
_SURVIVOR_WAIT_S = 15.0
#: This run's own cache directory, and the XDG_CACHE_HOME it replaced.
_CACHE_KEY = pytest.StashKey[tuple]()


def pytest_configure(config: pytest.Config) -> None:
    """This run's keys, agent records and sockets go to a cache of its own, not the user's
    (``~/.cache/kinetic_nb`` would gather thousands of them); every process a test starts inherits it."""
    cache = tempfile.mkdtemp(prefix="kinetic-test-cache-")
    config.stash[_CACHE_KEY] = (cache, os.environ.get("XDG_CACHE_HOME"))
    os.environ["XDG_CACHE_HOME"] = cache


#: ``make test`` runs the suite in two lanes (pytest-xdist, ``-n 2``), a file's tests in one lane in their order.
#: The second lane: the files whose tests mostly wait on the product's own bounds (a silent host called lost, a
#: cell's timeout, a bucket's outage: about 300 s of a serial run's wall for 60 s of CPU), and, to even the lanes
#: out, the Kubernetes API double's files, the ssh hosts' files whose hosts log in as this user, the large slice,
#: the browser's, the storage contract's and what a cell costs and prints. The main lane keeps the Ray cluster's
#: tests together, and the trust tests' two users with the ssh tests whose hosts log in as users of their own (the
#: two users open and close the folders on the way to this interpreter, which those users must reach). Each lane
#: has its own storage root, cache, fake-gcs-server and ssh hosts; the survivors checks count their own lane's.
SECOND_LANE = frozenset({
    # waiting on the product's bounds
    "agent/test_liveness.py", "faults/test_agent.py", "faults/test_cell_life.py",
    "faults/test_interrupt_timeout.py", "faults/test_lost.py", "faults/test_reattach.py",
    "faults/test_signed_records.py", "faults/test_storage_outage.py", "test_cell_parity.py",
    "test_panel_kernel.py", "test_session_returns.py",
    # the Kubernetes API double
    "backends/test_kubernetes_backend.py", "backends/test_kubernetes_channel.py",
    "backends/test_kubernetes_client_path.py", "backends/test_kubernetes_environment.py",
    "backends/test_kubernetes_golden.py", "backends/test_kubernetes_manifests.py",
    "backends/test_kubernetes_pending.py", "backends/test_kubernetes_scale.py",
    "backends/test_kubernetes_states.py", "backends/test_kubernetes_wire.py",
    # ssh hosts that log in as this user
    "backends/test_host_cache.py", "backends/test_ssh_connections.py", "backends/test_ssh_doctor.py",
    "backends/test_ssh_python.py", "backends/test_tpu_vm_backend.py",
    # the large slice, JupyterLab in Chromium, the storage contract, what a cell costs and prints
    "test_large_slice.py", "test_panel_browser.py", "storage/test_contract.py", "storage/test_cell_cost.py",
    "test_processes_per_host.py", "test_cell_output.py",
})
TESTS_FOLDER = pathlib.Path(__file__).parent


def lane_of(nodeid: str) -> str:
    """The lane a test runs in: ``second`` for a test of :data:`SECOND_LANE`'s files, else ``main``."""
    path = nodeid.split("::")[0]
    return "second" if path.removeprefix(f"{TESTS_FOLDER.name}/") in SECOND_LANE else "main"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Each lane to one worker, its tests in collection order (xdist's scopes, a lane one scope)."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return Lanes(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gather_the_clusters_tests(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    torn_down = yield
    stop_after_the_clusters_last_test(item, nextitem)
    return torn_down


def pytest_unconfigure(config: pytest.Config) -> None:
    cache, before = config.stash.get(_CACHE_KEY, (None, None))
    if cache is None:
        return
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before
    shutil.rmtree(cache, ignore_errors=True)


def job_processes() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if process.pid == os.getpid():
            continue
        try:
            command = " ".join(process.info["cmdline"] or ())
            if _SSH_WARM_COMMAND in command:
                if forked_by_an_ssh_warm_agent(process) and on_this_runs_ssh_hosts(process):
                    found.append(process)  # a job's agent or process on an ssh test host
                continue  # an ssh host's warm agent, or its ssh client: the ssh_hosts fixture proves they end
            if (_JOB_COMMAND in command and _session_root in command) or (
                _session_root in process.environ().get(_JOB_VARIABLE, "\0")
            ) or _forked_by_a_warm_agent(process, command):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def forked_by_an_ssh_warm_agent(process: psutil.Process) -> bool:
    """A process an ssh host's warm agent forked (a job's agent), or one of theirs: they keep its command line,
    and their parent has it too (the warm agent's own parent is the host's sshd)."""
    parent = process.parent()
    return parent is not None and _SSH_WARM_COMMAND in " ".join(parent.cmdline())


def on_this_runs_ssh_hosts(process: psutil.Process) -> bool:
    """Whether ``process`` runs on an ssh test host this test process started: every login on one descends from
    its sshd, which ``tests/ssh_hosts.py`` starts as this process's child. The other lane's hosts are not ours."""
    return any(ancestor.pid == os.getpid() for ancestor in process.parents())


def _forked_by_a_warm_agent(process: psutil.Process, command: str) -> bool:
    """A job's agent or host that a notebook's warm agent forked (of this test run's notebooks): they carry the
    warm agent's command line, and its environment as it started (this run's storage root). The warm agent
    itself is the notebook's, and ends with it: it is the one whose parent is the notebook it names. An ssh host's
    warm agent (``--stdio``) is the host's, and ends with the notebook's connection: this run's storage root is
    in the environment only of what it forked."""
    if _WARM_COMMAND not in command or _session_root not in process.environ().get("KINETIC_STORAGE", "\0"):
        return False
    words = command.split()
    if "--stdio" in words:  # an ssh host's warm agent has the host's login environment; what it forked, the job's
        return True
    notebook = int(words[words.index("--parent") + 1])
    return process.ppid() != notebook


@pytest.fixture(autouse=True, scope="session")
def storage_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    global _session_root
    _session_root = str(tmp_path_factory.getbasetemp())
    root = tmp_path_factory.mktemp("jobs")
    os.environ["KINETIC_STORAGE"] = f"file://{root}"
    # No keras-kinetic profile of this machine's user steers a test's cluster (tests that want one make it).
    os.environ["KINETIC_PROFILES_FILE"] = str(root / "no-kinetic-profiles.json")
    for variable in ("KINETIC_PROJECT", "KINETIC_ZONE", "KINETIC_CLUSTER"):
        os.environ.pop(variable, None)
    return f"file://{root}"


@pytest.fixture(scope="session")
def ssh_hosts(tmp_path_factory):
    """Four real sshd's on loopback addresses (``tests/ssh_hosts``); every login sees the test interpreter's
    packages (jax, torch) on PYTHONPATH, as a machine with them installed would, and a cache of the run's own."""
    import sysconfig

    from .ssh_hosts import SshTestHosts

    cache = tmp_path_factory.mktemp("ssh-hosts-cache")
    environment = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "XDG_CACHE_HOME": str(cache)}
    with SshTestHosts(4, environment) as hosts:
        yield hosts
        # The notebook's connections to the hosts, and the warm agent it keeps on each, end with its pools.
        from kinetic_nb.backends.ssh.pool import close_pools

        close_pools()
        deadline = time.monotonic() + _SURVIVOR_WAIT_S
        while (left := ssh_warm_agents(str(cache), hosts.config)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"ssh hosts' warm agents survived their pools: {left}"


def ssh_warm_agents(cache: str, config: str) -> list[str]:
    """The warm agents running on ssh test hosts in environments under ``cache``, and the ssh clients to them that
    name the hosts' ``config`` (the other lane's hosts are not ours)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        with contextlib.suppress(psutil.Error):
            if (_SSH_WARM_COMMAND in command and (cache in command or f"ssh -F {config} " in command)
                    and not forked_by_an_ssh_warm_agent(process)):
                found.append(f"{process.pid}: {command}")
    return found


@pytest.fixture(autouse=True)
def fresh_gcs_clients():
    """Each test meets gs:// with the clients its own environment makes. kinetic_nb keeps one client per process
    (and emulator), made on first use: one made while another test stood in for Google's credentials (a TPU
    VM's, the doctor's) or had an emulator, by that test or by a thread a test left (a bucket session's cleanup),
    must not serve a test that checks what a user without credentials meets."""
    gcs = sys.modules.get("kinetic_nb.storage.gcs")
    if gcs is not None:
        gcs._clients.clear()
    yield
    gcs = sys.modules.get("kinetic_nb.storage.gcs")
    if gcs is not None:
        gcs._clients.clear()


@pytest.fixture(autouse=True)
def no_process_survives():
    """Fail a test that leaves any job process behind (and clean them up)."""
    yield
    deadline = time.monotonic() + _SURVIVOR_WAIT_S
    survivors = job_processes()
    while survivors and time.monotonic() < deadline:
        time.sleep(0.1)
        survivors = job_processes()
    if survivors:
        described = [f"{p.pid}: {' '.join(p.cmdline())}" for p in survivors if p.is_running()]
        for process in survivors:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        pytest.fail(f"job processes survived the test: {described}")


def notebook(code: str) -> dict:
    """A namespace as a notebook's: what ``code`` defines lives in ``__main__``."""
    namespace: dict = {"__name__": "__main__"}
    exec(code, namespace)
    return namespace
