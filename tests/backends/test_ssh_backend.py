"""``-b ssh`` end to end, against four real ``sshd`` processes on loopback addresses (``tests/ssh_hosts``).

Each host's environment is installed by the bootstrap from the job's signed wheel, once per content, and the
same agent and runner as every backend run there, detached from the ssh session. The hosts see the test
interpreter's packages (jax, torch) on ``PYTHONPATH``, as machines with them installed would.
"""

from __future__ import annotations

import pytest

import kinetic_nb
from kinetic_nb.errors import SshHostError

from .conftest import ssh_options


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


def test_a_workers_own_failure_is_raised_with_its_host(ssh_hosts):
    source = "import os\nif os.environ['KINETIC_HOST_INDEX'] == '2':\n    raise KeyError('host two')\n'fine'"
    handle = kinetic_nb.submit(source, framework="none", quiet=True, grace=1, **on_ssh(ssh_hosts))
    with pytest.raises(KeyError, match="host two") as caught:
        handle.result(timeout=300)
    assert any("Reported by host 2 of multi-host job" in note for note in caught.value.__notes__)
    handle.wait(timeout=60)


def test_hosts_that_do_not_match_the_cell_are_one_line(ssh_hosts):
    with pytest.raises(ValueError, match=r"^2 hosts do not match the 4 that --ssh-hosts names$"):
        kinetic_nb.submit("1", hosts=2, quiet=True, **on_ssh(ssh_hosts))


def test_an_unreachable_host_fails_before_anything_is_stored(ssh_hosts, storage_root):
    options = on_ssh(ssh_hosts)
    options["backend_options"]["ssh_hosts"] = "h0,nobody"
    with pytest.raises(SshHostError, match=r"^host 1 \(nobody\) cannot be reached"):
        kinetic_nb.submit("1", quiet=True, **options)


def agent_processes(job_id: str, host: int) -> list:
    """Host ``host``'s agent and the processes it started, found by their environment."""
    import psutil

    found = []
    for process in psutil.process_iter():
        try:  # the agent's command names the job; its environment as it started, the host (its runner's too)
            if job_id in " ".join(process.cmdline()) and process.environ().get("KINETIC_HOST_INDEX") == str(host):
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def test_a_dropped_connection_does_not_end_the_cell(ssh_hosts):
    source = "import time\ntime.sleep(3)\n'finished without its ssh connections'"
    handle = kinetic_nb.submit(source, framework="none", quiet=True, **on_ssh(ssh_hosts))
    connections = handle.backend._jobs[handle.job_id][0]
    connections.close()  # every control master ends: the sessions that started the agents are gone
    assert not any(connections.master_alive(index) for index in range(4))
    assert handle.result(timeout=120) == "finished without its ssh connections"


def test_a_host_whose_agent_and_processes_are_killed_is_lost(ssh_hosts):
    import signal

    import kinetic_nb.errors

    source = "import time\nprint('working', flush=True)\ntime.sleep(600)"
    handle = kinetic_nb.submit(source, framework="none", quiet=True, grace=1, **on_ssh(ssh_hosts))
    deadline = __import__("time").monotonic() + 120
    while not all(host.last_line == "working" for host in handle.hosts()):
        assert __import__("time").monotonic() < deadline, "the hosts did not start"
        __import__("time").sleep(0.1)
    victims = agent_processes(handle.job_id, 3)
    assert len(victims) >= 2  # the agent and its runner
    for process in victims:
        process.send_signal(signal.SIGKILL)  # the machine is gone: no exit record will come
    with pytest.raises(kinetic_nb.errors.JobFailedError, match="host 3 was lost"):
        handle.result(timeout=120)
    handle.wait(timeout=60)  # the others are stopped by their agents after the grace


def test_a_session_runs_its_cells_on_the_ssh_hosts(ssh_hosts):
    session = kinetic_nb.start(framework="none", echo=False, idle_timeout=600, **on_ssh(ssh_hosts))
    try:
        assert session.plan.hosts == 4
        session.run("import os\nmine = int(os.environ['KINETIC_HOST_INDEX'])").result(timeout=120)
        assert session.run("mine + 40").result(timeout=120) == 40
        with pytest.raises(ValueError, match="host 1 says no"):
            session.run("if mine == 1:\n    raise ValueError('host 1 says no')").result(timeout=120)
        assert session.run("mine").result(timeout=120) == 0  # the session stayed up
    finally:
        session.stop()
