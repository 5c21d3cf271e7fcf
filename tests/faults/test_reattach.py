"""A kernel restart mid-job, then %kinetic attach in the new kernel: the result arrives, -o lands."""

from __future__ import annotations

import json
import time

from kinetic_nb.client.outcome import JobStatus

from .helpers import kernel, newest_job


def run(client, code: str) -> tuple[dict, list[str]]:
    printed: list[str] = []

    def collect(message):
        content = message["content"]
        if message["msg_type"] == "stream":
            printed.append(content["text"])
        elif message["msg_type"] in ("display_data", "update_display_data"):  # a panel's text twin
            printed.append(content["data"].get("text/plain", ""))
        elif message["msg_type"] == "execute_result":
            printed.append(content["data"]["text/plain"])
        elif message["msg_type"] == "error":
            printed.append("\n".join(content["traceback"]))

    reply = client.execute_interactive(code, timeout=120, output_hook=collect)
    return reply["content"], printed


def test_attach_after_a_kernel_restart(storage_root):
    with kernel() as (manager, client):
        submitted = time.time()
        client.execute("%%kinetic -n 2 -o trained\nimport time\ntime.sleep(4)\ntrained = {'loss': 0.25}\n41 + 1")
        handle = newest_job(storage_root, submitted, running_hosts=2)
        manager.restart_kernel(now=True)
        client.wait_for_ready(timeout=60)
        assert handle.status() is not JobStatus.CANCELLED  # the job outlived its kernel

        run(client, "%load_ext kinetic_nb")
        reply, printed = run(client, f"%kinetic attach {handle.job_id} -o trained")
        assert reply["status"] == "ok", printed
        assert printed[-1] == "42"
        reply, printed = run(client, "import json; print(json.dumps(trained))")
        assert json.loads(printed[-1]) == {"loss": 0.25}
        reply, printed = run(client, "%kinetic jobs")
        assert handle.job_id in "".join(printed) and "SUCCEEDED" in "".join(printed)
    assert handle.status() is JobStatus.SUCCEEDED


def test_a_jupyterlab_style_restart_leaves_the_job_running(storage_root):
    """JupyterLab restarts a kernel with ``now=False``: SIGINT, a shutdown request, then TERM and KILL."""
    with kernel() as (manager, client):
        submitted = time.time()
        client.execute("%%kinetic -n 2\nimport time\ntime.sleep(8)\n'outlived its kernel'")
        handle = newest_job(storage_root, submitted, running_hosts=2)
        manager.restart_kernel(now=False)
        client.wait_for_ready(timeout=60)
        assert handle.status() is JobStatus.RUNNING  # neither the interrupt nor the shutdown cancelled it

        run(client, "%load_ext kinetic_nb")
        reply, printed = run(client, f"%kinetic attach {handle.job_id}")
        assert reply["status"] == "ok", printed
        assert printed[-1] == "'outlived its kernel'"
    assert handle.status() is JobStatus.SUCCEEDED
