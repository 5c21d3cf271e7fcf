"""``-b ssh`` end to end, against four real ``sshd`` processes on loopback addresses (``tests/ssh_hosts``).

Each host's environment is installed by the bootstrap from the job's signed wheel, once per content, and the
same agent and runner as every backend run there, detached from the ssh session; later jobs' agents are forked
by a warm agent on each host. The hosts see the test interpreter's packages (jax, torch) on ``PYTHONPATH``, as
machines with them installed would, each with a cache of its own; one test gives each host a user, a home and a
virtual environment of its own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import psutil
import pytest

import kinetic_nb
from kinetic_nb.backends.ssh.pool import close_pools, pool_for
from kinetic_nb.errors import SshHostError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.wakeup import WOKEN_HOSTS_ENV

from ..conftest import forked_by_an_ssh_warm_agent, on_this_runs_ssh_hosts
from ..ddp_check import DDP_TRAIN, flat, full_batch_parameters
from ..serving import serve_in_background
from .conftest import python_of_the_hosts, ssh_options


def on_ssh(ssh_hosts, hosts: int = 4) -> dict:
    return {"backend": "ssh", "backend_options": ssh_options(ssh_hosts, hosts)}


def test_a_cell_runs_on_every_host_and_the_leader_owns_the_value(ssh_hosts):
    source = "import os\nprint('hello from host', os.environ['KINETIC_HOST_INDEX'])\nos.environ['SSH_CONNECTION'] if False else 'leader value'"
    handle = kinetic_nb.submit(source, quiet=True, **on_ssh(ssh_hosts))
    assert handle.plan.hosts == 4
    assert handle.result(timeout=300) == "leader value"
    for index in range(4):
        assert f"hello from host {index}" in handle.logs(index)
    assert [host.state for host in handle.hosts()] == ["succeeded"] * 4


def test_jax_hosts_allgather_across_the_ssh_hosts(ssh_hosts):
    source = ("import jax, jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
              "total = multihost_utils.process_allgather(jnp.ones(2) * jax.process_index()).sum()\n"
              "(jax.process_count(), float(total))")
    handle = kinetic_nb.submit(source, framework="jax", quiet=True, env={"JAX_PLATFORMS": "cpu"}, **on_ssh(ssh_hosts))
    assert handle.result(timeout=300) == (4, 12.0)


def test_torch_ddp_across_the_ssh_hosts_agrees_with_one_process(ssh_hosts):
    """Data-parallel SGD on 4 shards, one a host (gloo over the hosts' addresses), ends where full-batch SGD in
    one process does."""
    handle = kinetic_nb.submit(DDP_TRAIN, framework="torch", quiet=True, **on_ssh(ssh_hosts))
    world, distributed = handle.result(timeout=300)
    assert world == 4
    assert flat(distributed) == pytest.approx(flat(full_batch_parameters()), abs=1e-6)


def test_a_workers_own_failure_is_raised_with_its_host(ssh_hosts):
    source = "import os\nif os.environ['KINETIC_HOST_INDEX'] == '2':\n    raise KeyError('host two')\n'fine'"
    handle = kinetic_nb.submit(source, framework="none", quiet=True, grace=1, **on_ssh(ssh_hosts))
    with pytest.raises(KeyError, match="host two") as caught:
        handle.result(timeout=300)
    assert any(note.startswith("Reported by host 2 of job ") for note in caught.value.__notes__)
    handle.wait(timeout=60)


def test_hosts_that_do_not_match_the_cell_are_one_line(ssh_hosts):
    with pytest.raises(ValueError, match=r"^2 hosts do not match the 4 that --ssh-hosts names$"):
        kinetic_nb.submit("1", hosts=2, quiet=True, **on_ssh(ssh_hosts))


def test_an_unreachable_host_fails_before_anything_is_stored(ssh_hosts, storage_root):
    options = on_ssh(ssh_hosts)
    options["backend_options"]["ssh_hosts"] = "h0,nobody"
    with pytest.raises(SshHostError, match=r"^host 1 \(nobody\) cannot be reached"):
        kinetic_nb.submit("1", quiet=True, **options)


def agent_processes(ssh_hosts, job_id: str, host: int) -> list:
    """Host ``host``'s agent and the processes it started: forked by the host's warm agent (the test hosts are
    this machine's processes), or started by the bootstrap, with the job's and the host's variables."""
    import psutil

    warm = pool_of(ssh_hosts).warm
    if warm and warm[host].remote_pid is not None:
        return psutil.Process(warm[host].remote_pid).children(recursive=True)
    found = []
    for process in psutil.process_iter():
        try:
            environment = process.environ()
            if job_id in environment.get("KINETIC_JOB_URI", "") and environment.get("KINETIC_HOST_INDEX") == str(host):
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def pool_of(ssh_hosts, hosts: int = 4):
    """The notebook's open connections to the first ``hosts`` test hosts, and the warm agents it keeps there."""
    options = ssh_options(ssh_hosts, hosts)
    return pool_for(options["ssh_hosts"].split(","), config=options["ssh_config"], python=options["ssh_python"])


def test_a_dropped_connection_does_not_end_the_cell_and_the_next_job_connects_again(ssh_hosts):
    source = "import time\ntime.sleep(3)\n'finished without its ssh connections'"
    handle = kinetic_nb.submit(source, framework="none", quiet=True, **on_ssh(ssh_hosts))
    connections = pool_of(ssh_hosts).connections
    connections.close()  # every control master ends: the sessions that started the agents are gone
    assert not any(connections.master_alive(index) for index in range(4))
    assert handle.result(timeout=120) == "finished without its ssh connections"
    assert kinetic_nb.submit("'again'", framework="none", quiet=True, **on_ssh(ssh_hosts)).result(timeout=120) == "again"


#: What a cell on a host says of its agent: the command line of its runner's parent.
AGENT_COMMAND = "open(f'/proc/{__import__(\"os\").getppid()}/cmdline').read().replace(chr(0), ' ')"


def test_a_later_job_is_forked_by_each_hosts_warm_agent_over_the_open_connections(ssh_hosts):
    kinetic_nb.submit("1", framework="none", quiet=True, **on_ssh(ssh_hosts)).result(timeout=300)
    kinetic_nb.submit("2", framework="none", quiet=True, **on_ssh(ssh_hosts)).result(timeout=300)  # the warm agents ready
    logins = [ssh_hosts.accepted(index) for index in range(4)]
    handle = kinetic_nb.submit(f"import os\nprint('agent:', {AGENT_COMMAND})\n{AGENT_COMMAND}", framework="none",
                               quiet=True, **on_ssh(ssh_hosts))
    assert "kinetic_nb.agent.warm --stdio" in handle.result(timeout=120)  # forked, past its imports
    for index in range(4):
        assert "agent: " in handle.logs(index) and "warm --stdio" in handle.logs(index)
    assert [ssh_hosts.accepted(index) for index in range(4)] == logins  # no new login on any host
    warm = pool_of(ssh_hosts).warm
    assert len(warm) == 4 and all(agent.alive() for agent in warm)


@pytest.fixture(scope="module")
def requirement_index(tmp_path_factory):
    """A package index on loopback (the hosts read requirements from the network, never this machine's disk)
    holding one package, kinetic_probe_requirement."""
    import functools
    import http.server

    from .test_kubernetes_environment import _wheel

    directory = tmp_path_factory.mktemp("index")
    _wheel(directory, "kinetic_probe_requirement", "1.0",
           {"kinetic_probe_requirement.py": b"INSTALLED_BY = 'the requirements file'\n"})
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    serve_in_background(server, "package-index")
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_requirements_are_installed_on_every_host_and_their_environment_gets_its_own_warm_agents(
        ssh_hosts, requirement_index, tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"--no-index\n--find-links {requirement_index}\nkinetic_probe_requirement\n")
    options = on_ssh(ssh_hosts)
    options["backend_options"]["requirements"] = str(requirements)
    source = "import kinetic_probe_requirement, sys\n(kinetic_probe_requirement.INSTALLED_BY, sys.prefix)"
    handle = kinetic_nb.submit(source, framework="none", quiet=True, **options)
    installed_by, prefix = handle.result(timeout=600)
    assert installed_by == "the requirements file" and "kinetic_nb/environments/" in prefix
    digest = pool_of(ssh_hosts).warm[0].digest
    assert prefix.endswith(f"{digest[:16]}/venv")  # the warm agents are this environment's now
    again = kinetic_nb.submit(f"{source}[1], {AGENT_COMMAND}", framework="none", quiet=True, **options)
    assert again.result(timeout=120)[0] == prefix
    # Without the requirements, the hosts' environment is another one: never the one with the requirement.
    plain = kinetic_nb.submit("import sys\nsys.prefix", framework="none", quiet=True, **on_ssh(ssh_hosts))
    assert plain.result(timeout=300) != prefix


def test_a_requirement_only_this_machine_has_is_one_line_before_anything_is_stored(ssh_hosts, tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("./my-package\n")
    options = on_ssh(ssh_hosts)
    options["backend_options"]["requirements"] = str(requirements)
    with pytest.raises(ValueError, match=r"requirements.txt, line 1: '\./my-package' is a path on this machine, "
                                         r"which the hosts do not have"):
        kinetic_nb.submit("1", framework="none", quiet=True, **options)


def test_a_failed_install_says_pips_own_reason_in_the_cells_error(ssh_hosts, requirement_index, tmp_path):
    """pip's output went nowhere the cell shows: the error carries pip's own last error lines, not a pointer."""
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"--no-index\n--find-links {requirement_index}\nkinetic-no-such-package\n")
    options = on_ssh(ssh_hosts, 2)
    options["backend_options"]["requirements"] = str(requirements)
    with pytest.raises(SshHostError) as caught:
        kinetic_nb.submit("'never'", framework="none", quiet=True, **options)
    message = str(caught.value)
    assert message.startswith("host 0 (h0): its agent did not start: kinetic_nb: environment install failed: "), message
    assert "ERROR: No matching distribution found for kinetic-no-such-package" in message, message
    assert "above" not in message and "\n" not in message, message


def test_another_ssh_python_gets_an_environment_of_its_own(ssh_hosts, tmp_path):
    """Two jobs installing the same wheel and requirements with another --ssh-python each: the second runs in an
    environment made from its own interpreter (a virtual environment with a package only it has), never in the
    one the first interpreter made."""
    other = tmp_path / "other-python"
    subprocess.run([python_of_the_hosts(), "-m", "venv", "--without-pip", str(other)], check=True)
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (other / "lib" / version / "site-packages" / "kinetic_only_in_the_other_python.py").write_text(
        "WHERE = 'the other python'\n")
    first = kinetic_nb.submit("import sys\nsys.prefix", framework="none", quiet=True, **on_ssh(ssh_hosts, 2))
    first_prefix = first.result(timeout=300)
    options = on_ssh(ssh_hosts, 2)
    options["backend_options"]["ssh_python"] = str(other / "bin" / "python")
    source = "import sys, kinetic_only_in_the_other_python as mine\n(mine.WHERE, sys.prefix)"
    where, prefix = kinetic_nb.submit(source, framework="none", quiet=True, **options).result(timeout=300)
    assert where == "the other python" and prefix != first_prefix
    # Each interpreter's environment is kept: the first Python's next job finds its own again.
    again = kinetic_nb.submit("import sys\nsys.prefix", framework="none", quiet=True, **on_ssh(ssh_hosts, 2))
    assert again.result(timeout=300) == first_prefix


def test_a_host_whose_agent_and_processes_are_killed_is_lost(ssh_hosts):
    import signal

    import kinetic_nb.errors

    source = "import time\nprint('working', flush=True)\ntime.sleep(600)"
    handle = kinetic_nb.submit(source, framework="none", quiet=True, grace=1, **on_ssh(ssh_hosts))
    deadline = __import__("time").monotonic() + 120
    while not all(host.last_line == "working" for host in handle.hosts()):
        assert __import__("time").monotonic() < deadline, "the hosts did not start"
        __import__("time").sleep(0.1)
    victims = agent_processes(ssh_hosts, handle.job_id, 3)
    assert len(victims) >= 2  # the agent and its runner
    for process in victims:
        process.send_signal(signal.SIGKILL)  # the machine is gone: no exit record will come
    with pytest.raises(kinetic_nb.errors.JobFailedError, match="host 3 was lost"):
        handle.result(timeout=120)
    handle.wait(timeout=60)  # the others are stopped by their agents after the grace


def test_the_survivors_check_counts_what_a_warm_agent_forked_on_this_runs_hosts_only(ssh_hosts):
    """``tests/conftest.py`` fails a test that leaves a job's process behind: on an ssh host, what the host's warm
    agent forked, on the hosts this test process started (a second lane's hosts run another test's jobs)."""
    kinetic_nb.submit("1", framework="none", quiet=True, **on_ssh(ssh_hosts)).result(timeout=300)  # the warm agents
    handle = kinetic_nb.submit("import time\nprint('working', flush=True)\ntime.sleep(600)", framework="none",
                               quiet=True, **on_ssh(ssh_hosts))
    deadline = time.monotonic() + 120
    while not all(host.last_line == "working" for host in handle.hosts()):
        assert time.monotonic() < deadline, "the hosts did not start"
        time.sleep(0.1)
    forked = [process for host in range(4) for process in agent_processes(ssh_hosts, handle.job_id, host)
              if forked_by_an_ssh_warm_agent(process)]
    assert len(forked) >= 4  # each host's job agent, and the processes it started
    assert all(on_this_runs_ssh_hosts(process) for process in forked)
    assert not on_this_runs_ssh_hosts(psutil.Process(os.getppid()))  # what started this test run is not on a host
    handle.cancel()
    handle.wait(timeout=60)


def test_a_session_runs_its_cells_on_the_ssh_hosts(ssh_hosts):
    session = kinetic_nb.start(framework="none", echo=False, idle_timeout=600, **on_ssh(ssh_hosts))
    try:
        assert session.plan.hosts == 4
        session.run("import os\nmine = int(os.environ['KINETIC_HOST_INDEX'])").result(timeout=120)
        assert session.run("mine + 40").result(timeout=120) == 40
        with pytest.raises(ValueError, match="host 1 says no"):
            session.run("if mine == 1:\n    raise ValueError('host 1 says no')").result(timeout=120)
        assert session.run("mine").result(timeout=120) == 0  # the session stayed up
        # On a disk it shares with its hosts, whose sockets it cannot reach (they are another machine's), neither
        # side sleeps on a socket the other never wakes: each looks at storage at its own pace (2-3 s per trivial
        # cell when the hosts waited on their sockets for a second between looks).
        assert session.storage.local_path() is not None and not session.group.woken
        assert session.run(f"os.environ.get({WOKEN_HOSTS_ENV!r})").result(timeout=120) is None
    finally:
        session.stop()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                    reason="a user of its own per test host is made with useradd, which needs root (CI runs as root)")
def test_hosts_of_users_of_their_own_install_and_run_in_their_own_homes(gcs_root):
    """Each host a user of its own with its own home and Python, a venv there with the packages (jax, torch)
    installed, the job on gs:// storage: every host installs the environment in its own home, sees its venv's
    packages there, runs as its user, and leaves nothing."""
    import psutil

    from ..ssh_hosts import SshTestHosts

    source = ("import os, pwd, sys\n"
              "me = pwd.getpwuid(os.getuid()).pw_name\n"
              "import jax, torch  # the host's own venv's, seen from the environment kinetic_nb keeps\n"
              "print('host', os.environ['KINETIC_HOST_INDEX'], 'runs as', me, 'in', sys.prefix, flush=True)\n"
              "(me, sys.prefix)")
    with SshTestHosts(2, users=True) as hosts:
        options = {"backend": "ssh", "storage": gcs_root, "framework": "none", "quiet": True,
                   "backend_options": {"ssh_hosts": ",".join(hosts.targets), "ssh_config": hosts.config,
                                       "ssh_python": "venv/bin/python"}}
        try:
            handle = kinetic_nb.submit(source, **options)
            user, prefix = handle.result(timeout=600)
            environments = hosts.homes[0] / ".cache" / "kinetic_nb" / "environments"
            interpreter, content = prefix.removesuffix("/venv").rsplit("/", 2)[-2:]
            assert user == hosts.users[0] and prefix == f"{environments}/{interpreter}/{content}/venv"
            for index in range(2):  # each in its own home's environment (its own venv's), as its own user
                said = [line for line in handle.logs(index).splitlines() if line.startswith("host ")]
                theirs = re.fullmatch(rf"host {index} runs as {hosts.users[index]} in {hosts.homes[index]}/\.cache/"
                                      rf"kinetic_nb/environments/(python[0-9.]+-[0-9a-f]+)/{content}/venv", said[0])
                assert len(said) == 1 and theirs, said
                assert (theirs.group(1) == interpreter) == (index == 0)  # another venv: another interpreter's folder
            again = kinetic_nb.submit(f"{source}[0], {AGENT_COMMAND}", **options).result(timeout=120)
            assert again == (hosts.users[0], again[1]) and "kinetic_nb.agent.warm --stdio" in again[1]  # forked warm
        finally:
            close_pools()
        deadline = time.monotonic() + 15
        while left := [p.pid for p in psutil.process_iter(["username"]) if p.info["username"] in hosts.users]:
            assert time.monotonic() < deadline, f"processes of the hosts' users survived: {left}"
            time.sleep(0.1)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                    reason="a user of its own per test host is made with useradd, which needs root (CI runs as root)")
