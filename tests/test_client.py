"""submit() and its CellHandle on real local host processes: the outcome rules end to end."""

from __future__ import annotations

import os
import re
import stat
import sys
import time

import pytest

import kinetic_nb
from kinetic_nb.client import cell_handle
from kinetic_nb.errors import IntegrityError, JobFailedError, KineticWarning, ResultSerializationError
from kinetic_nb.runner.protocol import HostState
from kinetic_nb.state import JobStatus

from .conftest import notebook

HOST = "import os\nhost = int(os.environ['KINETIC_HOST_INDEX'])\n"


def run(source: str, **options):
    handle = kinetic_nb.submit(source, **options)
    return handle, handle.result


def test_jax_four_hosts_allgather_on_a_simulated_tpu_slice():
    source = (
        "import jax, jax.numpy as jnp\n"
        "from jax.experimental import multihost_utils\n"
        "total = multihost_utils.process_allgather(jnp.ones(2) * jax.process_index()).sum()\n"
        "(jax.process_count(), jax.device_count(), jax.local_device_count(), float(total))\n"
    )
    handle = kinetic_nb.submit(source, accelerator="tpu-v5e-16")
    assert handle.result() == (4, 16, 4, 12.0)  # 2 * (0 + 1 + 2 + 3)
    assert handle.plan.framework == "jax"
    assert handle.status() is JobStatus.SUCCEEDED


def test_jax_process_count_with_n_hosts():
    handle = kinetic_nb.submit("import jax\njax.process_count()", hosts=4)
    assert handle.result() == 4


def test_torch_gloo_all_reduce():
    source = (
        "import torch, torch.distributed as dist\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "(dist.get_world_size(), t.item())\n"
    )
    handle = kinetic_nb.submit(source, hosts=4)
    assert handle.result() == (4, 10.0)
    assert handle.plan.framework == "torch"


def test_the_leader_owns_the_value():
    handle = kinetic_nb.submit(HOST + "print('output of', host)\nf'value of host {host}'", hosts=4)
    assert handle.result() == "value of host 0"
    assert [h.state for h in handle.hosts()] == [HostState.SUCCEEDED] * 4
    assert handle.logs(3) == "output of 3\n"


def test_worker_failure_after_leader_success_raises_the_workers_exception():
    source = HOST + (
        "import pathlib, time\n"
        "leader_result = pathlib.Path(os.environ['KINETIC_JOB_URI'].removeprefix('file://'), 'result.pkl')\n"
        "if host == 2:\n"
        "    while not leader_result.exists():  # fail only after the leader has recorded its success\n"
        "        time.sleep(0.01)\n"
        "    raise KeyError('only on host 2')\n"
        "'leader value'"
    )
    handle = kinetic_nb.submit(source, hosts=4)
    with pytest.raises(KeyError, match="only on host 2") as info:
        handle.result()
    notes = info.value.__notes__
    assert notes[0] == f"Reported by host 2 of job {handle.job_id}. %kinetic logs {handle.job_id} --host 2 shows its output."
    assert "leader value" not in str(info.value)
    assert "line 8" in str(info.value.__cause__) and "raise KeyError" in str(info.value.__cause__)
    assert handle.status() is JobStatus.FAILED


def test_the_panels_last_word_is_the_outcome_while_a_host_is_still_ending():
    # Host 1 fails at once; host 0 is still asleep: the cell raises as soon as that decides it, host 0 is
    # stopped then (not after the grace), and the panel's final update says FAILED, never RUNNING.
    source = HOST + "import time\nif host == 1:\n    raise ValueError('host 1 gave up')\ntime.sleep(60)"
    handle = kinetic_nb.submit(source, hosts=2, grace=2)
    shown = []
    with pytest.raises(ValueError, match="host 1 gave up"):
        handle.result(on_snapshot=shown.append)
    assert shown[-1].status is JobStatus.FAILED
    assert shown[-1].hosts[0].state in ("stopping", "stopped")  # it was asleep: it is stopped with the outcome
    assert handle.wait(timeout=60) is JobStatus.FAILED
    assert handle.hosts()[0].state == "stopped" and "after another host failed" in handle.hosts()[0].exit_summary


