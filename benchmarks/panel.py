"""Polling cost and panel update time at 4, 64 and 256 hosts.

For each N, a job directory with N hosts' records (status, heartbeat, a log
chunk) is written, and then:

- storage requests per poll: the first poll (everything is new), a quiet poll
  (only heartbeats were rewritten), and a poll after one host failed; next to
  the baseline of a naive poller that reads every host's status each time
  (1 listing + N reads). Goal: a quiet poll is one listing and no reads.
- CPU time of one ``HostPanel.update`` (median of 20, each drawing a later
  moment so every elapsed time changes), next to the 20 ms goal at 256 hosts,
  and relative to N = 4. Widgets here have no kernel to send to, so this is
  the cost of building and assigning the traits, not of the messages.

    python benchmarks/panel.py
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time

from kinetic_nb.backends.local import LocalBackend
from kinetic_nb.client.poller import JobPoller
from kinetic_nb.notebook.display.panel import HostPanel
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import HostStatus, JobPlan
from kinetic_nb.storage import LocalStorage

TRACEBACK = 'Traceback (most recent call last):\n  File "<kinetic In[3]>", line 12, in <module>\nValueError: bad\n'


def write_job(root: str, hosts: int) -> tuple[LocalStorage, JobPlan]:
    storage = LocalStorage(f"{root}/kn-bench-{hosts}")
    plan = JobPlan(job_id=f"kn-bench-{hosts}", hosts=hosts, accelerator="cpu", devices_per_host=1, framework="none",
                   coordinator_address="127.0.0.1:1", barrier_timeout_s=1,
                   heartbeat_timeout_s=1, shutdown_timeout_s=1)
    storage.write_bytes(protocol.PLAN, plan.to_json())
    now = time.time()
    for index in range(hosts):
        status = HostStatus(index, "running", "execute", now, now, 1000 + index, "bench",
                            history=[["startup", now], ["execute", now + 0.1]])
        storage.write_bytes(protocol.host_status(index), status.to_json())
        storage.write_bytes(protocol.host_heartbeat(index), b"")
        storage.write_bytes(protocol.host_log_chunk(index, 0), f"step 1 on host {index}\n".encode())
    return storage, plan


def requests(poller: JobPoller) -> tuple[int, int]:
    before = dict(poller.requests)
    poller.poll()
    return poller.requests["list"] - before.get("list", 0), poller.requests["read"] - before.get("read", 0)


def update_ms(panel: HostPanel, snapshot) -> float:
    """Each update draws a later moment, so every row's elapsed time really changes."""
    samples = []
    for step in range(20):
        later = dataclasses.replace(snapshot, taken_at=snapshot.taken_at + 0.1 * (step + 1))
        started = time.process_time()
        panel.update(later)
        samples.append((time.process_time() - started) * 1000)
    return statistics.median(samples)


def main() -> None:
    root = tempfile.mkdtemp(prefix="kinetic-bench-panel-")
    print("storage requests per poll (list + reads); naive baseline reads every status: 1 + N")
    print(f"{'hosts':>5}  {'first':>10}  {'quiet':>10}  {'one change':>10}  {'naive':>10}  {'quiet/naive':>11}")
    update_times = {}
    for hosts in (4, 64, 256):
        storage, plan = write_job(root, hosts)
        poller = JobPoller(storage, plan, LocalBackend())
        first = requests(poller)
        time.sleep(0.01)
        for index in range(hosts):
            storage.write_bytes(protocol.host_heartbeat(index), b"")
        quiet = requests(poller)
        failed = HostStatus(1, "failed", "execute", time.time(), time.time(), 1001, "bench", "ValueError: bad",
                            TRACEBACK, [["startup", time.time()]])
        storage.write_bytes(protocol.host_status(1), failed.to_json())
        changed = requests(poller)
        naive = 1 + hosts
        print(f"{hosts:>5}  {'{} + {}'.format(*first):>10}  {'{} + {}'.format(*quiet):>10}  "
              f"{'{} + {}'.format(*changed):>10}  {f'1 + {hosts}':>10}  {sum(quiet) / naive:11.3f}")
        panel = HostPanel(hosts)
        update_times[hosts] = update_ms(panel, poller.snapshot())
    print("\nCPU time of one panel update (median of 20)")
    print(f"{'hosts':>5}  {'ms':>7}  {'vs N=4':>7}  {'vs 20 ms goal':>13}")
    for hosts, ms in update_times.items():
        print(f"{hosts:>5}  {ms:7.2f}  {ms / update_times[4]:7.2f}  {ms / 20:13.2f}")


if __name__ == "__main__":
    main()
