"""What one session hub (``kinetic_nb.runner.channel.Hub``) costs at 64 to 1,024 hosts (issue 41).

For each N of ``--hosts`` (64, 256 and 1,024 by default): a real ``Hub`` in a
process of its own (listening at a Unix socket in a 0700 directory, as a
local session's does), N hosts joined as ``host_role(i)`` from ``--procs``
separate processes (8 by default, N/8 ``Channel``s each, so that the peers'
work is not done in the hub's interpreter), and one notebook peer in this
process. Then ``--cells`` warm cells (after one unmeasured), each the traffic
of a session cell as the protocol names it, with records of about the real
sealed sizes (random bytes: the hub does not open them):

1. the notebook publishes the cell's payload (2 KB), which every host receives;
2. each host says it is ready at the barrier (``ready-{i}``, 200 B), which
   the hub passes to the leader (host 0) and the notebook;
3. once the leader holds every host's ready, it publishes its verdict
   (``.leader_ready``, 300 B), which every host receives;
4. each host then publishes its output chunk (``log/{i}/000000.json``,
   300 B), its ``hosts/{i}/status.json`` (600 B) and its end of the cell
   (``done-{i}``, 400 B, to the leader and the notebook).

Per cell (the median over the measured cells; the mean for the CPU, counted
in the system's ticks of 10 ms):

- hub CPU: the hub process's user+sys CPU over the cell (psutil; trustworthy
  on a loaded machine, unlike wall time);
- frames and bytes the hub sent (its links' counters: every frame is sealed
  for one connection), and the hub process's context switches (its threads'
  wakeups, mostly);
- payload fan-out: from the payload published to the last host holding it;
  verdict fan-out: from the leader's verdict published to the last host
  holding it;
- done to notebook: from the last host's ``done-{i}`` published to the
  notebook holding every host's;

and, once the cells have run, the hub process's threads and resident memory.
Wall-time figures (the latencies) include the peers' and this process's share
of the machine's cores, so on a small machine they say more about the machine
than about the hub. The table gives each figure per host (divided by N) and
its growth exponent: the slope of the least-squares line of log(figure) on
log(hosts), over the N from 64 up; 1.0 is linear in the hosts (a constant per
host), 2.0 quadratic.

Every process it starts it stops, also on Ctrl-C or SIGTERM:

    python benchmarks/hub.py [--hosts 64,256,1024] [--cells 5] [--procs 8]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import multiprocessing
import os
import queue
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from kinetic_nb.runner import protocol
from kinetic_nb.runner.channel import NOTEBOOK, Channel, Hub, Mirror, host_role
from kinetic_nb.runner.job_keys import new_key

#: Sizes of the sealed records, in bytes, about the real ones of a trivial session cell.
SIZES = {"payload": 2048, "ready": 200, "verdict": 300, "output": 300, "status": 600, "done": 400}
#: Growth exponents are fitted over the N from this many hosts up.
FIT_FROM = 64
#: No cell, start or answer takes this long, even at 1,024 hosts on two cores: one that does is a hang.
HANG_S = 300.0
#: Pause before each cell, so that it does not meet the tail of the one before (the hub's senders draining).
SETTLE_S = 0.5


def payload_name(seq: int) -> str:
    return f"{protocol.cell_dir(seq)}/{protocol.PAYLOAD}"


def ready_name(seq: int, host: int) -> str:
    return f"{protocol.cell_dir(seq)}/{protocol.cell_ready(host)}"


def verdict_name(seq: int) -> str:
    return f"{protocol.cell_dir(seq)}/{protocol.LEADER_READY}"


# -- the hub's process ---------------------------------------------------------------------------------------


def context_switches() -> int:
    """This process's context switches, every thread's (``/proc``; psutil counts the main thread's alone)."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[1])
    return total


def hub_process(key: bytes, path: str, hosts: int, conn: Connection) -> None:
    """A hub of ``hosts`` hosts at ``path``; answers ``"stats"`` with its figures until told ``"stop"``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops it
    hub = Hub(key, path, hosts=hosts)
    hub.start()
    this = psutil.Process()
    conn.send(hub.announced)
    try:
        while conn.poll(None):
            command = conn.recv()
            if command == "stop":
                break
            # counting the switches costs CPU: before a cell counted before its CPU is read, after one after
            switches = context_switches() if command == "before" else 0
            frames, sent = hub.sent()
            times = this.cpu_times()
            switches = switches or context_switches()
            conn.send({"cpu": times.user + times.system, "frames": frames, "bytes": sent, "switches": switches,
                       "threads": this.num_threads(), "rss": this.memory_info().rss, "peers": len(hub.peers())})
    except EOFError:  # the driver went
        pass
    finally:
        hub.close()


# -- a process of hosts --------------------------------------------------------------------------------------


class Hosts:
    """``Channel``s of some hosts, in one process, and one thread that plays their part of each cell: what their
    mirrors receive is noted (with the time) by a hook on ``Mirror.put`` and acted on by that thread."""

    def __init__(self, address: str, key: bytes, indices: range, hosts: int, conn: Connection):
        self.hosts = hosts
        self.conn = conn
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.owner: dict[int, int] = {}  # id(mirror) -> host index
        self.channels: dict[int, Channel] = {}
        self.readies: dict[int, set[int]] = {}
        self.received: dict[tuple[int, str], list[float]] = {}
        self.ended: dict[int, int] = {}
        self.verdict_at: dict[int, float] = {}
        self._hook_mirrors()
        for index in indices:
            channel = Channel.open(address, key, host_role(index))
            self.channels[index] = channel
            self.owner[id(channel.mirror)] = index

    def _hook_mirrors(self) -> None:
        original = Mirror.put
        hosts = self

        def put(mirror: Mirror, name: str, data, at: float | None = None) -> None:
            original(mirror, name, data, at)
            index = hosts.owner.get(id(mirror))
            if index is not None:
                hosts.events.put((index, name, at, time.time()))

        Mirror.put = put

    def play(self) -> None:
        """Act on what arrives until the process is stopped."""
        while True:
            index, name, at, when = self.events.get()
            seq = protocol.cell_of(name)
            if seq is None:
                continue
            leaf = name.rsplit("/", 1)[1]
            if leaf == protocol.PAYLOAD:
                self._note(seq, "payload", when)
                self.channels[index].send(ready_name(seq, index), os.urandom(SIZES["ready"]))
            elif leaf == protocol.LEADER_READY:
                self._note(seq, "verdict", when)
                if index == protocol.LEADER_INDEX:
                    self.verdict_at[seq] = at
                self._end_cell(seq, index)
            elif index == protocol.LEADER_INDEX and protocol.is_cell_marker(name):  # a host's ready
                self.readies.setdefault(seq, set()).add(int(leaf.split("-")[1]))
                if len(self.readies[seq]) == self.hosts:
                    self.channels[index].send(verdict_name(seq), os.urandom(SIZES["verdict"]))

    def _note(self, seq: int, what: str, when: float) -> None:
        self.received.setdefault((seq, what), []).append(when)

    def _end_cell(self, seq: int, index: int) -> None:
        channel = self.channels[index]
        channel.send(protocol.cell_log_chunk(seq, index, 0), os.urandom(SIZES["output"]))
        channel.send(protocol.host_status(index), os.urandom(SIZES["status"]))
        channel.send(protocol.cell_done(seq, index), os.urandom(SIZES["done"]))
        self.ended[seq] = self.ended.get(seq, 0) + 1
        if self.ended[seq] == len(self.channels):  # every host here has ended the cell: say when they got it
            self.conn.send({"seq": seq, "payload": max(self.received[(seq, "payload")]),
                            "verdict": max(self.received[(seq, "verdict")]), "verdict_at": self.verdict_at.get(seq)})


def hosts_process(address: str, key: bytes, indices: range, hosts: int, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops it
    part = Hosts(address, key, indices, hosts, conn)
    conn.send("joined")
    threading.Thread(target=part.play, daemon=True).start()
    with contextlib.suppress(EOFError):
        conn.recv()  # "stop", or the driver went


# -- the driver ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    hosts: int
    cpu_s: float
    frames: float
    bytes: float
    switches: float
    payload_s: float
    verdict_s: float
    done_s: float
    threads: int
    rss: int


class Run:
    """One N: the hub's process, the hosts' processes, the notebook's channel; all stopped by :meth:`close`."""

    def __init__(self, hosts: int, procs: int):
        self.hosts = hosts
        self.key = new_key()
        self.directory = tempfile.mkdtemp(prefix="kinetic-hub-")  # 0700
        self.processes: list[multiprocessing.Process] = []
        self.conns: list[Connection] = []
        context = multiprocessing.get_context("spawn")
        self.hub_conn, theirs = context.Pipe()
        hub = context.Process(target=hub_process, args=(self.key, os.path.join(self.directory, "hub.sock"),
                                                         hosts, theirs), daemon=True)
        self._start(hub)
        self.hub_pid = hub.pid
        self.address = self._answer(self.hub_conn).removeprefix("unix:")
        per = math.ceil(hosts / procs)
        for first in range(0, hosts, per):
            mine, theirs = context.Pipe()
            self._start(context.Process(target=hosts_process, daemon=True, args=(
                self.address, self.key, range(first, min(first + per, hosts)), hosts, theirs)))
            self.conns.append(mine)
        for conn in self.conns:
            if self._answer(conn) != "joined":
                raise RuntimeError("a hosts' process did not join")
        self.notebook = Channel.open(self.address, self.key, NOTEBOOK)
        self.arrived: dict[str, float] = {}  # when the notebook got each host's done
        self.dones: dict[int, int] = {}  # how many it got, by cell
        self._note_the_notebooks_dones()

    def _note_the_notebooks_dones(self) -> None:
        """When each host's done reaches the notebook, noted as its channel keeps it (so that waiting for the last
        looks at a count, not at every host's name each time a record arrives)."""
        keep = self.notebook.mirror.put

        def put(name: str, data, at: float | None = None) -> None:
            keep(name, data, at)
            done = protocol.parse_cell_done(name)
            if done is not None:
                self.arrived[name] = time.time()
                self.dones[done[0]] = self.dones.get(done[0], 0) + 1

        self.notebook.mirror.put = put

    def _start(self, process: multiprocessing.Process) -> None:
        self.processes.append(process)
        process.start()

    @staticmethod
    def _answer(conn: Connection):
        if not conn.poll(HANG_S):
            raise RuntimeError(f"no answer in {HANG_S:g} s")
        return conn.recv()

    def stats(self, when: str = "after") -> dict:
        self.hub_conn.send(when)
        return self._answer(self.hub_conn)

    def cell(self, seq: int) -> dict:
        """Run cell ``seq``; its figures."""
        time.sleep(SETTLE_S)
        before = self.stats("before")
        published = time.time()
        self.notebook.send(payload_name(seq), os.urandom(SIZES["payload"]))
        deadline = time.monotonic() + HANG_S
        while self.dones.get(seq, 0) < self.hosts:
            if time.monotonic() > deadline:
                raise RuntimeError(f"cell {seq} did not end in {HANG_S:g} s")
            time.sleep(0.01)
        dones = [protocol.cell_done(seq, index) for index in range(self.hosts)]
        held = max(self.arrived[name] for name in dones)
        last_done = max(at for name, _, _, at in self.notebook.mirror.entries(f"{protocol.cell_dir(seq)}/done-"))
        reports = [self._answer(conn) for conn in self.conns]
        time.sleep(SETTLE_S)  # the hub's last sends (the notebook's copies of what it already holds) drain
        after = self.stats()
        verdict_at = next(report["verdict_at"] for report in reports if report["verdict_at"] is not None)
        return {"cpu": after["cpu"] - before["cpu"], "frames": after["frames"] - before["frames"],
                "switches": after["switches"] - before["switches"],
                "bytes": after["bytes"] - before["bytes"],
                "payload": max(report["payload"] for report in reports) - published,
                "verdict": max(report["verdict"] for report in reports) - verdict_at,
                "done": held - last_done, "threads": after["threads"], "rss": after["rss"]}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.notebook.close()
        for conn in [self.hub_conn, *self.conns]:
            with contextlib.suppress(Exception):
                conn.send("stop")
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(self.directory, ignore_errors=True)


def measure(hosts: int, cells: int, procs: int) -> Row:
    started = time.monotonic()
    run = Run(hosts, procs)
    try:
        print(f"{hosts} hosts joined in {time.monotonic() - started:.1f} s (the hub: process {run.hub_pid})",
              flush=True)
        run.cell(1)  # unmeasured
        figures = [run.cell(seq) for seq in range(2, cells + 2)]
    finally:
        run.close()

    def median(what: str) -> float:
        return statistics.median(figure[what] for figure in figures)

    return Row(hosts, statistics.mean(figure["cpu"] for figure in figures), median("frames"), median("bytes"), median("switches"), median("payload"), median("verdict"),
               median("done"), figures[-1]["threads"], figures[-1]["rss"])


def growth_exponent(points: list[tuple[int, float]]) -> float | None:
    """The slope of log(figure) on log(hosts) by least squares over the N from FIT_FROM up; None with fewer than
    two sizes (or a figure that is not positive)."""
    chosen = [(hosts, value) for hosts, value in points if hosts >= FIT_FROM and value > 0]
    if len({hosts for hosts, _ in chosen}) < 2:
        return None
    slope, _ = statistics.linear_regression([math.log(h) for h, _ in chosen], [math.log(v) for _, v in chosen])
    return slope


#: The table's columns: heading, the figure of a row, its scale and unit in the table, its scale and unit per host.
COLUMNS = [
    ("hub CPU/cell", lambda row: row.cpu_s, 1e3, "ms", 1e3, "ms"),
    ("frames/cell", lambda row: row.frames, 1, "", 1, ""),
    ("bytes/cell", lambda row: row.bytes, 1e-3, "KB", 1, "B"),
    ("context switches/cell", lambda row: row.switches, 1, "", 1, ""),
    ("payload fan-out", lambda row: row.payload_s, 1e3, "ms", 1e3, "ms"),
    ("verdict fan-out", lambda row: row.verdict_s, 1e3, "ms", 1e3, "ms"),
    ("done to notebook", lambda row: row.done_s, 1e3, "ms", 1e3, "ms"),
    ("hub threads", lambda row: row.threads, 1, "", 1, ""),
    ("hub RSS", lambda row: row.rss, 2.0 ** -20, "MiB", 2.0 ** -10, "KiB"),
]


def report(rows: list[Row]) -> None:
    print()
    print(f"{'figure':<26}" + "".join(f"{f'N={row.hosts}':>12}" for row in rows)
          + f"  {'per host':<30}{'exponent':>9}")
    for heading, value, scale, unit, host_scale, host_unit in COLUMNS:
        cells = "".join(f"{value(row) * scale:>12,.1f}" for row in rows)
        per_host = " / ".join(f"{value(row) * host_scale / row.hosts:.3g}" for row in rows)
        exponent = growth_exponent([(row.hosts, value(row)) for row in rows])
        print(f"{heading + (f' ({unit})' if unit else ''):<26}{cells}  {per_host + ' ' + host_unit:<30}"
              f"{'-' if exponent is None else f'{exponent:.2f}':>9}")
    print("\nper host: the figure divided by N, at each N in turn; exponent: the slope of log(figure) on log(N) "
          f"from {FIT_FROM} hosts up (1.0: linear in the hosts, a constant per host)")


def stop(signum: int, frame: object) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("hub.py: interrupted; stopping everything it started", file=sys.stderr, flush=True)
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="64,256,1024", help="comma-separated host counts")
    parser.add_argument("--cells", type=int, default=5, help="measured cells per host count (after one unmeasured)")
    parser.add_argument("--procs", type=int, default=8, help="processes the hosts' channels are spread over")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    rows = []
    for hosts in (int(text) for text in args.hosts.split(",")):
        rows.append(measure(hosts, args.cells, args.procs))
        row = rows[-1]
        print(f"N={hosts}: hub CPU {row.cpu_s * 1e3:.1f} ms/cell, payload fan-out {row.payload_s * 1e3:.1f} ms, "
              f"done to notebook {row.done_s * 1e3:.1f} ms, {row.threads} threads, {row.rss >> 20} MiB", flush=True)
    report(rows)


if __name__ == "__main__":
    main()
