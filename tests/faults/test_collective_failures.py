"""One host raises while the others block in a collective: its own exception, within grace + 5 s."""

from __future__ import annotations

import time

import pytest

import kinetic_nb
from kinetic_nb.client.outcome import JobStatus

GRACE_S = 3

BLOCKED_PEERS = {
    "jax": (
        "import os, jax\n"
        "from jax.experimental import multihost_utils\n"
        "multihost_utils.sync_global_devices('everyone is in')\n"
        "if os.environ['RANK'] == '2':\n"
        "    raise ValueError('host 2 found a bad shard')\n"
        "multihost_utils.sync_global_devices('never completes')\n"
    ),
    "torch": (
        "import os, torch, torch.distributed as dist\n"
        "dist.barrier()\n"
        "if os.environ['RANK'] == '2':\n"
        "    raise ValueError('host 2 found a bad shard')\n"
        "dist.all_reduce(torch.ones(1))\n"
    ),
}


@pytest.mark.parametrize("framework", list(BLOCKED_PEERS))
def test_the_raising_host_wins_over_its_blocked_peers(framework):
    handle = kinetic_nb.submit(BLOCKED_PEERS[framework], hosts=3, grace=GRACE_S)
    with pytest.raises(ValueError, match="host 2 found a bad shard") as info:
        handle.result()
    raised_at = time.time()
    failed_at = handle.hosts()[2].updated_at  # when host 2 recorded its failure
    assert raised_at - failed_at < GRACE_S + 5
    assert info.value.__notes__[0].startswith(f"Reported by host 2 of job {handle.job_id}. %kinetic logs ")
    # The peers are stopped after the grace period, or fail as a consequence; never the cause.
    assert handle.wait(timeout=GRACE_S + 30) is JobStatus.FAILED
    states = {host.index: host.state for host in handle.hosts()}
    assert states[2] == "failed"
    assert all(states[i] in ("stopped", "failed") for i in (0, 1))
    assert all(not host.failed_on_its_own for host in handle.hosts() if host.index != 2 and host.message)