def test_a_file_root_a_host_sees_but_its_user_cannot_enter_is_said_so(storage_root):
    """The job's file:// root is there on the host (the same machine) but under a folder closed to the host's
    user: the cell's error names the user and the folder it cannot enter, not "does not see"."""
    from ..ssh_hosts import SshTestHosts

    root = storage_root.removeprefix("file://")
    with SshTestHosts(1, users=True) as hosts:
        options = {"backend": "ssh", "framework": "none", "quiet": True,
                   "backend_options": {"ssh_hosts": ",".join(hosts.targets), "ssh_config": hosts.config,
                                       "ssh_python": "venv/bin/python"}}
        try:
            with pytest.raises(SshHostError) as caught:
                kinetic_nb.submit("'never'", **options)
        finally:
            close_pools()
        user = hosts.users[0]
    message = str(caught.value)
    said = re.match(rf"^host 0 \(h0\) sees the job storage {re.escape(root)}/kn-\S+, but its user {user} cannot "
                    rf"enter (\S+) \(", message)
    assert said, message
    closed = said.group(1)
    assert root.startswith(closed) and not os.stat(closed).st_mode & 0o001, message
    assert "does not see" not in message and "\n" not in message


def test_a_launch_that_fails_on_one_host_stops_the_hosts_that_started_at_once(ssh_hosts, storage_root):
    """Host 2 cannot keep an environment (a file where its folder goes): the cell fails in one line naming it, and
    the agents that did start on the others stop on the cancel record at once, not at their start barrier's
    timeout (the check that no job process outlives the test holds them to it)."""
    import pathlib

    close_pools()  # no warm agent: every host starts the bootstrap's way
    environments = pathlib.Path(ssh_hosts.environment["XDG_CACHE_HOME"]) / "host2" / "kinetic_nb" / "environments"
    aside = environments.with_name("environments.aside")
    if environments.exists():
        environments.rename(aside)
    environments.parent.mkdir(parents=True, exist_ok=True)
    environments.write_text("not a folder")
    try:
        with pytest.raises(SshHostError, match=r"^host 2 \(h2\): its agent did not start: kinetic_nb: environment "
                                               r"install failed: \[Errno 20\] Not a directory: ") as caught:
            kinetic_nb.submit("'never'", framework="none", quiet=True, **on_ssh(ssh_hosts))
        assert "\n" not in str(caught.value)
    finally:
        environments.unlink()
        if aside.exists():
            aside.rename(environments)
    root = pathlib.Path(storage_root.removeprefix("file://"))
    job = max(root.glob("kn-*"), key=lambda path: path.stat().st_mtime)
    assert (job / protocol.CANCEL).exists()  # what the agents that started obeyed


