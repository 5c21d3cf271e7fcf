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
- What a live panel costs per second of a running cell at 16, 256 and 1,024
  hosts, as ratios against the 16-host panel in the same run: the kernel's CPU
  in ``HostPanel.update`` and the bytes of trait values its widgets send (each
  widget's comm is replaced by one that counts the JSON of its update
  messages), fed 40 synthetic snapshots a poll interval apart (10 s of a
  cell, on a clock the panel reads). Two cells: "steady" (every host running,
  every host's last line changing at every poll) and "ending" (the hosts
  ending one by one, in a scattered order, over those 10 s), the costly case
  for the grid. Goal: a ratio of 1.0 or less at 1,024 hosts.

    python benchmarks/panel.py
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from typing import ClassVar

import comm
from comm import DummyComm

from kinetic_nb.backends.local import LocalBackend
from kinetic_nb.client.poller import JobPoller
from kinetic_nb.notebook.display.panel import HostPanel
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import HostStatus, JobPlan
from kinetic_nb.state import SNAPSHOT_INTERVAL_S, HostSnapshot, JobSnapshot, JobStatus
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


class Clock:
    """The panel's clock, moved by the benchmark: a snapshot a poll interval after the last one."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def update_ms(hosts: int, snapshot) -> float:
    """Each update draws a later moment (on the panel's clock too), so every row's elapsed time really changes
    and no draw is skipped."""
    clock = Clock()
    panel = HostPanel(hosts, clock=clock)
    samples = []
    for step in range(20):
        later = dataclasses.replace(snapshot, taken_at=snapshot.taken_at + 0.1 * (step + 1))
        clock.now += panel.interval
        started = time.process_time()
        panel.update(later)
        samples.append((time.process_time() - started) * 1000)
    return statistics.median(samples)


class CountingComm(DummyComm):
    """A widget's comm that counts the bytes of the update messages it would send to the browser."""

    sent: ClassVar[list[int]] = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys) -> None:
        if msg_type == "comm_msg":
            CountingComm.sent.append(len(json.dumps(data, ensure_ascii=False).encode()))


#: The live-panel cells, a snapshot per poll interval: 10 s of a cell.
POLLS = 40
T0 = 1_000_000.0


def cell_snapshot(hosts: int, poll: int, ending: bool) -> JobSnapshot:
    """``hosts`` hosts ``poll`` intervals into a cell whose hosts print a line per poll; ``ending``: the hosts
    end one by one over the cell's polls, in a scattered order (host ``i`` at its place in a stride of 7919)."""
    taken_at = T0 + SNAPSHOT_INTERVAL_S * poll
    states = []
    for index in range(hosts):
        done = ending and (index * 7919) % hosts < hosts * poll // POLLS
        states.append(HostSnapshot(
            index, "succeeded" if done else "running", "execute", started_at=T0, updated_at=taken_at,
            last_line="done" if done else f"step {poll} loss 0.53",
            log_tail=tuple(f"step {step} loss 0.53" for step in range(max(0, poll - 5), poll + 1))))
    return JobSnapshot(f"kn-bench-{hosts}", "local", "cpu", JobStatus.RUNNING, T0, taken_at, tuple(states))


def live_cost(hosts: int, ending: bool) -> tuple[float, float]:
    """Kernel CPU ms and kilobytes sent per second of the cell, by one panel fed ``POLLS`` snapshots."""
    snapshots = [cell_snapshot(hosts, poll, ending) for poll in range(POLLS)]
    clock = Clock()
    panel = HostPanel(hosts, clock=clock)
    CountingComm.sent.clear()
    cpu = 0.0
    for snapshot in snapshots:
        clock.now = snapshot.taken_at - T0
        started = time.process_time()
        panel.update(snapshot)
        cpu += time.process_time() - started
    seconds = POLLS * SNAPSHOT_INTERVAL_S
    return cpu * 1000 / seconds, sum(CountingComm.sent) / 1024 / seconds


def live_costs() -> None:
    comm.create_comm = CountingComm  # every widget made from here on counts what it sends
    print(f"\nA live panel per second of a cell: kernel CPU in HostPanel.update and trait bytes sent "
          f"(a snapshot every {SNAPSHOT_INTERVAL_S:g} s for {POLLS * SNAPSHOT_INTERVAL_S:g} s; median of 3 runs)")
    print(f"{'cell':>7}  {'hosts':>5}  {'CPU ms/s':>8}  {'vs 16':>6}  {'KiB/s':>7}  {'vs 16':>6}")
    for ending in (False, True):
        base = None
        for hosts in (16, 256, 1024):
            runs = [live_cost(hosts, ending) for _ in range(3)]
            cpu, sent = statistics.median(run[0] for run in runs), statistics.median(run[1] for run in runs)
            base = base or (cpu, sent)
            print(f"{'ending' if ending else 'steady':>7}  {hosts:>5}  {cpu:8.2f}  {cpu / base[0]:6.2f}  "
                  f"{sent:7.1f}  {sent / base[1]:6.2f}")


def main() -> None:
    folder = tempfile.TemporaryDirectory(prefix="kinetic-bench-panel-")  # removed as the benchmark ends
    root = folder.name
    print("storage requests per poll (list + reads); naive baseline reads every status: 1 + N")
    print(f"{'hosts':>5}  {'first':>10}  {'quiet':>10}  {'one change':>10}  {'naive':>10}  {'quiet/naive':>11}")
    update_times = {}
    for hosts in (4, 64, 256):
        storage, plan = write_job(root, hosts)
        poller = JobPoller(storage, plan, LocalBackend(), key=None)  # unsigned records: the cost, not the MAC
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
        update_times[hosts] = update_ms(hosts, poller.snapshot())
    print("\nCPU time of one panel update (median of 20)")
    print(f"{'hosts':>5}  {'ms':>7}  {'vs N=4':>7}  {'vs 20 ms goal':>13}")
    for hosts, ms in update_times.items():
        print(f"{hosts:>5}  {ms:7.2f}  {ms / update_times[4]:7.2f}  {ms / 20:13.2f}")
    live_costs()


if __name__ == "__main__":
    main()