def test_the_status_is_the_outcome_once_decided_while_a_host_it_stopped_is_still_ending(monkeypatch):
    # Host 0 ignores its SIGTERM and ends at the SIGKILL half a second later; result() waits for no host's end
    # here: status() says what result() decided, where it said RUNNING until every host's end was read (as CI
    # saw on a bucket, where the stopped hosts' ends are read a moment later).
    monkeypatch.setattr(cell_handle, "OUTPUT_WAIT_S", 0.0)
    source = HOST + ("import signal, time\nif host == 1:\n    raise ValueError('host 1 gave up')\n"
                     "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)")
    handle = kinetic_nb.submit(source, hosts=2)
    with pytest.raises(ValueError, match="host 1 gave up"):
        handle.result()
    assert handle.status() is JobStatus.FAILED
    assert handle.wait(timeout=60) is JobStatus.FAILED and handle.hosts()[0].exit.signal == "SIGKILL"


def test_two_failing_workers_raise_the_lower_index():
    source = HOST + "if host in (1, 3):\n    raise ValueError(f'broken host {host}')\nhost"
    handle = kinetic_nb.submit(source, hosts=4)
    with pytest.raises(ValueError, match="broken host 1") as info:
        handle.result()
    assert info.value.__notes__[0].endswith("Other hosts that also reported a failure: 3.")


def test_leader_failure_raises_the_leaders_exception():
    source = HOST + "if host == 0:\n    raise ZeroDivisionError('leader broke')\nhost"
    with pytest.raises(ZeroDivisionError, match="leader broke"):
        kinetic_nb.submit(source, hosts=3).result()


def test_sigkilled_host_names_the_host_the_signal_and_its_last_lines():
    source = HOST + (
        "import signal\n"
        "if host == 2:\n"
        "    print('about to vanish', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "host"
    )
    with pytest.raises(JobFailedError) as info:
        kinetic_nb.submit(source, hosts=4).result()
    message = str(info.value)
    # The host and how it ended, never the object it did not write (result-worker-2.pkl).
    assert message.splitlines()[0].endswith(
        "failed after the leader succeeded, and no failing host reported why; host 2 was killed by SIGKILL while "
        "in the cell.")
    assert ".pkl" not in message
    assert "about to vanish" in message


def test_a_payload_the_hosts_did_not_sign_is_named_not_unpickled():
    source = HOST + (
        "import pathlib, time\n"
        "job = pathlib.Path(os.environ['KINETIC_JOB_URI'].removeprefix('file://'))\n"
        "if host == 1:  # user code has no key: the runner took it out of the environment\n"
        "    (job / 'result-worker-1.pkl').write_bytes(b'not a pickle, and not signed')\n"
        "    os._exit(1)\n"
        "if host == 2:\n"
        "    time.sleep(0.2)\n"
        "    raise RuntimeError('the real error on host 2')\n"
        "host"
    )
    handle = kinetic_nb.submit(source, hosts=4)
    with pytest.raises(IntegrityError, match=r"result-worker-1\.pkl carries no signature") as info:
        handle.result()
    assert "The next verified failure: host 2: RuntimeError: the real error on host 2" in info.value.__notes__


def test_a_host_failing_to_load_the_payload_stops_the_others_before_the_cell(tmp_path):
    ns = notebook(
        "import os\n"
        "def load_bomb():\n"
        "    if os.environ['KINETIC_HOST_INDEX'] == '2':\n"
        "        raise RuntimeError('cannot load on host 2')\n"
        "    return 'loaded'\n"
        "class Bomb:\n"
        "    def __reduce__(self):\n"
        "        return (load_bomb, ())\n"
        "bomb = Bomb()\n"
    )
    marker_dir = str(tmp_path)
    source = (
        "import pathlib, jax\n"
        f"pathlib.Path({marker_dir!r}, 'ran-' + str(jax.process_index())).touch()\n"
        "from jax.experimental import multihost_utils\n"
        "multihost_utils.sync_global_devices('never reached')\n"
        "bomb"
    )
    started = time.monotonic()
    handle = kinetic_nb.submit(source, hosts=4, namespace=ns)
    with pytest.raises(RuntimeError, match="cannot load on host 2") as info:
        handle.result()
    assert time.monotonic() - started < 60  # seconds, not a collective's timeout
    assert any("'bomb' on host 2" in note for note in info.value.__notes__)
    assert "It failed while loading the cell, before the cell's code ran." in info.value.__notes__  # scripts too
    assert list(tmp_path.iterdir()) == []  # nobody entered the cell
    hosts = handle.hosts()
    assert hosts[2].state == HostState.FAILED and hosts[2].phase == "payload load"
    assert [hosts[i].state for i in (0, 1, 3)] == [HostState.STOPPED] * 3
    assert hosts[1].exit is not None and hosts[1].exit.stopped  # stopped by kinetic_nb, never failed


