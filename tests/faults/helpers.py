"""Shared pieces of the fault suite: notebook values that strike in a given phase, and a kernel."""

from __future__ import annotations

import contextlib
import os
import time

from jupyter_client.manager import start_new_kernel

from kinetic_nb.runner.protocol import ExitSummary
from kinetic_nb.storage import open_storage

from ..conftest import notebook

#: A notebook whose values kill (SIGKILL) the host given by KILL_HOST when they
#: are unpickled (payload load, before the barrier) or pickled (result upload).
STRIKES = notebook(
    "import os, signal\n"
    "def _die_here():\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "def _load():\n"
    "    if os.environ['KINETIC_HOST_INDEX'] == os.environ['KILL_HOST']:\n"
    "        _die_here()\n"
    "    return 'loaded'\n"
    "class KillOnLoad:\n"
    "    def __reduce__(self):\n"
    "        return (_load, ())\n"
    "class KillOnSave:\n"
    "    def __reduce__(self):\n"
    "        _die_here()\n"
    "class KillingError(Exception):\n"
    "    def __reduce__(self):\n"
    "        _die_here()\n"
    "kill_on_load = KillOnLoad()\n"
)


def exits(handle) -> dict[int, ExitSummary]:
    handle.wait(timeout=60)
    return handle.poller.exits


@contextlib.contextmanager
def kernel():
    """A real IPython kernel (ipykernel) with kinetic_nb loaded; shut down afterwards."""
    manager, client = start_new_kernel(kernel_name="python3", env={**os.environ})
    try:
        client.execute_interactive("%load_ext kinetic_nb", timeout=60)
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def newest_job(storage_root: str, since: float, wait_s: float = 30.0, *, running_hosts: int = 0):
    """The job submitted under ``storage_root`` after ``since``, once ``running_hosts`` hosts run the cell."""
    import kinetic_nb.client.catalog as jobs

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        records = [r for r in jobs.jobs(storage=storage_root, limit=5) if r.submitted_at >= since]
        if records:
            handle = jobs.attach(records[0].job_id, storage=storage_root)
            if sum(h.phase == "execute" and h.state == "running" for h in handle.hosts()) >= running_hosts:
                return handle
        time.sleep(0.1)
    raise AssertionError(f"no job with {running_hosts} running hosts appeared in {open_storage(storage_root).uri}")


def wait_for(predicate, what: str, guard: float = 60.0):
    """``predicate()``'s first true value, looked for every 50 ms; an ``AssertionError`` naming ``what`` after
    ``guard`` seconds (generous: a bound that only catches a hang, never a slow machine)."""
    deadline = time.monotonic() + guard
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {guard:g} s")