def warm_agents_now(ssh_hosts) -> set[str]:
    """The warm agents on the test hosts and their ssh clients, and the control masters to the hosts."""
    import psutil

    from ..conftest import ssh_warm_agents

    masters = set()
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or ())
        if "ControlMaster=yes" in command and ssh_hosts.config in command:
            masters.add(f"{process.pid}: {command}")
    return set(ssh_warm_agents(ssh_hosts.environment["XDG_CACHE_HOME"], ssh_hosts.config)) | masters


def test_a_pools_later_jobs_resolve_no_address_and_start_no_timer(ssh_hosts, monkeypatch):
    from kinetic_nb.backends.ssh import backend as ssh_backend

    close_pools()
    resolved = []
    real = ssh_backend.ssh_address
    monkeypatch.setattr(ssh_backend, "ssh_address", lambda *args: resolved.append(args) or real(*args))
    kinetic_nb.submit("1", framework="none", quiet=True, **on_ssh(ssh_hosts, 2)).result(timeout=300)
    timer = pool_of(ssh_hosts, 2)._timer
    for _ in range(2):
        kinetic_nb.submit("1", framework="none", quiet=True, **on_ssh(ssh_hosts, 2)).result(timeout=300)
    assert len(resolved) == 1  # ssh -G once for the pool, not once a job
    assert pool_of(ssh_hosts, 2)._timer is timer  # its idle close looks again when it fires