def test_unpicklable_leader_value_is_a_clear_error_with_its_repr():
    source = "import threading\nclass Holder:\n    def __repr__(self):\n        return 'Holder(lock)'\n" \
             "h = Holder()\nh.lock = threading.Lock()\nh"
    with pytest.raises(ResultSerializationError, match=r"the leader's value .* could not be pickled.*Holder\(lock\)"):
        kinetic_nb.submit(source, hosts=2).result()


def test_unpicklable_value_on_a_worker_is_fine():
    source = HOST + "import threading\nthreading.Lock() if host else 'picklable'"
    assert kinetic_nb.submit(source, hosts=3).result() == "picklable"


def test_out_variables_and_notebook_values_travel():
    ns = notebook("scale = 10\ndef double(x):\n    return 2 * x\nclass Point:\n    def __init__(self, x):\n        self.x = x\n")
    source = HOST + "p = Point(double(scale) + host)\nresult = p.x\nresult"
    handle = kinetic_nb.submit(source, hosts=2, namespace=ns, out=["p", "result"])
    assert handle.result() == 20
    assert handle.outputs["result"] == 20 and handle.outputs["p"].x == 20


def test_an_out_name_the_cell_never_binds_is_refused_before_any_host_starts(tmp_path):
    with pytest.raises(NameError, match="-o/--out missing: the cell never assigns it"):
        kinetic_nb.submit("x = 1", hosts=2, out=["missing"], storage=f"file://{tmp_path}")
    assert list(tmp_path.iterdir()) == []  # nothing stored, nothing started


def test_an_out_name_left_unbound_at_run_time_is_a_warning_and_the_value_comes_back():
    handle = kinetic_nb.submit("x = 1\nif x > 1:\n    later = 2\nx + 1", hosts=2, out=["x", "later"])
    with pytest.warns(KineticWarning, match="-o/--out later: not bound on the leader"):
        assert handle.result() == 2
    assert handle.outputs == {"x": 1} and handle.missing_outputs == ("later",)


def test_single_host_job_needs_no_listing():
    handle = kinetic_nb.submit("1 + 1")
    assert handle.result() == 2
    assert handle.plan.hosts == 1


def test_env_reaches_every_host():
    source = HOST + "os.environ['GREETING'] + str(os.environ['WORLD_SIZE'])"
    assert kinetic_nb.submit(source, hosts=2, env={"GREETING": "hi"}).result() == "hi2"


def test_job_objects_follow_the_protocol():
    handle = kinetic_nb.submit("print('x')\n3", hosts=2, keep=True)
    handle.result()
    names = {info.name for info in handle.storage.list()}
    assert {"plan.json", "payload.pkl", "handle.json", ".leader_ready", "result.pkl"} <= names
    assert {"hosts/0/status.json", "hosts/1/exit.json", "hosts/1/log/000000.json"} <= names
    assert not any(name.startswith("result-worker") for name in names)
    # This user's only, under a custom root too (the tests run under $KINETIC_STORAGE).
    assert stat.S_IMODE(os.stat(handle.storage.local_path()).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(handle.storage.local_path(name)).st_mode) for name in names} == {0o600}


def test_timeout_stops_the_job():
    from kinetic_nb.errors import KineticTimeoutError

    handle = kinetic_nb.submit(HOST + "import time\nprint('sleeping', flush=True)\ntime.sleep(600)", hosts=2, timeout=2)
    with pytest.raises(KineticTimeoutError, match="timeout of 2 s") as info:
        handle.result()
    assert "sleeping" in info.value.__notes__[0] and "host 0: in the cell" in info.value.__notes__[0]
    assert isinstance(info.value, TimeoutError)
    assert handle.status() is JobStatus.CANCELLED


def test_a_crash_after_recorded_success_is_a_teardown_warning():
    source = HOST + (
        "import signal\n"
        "import kinetic_nb.runner.frameworks as frameworks\n"
        "if host == 1:\n"
        "    frameworks.shut_down = lambda plan: os.kill(os.getpid(), signal.SIGABRT)\n"
        "'kept'"
    )
    handle = kinetic_nb.submit(source, hosts=2)
    with pytest.warns(KineticWarning, match=r"host 1 ended badly after recording success \(was killed by SIGABRT\)"):
        assert handle.result() == "kept"
    assert handle.status() is JobStatus.SUCCEEDED


