"""Background panel updates in a real kernel belong to the cell that started them (ipykernel 7)."""

from __future__ import annotations

import queue

from jupyter_client.manager import start_new_kernel


def test_watch_updates_carry_the_starting_cells_parent_header():
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        first = client.execute(
            "import kinetic_nb\n"
            "job = kinetic_nb.submit('import time\\ntime.sleep(1.5)\\n7', hosts=2)\n"
            "job.watch()"
        )
        client.get_shell_msg(timeout=60)
        second = client.execute("import time\ntime.sleep(4)\nprint('second cell done')")
        client.get_shell_msg(timeout=60)
        messages = []
        while True:
            try:
                messages.append(client.get_iopub_msg(timeout=2))
            except queue.Empty:
                break
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    updates = [m for m in messages if m["msg_type"] == "comm_msg" and "succeeded" in str(m["content"])]
    assert updates, "the panel never showed the job's end"
    parents = {m["parent_header"].get("msg_id") for m in updates}
    assert parents == {first}  # not the cell that happened to run when the job ended
    assert second not in parents
