"""SIGKILL of the leader, and of a worker, in each phase: the cell names the host and the signal."""

from __future__ import annotations

import time

import pytest

import kinetic_nb
from kinetic_nb.client.outcome import JobStatus
from kinetic_nb.errors import JobFailedError
from kinetic_nb.state import is_peer_loss, phase_words

from .helpers import STRIKES, exits

#: No case may take longer than this: a collective's own timeout would be minutes.
BOUND_S = 45

CELLS = {
    "before the barrier": ("none", "kill_on_load\n'value'", "payload load"),
    "inside a collective": (
        "jax",
        "import os, signal, threading, time, jax\n"
        "from jax.experimental import multihost_utils\n"
        "multihost_utils.sync_global_devices('everyone is in')\n"
        "if os.environ['KINETIC_HOST_INDEX'] == os.environ['KILL_HOST']:\n"
        "    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()\n"
        "else:\n"
        "    time.sleep(2)\n"
        "multihost_utils.sync_global_devices('never completes')\n",
        "execute",
    ),
    "while writing the result": (
        "none",
        "import os\n"
        "if os.environ['KINETIC_HOST_INDEX'] == os.environ['KILL_HOST']:\n"
        "    if os.environ['KILL_HOST'] == '0':\n"
        "        value = KillOnSave()\n"
        "    else:\n"
        "        raise KillingError('dies while its failure payload is written')\n"
        "else:\n"
        "    value = 'fine'\n"
        "value",
        None,  # the leader pickles its value in "result serialization"; a worker its error in "execute"
    ),
}


@pytest.mark.parametrize("victim", [0, 2], ids=["leader", "worker"])
@pytest.mark.parametrize("moment", list(CELLS))
def test_sigkill(moment, victim):
    framework, source, phase = CELLS[moment]
    phase = phase or ("result serialization" if victim == 0 else "execute")
    started = time.monotonic()
    handle = kinetic_nb.submit(source, hosts=3, framework=framework, namespace=STRIKES,
                               env={"KILL_HOST": str(victim)}, grace=2)
    with pytest.raises(JobFailedError) as info:
        handle.result()
    assert time.monotonic() - started < BOUND_S
    first_line = str(info.value).splitlines()[0]
    assert f"host {victim} was killed by SIGKILL while {phase_words(phase)}" in first_line
    ended = exits(handle)
    assert handle.status() is JobStatus.FAILED
    assert ended[victim].signal == "SIGKILL" and ended[victim].failed
    for other in {0, 1, 2} - {victim}:
        summary = ended[other]
        # The others finished, were stopped once the victim had died, or lost it as a peer (a collective's own
        # error, rule 6): none failed on a cause of its own, and none is blamed.
        assert not summary.failed or summary.stopped or any(is_peer_loss(line) for line in summary.stderr_tail), summary
        assert f"host {other} " not in first_line


def test_sigkill_of_one_process_of_a_host_inside_a_collective():
    """2 hosts x 2 processes in a torch all-reduce: rank 3 (host 1's second process) is killed while the others
    wait in it; the cell names that process and its signal, and every other process is stopped (none survives:
    the suite's fixture checks)."""
    source = (
        "import os, signal, threading, torch, torch.distributed as dist\n"
        "dist.barrier()\n"
        "if os.environ['RANK'] == '3':\n"
        "    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()\n"
        "    threading.Event().wait()\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
    )
    started = time.monotonic()
    handle = kinetic_nb.submit(source, hosts=2, procs_per_host=2, framework="torch", grace=2)
    with pytest.raises(JobFailedError) as info:
        handle.result()
    assert time.monotonic() - started < BOUND_S
    first_line = str(info.value).splitlines()[0]
    assert "host 1, process 1 (rank 3) was killed by SIGKILL while in the cell" in first_line
    ended = exits(handle)
    assert sorted(ended) == [0, 1, 2, 3] and ended[3].signal == "SIGKILL"
    for rank in (0, 1, 2):
        summary = ended[rank]
        assert not summary.failed or summary.stopped or any(is_peer_loss(line) for line in summary.stderr_tail), summary