def test_a_hosts_warm_agent_has_the_cipher_for_the_folder_it_ships_loaded_while_it_waits(ssh_hosts):
    kinetic_nb.submit("1", framework="none", quiet=True, **on_ssh(ssh_hosts, 2)).result(timeout=300)
    agents = [agent for agent in pool_of(ssh_hosts, 2).warm if agent.wait_ready(60)]
    pids = [agent.remote_pid for agent in agents]
    assert len(pids) == 2 and all(pids)
    deadline = time.monotonic() + 30
    while not all(any("cryptography" in mapped.path for mapped in psutil.Process(pid).memory_maps())
                  for pid in pids):
        assert time.monotonic() < deadline, "a warm agent never loaded the cipher"
        time.sleep(0.1)


def test_an_idle_pool_closes_and_its_warm_agents_end(ssh_hosts, monkeypatch):
    from kinetic_nb.backends.ssh import pool as pools

    close_pools()
    before = warm_agents_now(ssh_hosts)
    monkeypatch.setattr(pools, "IDLE_CLOSE_S", 2.0)
    for _ in range(2):  # the second finds the warm agents the first started
        kinetic_nb.submit("1", framework="none", quiet=True, **on_ssh(ssh_hosts, 2)).result(timeout=300)
    held = pool_of(ssh_hosts, 2)
    assert held.warm and not held.closed
    deadline = time.monotonic() + 30
    while not held.closed or warm_agents_now(ssh_hosts) - before:
        assert time.monotonic() < deadline, "an idle pool stayed open, or its warm agents ran on"
        time.sleep(0.1)
    assert not any(held.connections.master_alive(index) for index in range(2))