def test_processes_a_cell_starts_and_abandons_do_not_outlive_the_job():
    source = "import subprocess\nsubprocess.Popen(['sleep', '600'], start_new_session=True).pid"
    pid = kinetic_nb.submit(source, hosts=2).result()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_handle_reprs_are_static_snapshots():
    from IPython.lib.pretty import pretty

    handle = kinetic_nb.submit("print('hi')\n1", hosts=2)
    handle.result()
    text = pretty(handle)
    assert text.splitlines()[0].startswith(f"{handle.job_id} · local · cpu · 2 hosts")
    assert "    0*  succeeded" in text
    page = handle._repr_html_()
    assert "<table>" in page and "succeeded" in page and handle.job_id in page


def test_a_leader_value_the_notebook_cannot_unpickle_is_named_not_missing():
    from kinetic_nb.errors import UnreadableResultError

    source = (
        "class OnlyOnHosts:\n"
        "    def __reduce__(self):  # pickles on the host; rebuilding it fails anywhere else\n"
        "        return (int, ('built from something only the hosts have',))\n"
        "OnlyOnHosts()"
    )
    handle = kinetic_nb.submit(source, hosts=2, keep=True)
    with pytest.raises(UnreadableResultError, match="cannot be unpickled here: ValueError") as info:
        handle.result()
    assert "missing" not in str(info.value)


def test_the_local_backend_refuses_a_platform_other_than_linux_in_one_line(monkeypatch, tmp_path):
    """Its agent needs /proc and prctl: elsewhere it could not stop what a cell starts (README, "Platforms")."""
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ValueError, match=r"^the local backend runs hosts on Linux only \(its agent uses /proc and "
                                         r"prctl\), not darwin: run the notebook in a Linux container or VM, or use "
                                         r"-b ray or -b kubernetes$"):
        kinetic_nb.submit("1", hosts=2, storage=f"file://{tmp_path}")
    assert list(tmp_path.rglob("*.json")) == []  # refused before anything was stored


@pytest.mark.parametrize(("call", "expected"), [
    (lambda: kinetic_nb.submit("1", hosts=0), "hosts must be at least 1, got 0"),
    (lambda: kinetic_nb.submit("1", timeout=float("nan")), "timeout must be a positive number of seconds, got nan"),
    (lambda: kinetic_nb.submit("1", grace=-1), "grace must be a number of seconds, 0 or more, got -1"),
    (lambda: kinetic_nb.start(hosts=0), "hosts must be at least 1, got 0"),
    (lambda: kinetic_nb.start(grace=float("inf")), "grace must be a number of seconds, 0 or more, got inf"),
    (lambda: kinetic_nb.start(idle_timeout=-5),
     "idle_timeout must be 0 (never) or a positive number of seconds, got -5"),
], ids=["submit hosts", "submit timeout", "submit grace", "start hosts", "start grace", "start idle timeout"])
def test_the_api_checks_a_shape_in_one_place_and_names_the_parameter(call, expected):
    """submit, start and a session cell share one check (the magics name the flag instead); nothing starts."""
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        call()


def test_a_one_shot_jobs_agent_wakes_the_waiting_notebook_when_a_host_ends_and_leaves_no_socket(tmp_path):
    import select

    from kinetic_nb.runner.wakeup import CLIENTS_FOLDER, session_socket_directory

    go = tmp_path / "go"
    handle = kinetic_nb.submit(f"import os, time\ndeadline = time.time() + 60\nwhile not os.path.exists({str(go)!r})"
                               " and time.time() < deadline:\n    time.sleep(0.01)\n'done'", hosts=2)
    handle.group.sleep(0)  # the notebook's first wait makes its socket
    socket_directory = session_socket_directory(handle.job_id)
    assert os.listdir(socket_directory) == [CLIENTS_FOLDER]  # the notebooks' sockets, apart from any host's
    assert [name.startswith("client-") for name in os.listdir(socket_directory / CLIENTS_FOLDER)] == [True]
    go.touch()
    # No look at storage in between: the agent's datagram is what makes the socket readable.
    readable, _, _ = select.select([handle.group._wakeup._socket], [], [], 60)
    assert readable, "the agent never woke the notebook"
    assert handle.result() == "done"
    # The notebook's socket and its directory go with the outcome: the agent removes them right after it woke the
    # notebook (which may read the outcome first, on a busy machine).
    deadline = time.monotonic() + 10
    while socket_directory.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not socket_directory.exists()