def test_a_notebook_that_exits_leaves_no_warm_agent_or_connection_behind(ssh_hosts, tmp_path):
    import json
    import subprocess
    import sys

    before = warm_agents_now(ssh_hosts)
    notebook = ("import json, sys, kinetic_nb\n"
                "options = json.loads(sys.argv[1])\n"
                "for _ in range(2):\n"
                "    print(kinetic_nb.submit('6 * 7', framework='none', quiet=True, backend='ssh',\n"
                "                            backend_options=options).result(timeout=300))\n")
    done = subprocess.run([sys.executable, "-c", notebook, json.dumps(ssh_options(ssh_hosts, 2))],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["42", "42"]
    deadline = time.monotonic() + 15
    while left := warm_agents_now(ssh_hosts) - before:
        assert time.monotonic() < deadline, f"the exited notebook's warm agents or connections ran on: {left}"
        time.sleep(0.1)


def test_the_probed_ports_lie_below_the_ephemeral_range_where_no_connection_is_given_one(ssh_hosts):
    close_pools()  # a fresh pool: its opening probe's ports are the next job's
    ports = pool_of(ssh_hosts, 2).facts[0].ports
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
        ephemeral_low = int(ranges.read().split()[0])
    assert len(set(ports)) == 2 and all(ephemeral_low // 2 <= port < ephemeral_low for port in ports), ports


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_coordinator_port_taken_between_probe_and_use_fails_the_cell_in_one_line(ssh_hosts, framework):
    """Another process binds host 0's probed coordinator port before the job's framework does: the cell fails
    at once, in one line naming the port, never a segmentation fault or a wait in a collective."""
    import subprocess
    import sys

    close_pools()
    port = pool_of(ssh_hosts, 2).facts[0].ports[0]  # the port the next launch gives the coordinator
    holder = subprocess.Popen([sys.executable, "-c", "import socket, sys, time\ns = socket.socket()\n"
                               f"s.bind(('', {port}))\ns.listen()\nprint('held', flush=True)\ntime.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        handle = kinetic_nb.submit("'never runs'", framework=framework, quiet=True, grace=2,
                                   env={"JAX_PLATFORMS": "cpu"}, **on_ssh(ssh_hosts, 2))
        assert handle.plan.coordinator_address.endswith(f":{port}")
        with pytest.raises(Exception, match=f"coordinator port {port} was taken") as raised:
            handle.result(timeout=120)
        first = str(raised.value).splitlines()[0]
        assert type(raised.value).__name__ == "CoordinatorPortTakenError", first
        assert first.startswith(f"host 0's coordinator port {port} was taken by another process"), first
    finally:
        holder.kill()
        holder.wait()


def test_a_stopped_session_leaves_no_connection_or_warm_agent_to_its_hosts(ssh_hosts):
    """``stop`` releases the session's hosts: the notebook's control masters to them and the warm agents that
    forked its hosts end with it, not after ControlPersist or the pool's idle close, and with no
    ``close_pools()``."""
    close_pools()
    before = warm_agents_now(ssh_hosts)
    kinetic_nb.submit("1", framework="none", quiet=True, **on_ssh(ssh_hosts, 2)).result(timeout=300)  # warm agents
    session = kinetic_nb.start(framework="none", echo=False, idle_timeout=600, **on_ssh(ssh_hosts, 2))
    try:
        assert session.run("6 * 7").result(timeout=120) == 42
        held = pool_of(ssh_hosts, 2)  # the session's: open, with its warm agents
        assert held.warm and all(agent.alive() for agent in held.warm) and warm_agents_now(ssh_hosts) - before
    finally:
        said = session.stop()
    assert said.endswith("have ended"), said
    assert held.closed
    deadline = time.monotonic() + 15
    while left := warm_agents_now(ssh_hosts) - before:
        assert time.monotonic() < deadline, f"the stopped session's warm agents or connections ran on: {left}"
        time.sleep(0.1)
    assert not any(held.connections.master_alive(index) for index in range(2))


def test_a_release_opens_no_connection_and_leaves_a_pool_a_launch_holds(ssh_hosts):
    import threading

    from kinetic_nb.backends.ssh import pool as pools
    from kinetic_nb.backends.ssh.backend import SshBackend

    close_pools()
    backend = SshBackend.from_options(**ssh_options(ssh_hosts, 2))
    plan = kinetic_nb.submit("1", framework="none", quiet=True, backend=backend).plan
    held = pool_of(ssh_hosts, 2)
    taken, done = threading.Event(), threading.Event()

    def launch_holding_it() -> None:  # as a launch does, from another thread
        with held.lock:
            taken.set()
            done.wait(60)

    launch = threading.Thread(target=launch_holding_it)
    launch.start()
    try:
        assert taken.wait(60)
        backend.release(plan)
        assert not held.closed and all(held.connections.master_alive(index) for index in range(2))
    finally:
        done.set()
        launch.join()
    backend.release(plan)
    assert held.closed and not pools._pools
    logins = [ssh_hosts.accepted(index) for index in range(2)]
    backend.release(plan)  # nothing open: nothing is opened to be closed
    SshBackend.from_options(**ssh_options(ssh_hosts, 2)).release(plan)  # a backend that never used its hosts
    assert not pools._pools and [ssh_hosts.accepted(index) for index in range(2)] == logins
