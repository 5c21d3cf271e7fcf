"""A warm session's cells from 8 to 1,024 hosts, against ipyparallel's warm engines where they start (issue 41).

For each N of ``--hosts`` (8, 16, 32, 64 and 128 by default), a local
session of N hosts (``kinetic_nb.start(hosts=N, framework="none")``) and N
ipyparallel engines on loopback (started once, grown as N grows, stopped
before the light hosts; each engine given minutes to register and the
controller a lenient heartbeat, so that 128 of them come up on a small
machine); for each N of ``--light``
(256 and 1,024 by default) the session alone, with ``KINETIC_LIGHT_HOSTS=1``
(a session of more than 512 local hosts needs it). Per N:

- a trivial cell (``x = 1; x``), a cell printing one line per host, and a
  failing cell (the last host raises; timed to the exception): the median of
  ``--cells`` warm cells, the session's and the engines' (DirectView's and
  BroadcastView's, the best of the two) called in turn, so that all meet the
  same load on the machine; the ratio, goal <= 1.0x;
- the notebook's CPU per trivial cell (psutil on this process, over
  ``--cells`` cells of the session alone; the ipyparallel client's beside it);
- on ``gs://`` (a real fake-gcs-server, reached directly, every request the
  notebook, the agent and the hosts make counted from its own log by
  ``benchmarks/delay_proxy.RequestLog``), for each N of ``--gcs-hosts`` (the N run up to 64 by default): a
  trivial cell's median, the storage requests per trivial cell, and the
  requests per second of the session idle: counted over one idle heartbeat
  period (65 s) once a 10 s window has had at most a few requests (the cells'
  stores, which a busy bucket answers late, have landed); what came between
  the last cell and that period beyond its rate is the cells', counted in the
  requests per cell and said apart.

Then the table, and the growth exponent of each kind of cell: the slope of
the least-squares line of log(time) on log(hosts), over the N from 64 up
(over every N run when fewer than two of them are 64 or more, and said so);
goal <= 1.1 from 64 to 1,024 hosts.

Every process it starts (engines, controller, sessions, emulator) it
stops, also on Ctrl-C or SIGTERM (a second Ctrl-C while it cleans up is
ignored). ipyparallel is a benchmark-only dependency, not the package's
(``--no-ipyparallel`` needs none):

    python benchmarks/scale.py [--hosts 8,16,32,64,128] [--light 256,1024] [--gcs-hosts 8,16]
                               [--cells 7] [--no-ipyparallel] [--no-gcs] [--start-timeout 900]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' emulator, the request log

import psutil

import kinetic_nb
from benchmarks.delay_proxy import Request, RequestLog
from kinetic_nb.agent.local_state import AgentState
from kinetic_nb.agent.processes import process_start
from kinetic_nb.backends.local import agent_files
from kinetic_nb.client import plan as client_plan
from kinetic_nb.errors import KineticError
from kinetic_nb.runner.status import IDLE_HEARTBEAT_INTERVAL_S
from tests.gcs_emulator import GcsEmulator

TRIVIAL = "x = 1; x"
#: The kinds of cell, in the order each round runs them.
KINDS = ("trivial", "print", "fail")
#: Issue 41's goals: a cell against ipyparallel's at the same N, and the growth exponent from FIT_FROM hosts up.
GOAL_RATIO = 1.0
GOAL_EXPONENT = 1.1
FIT_FROM = 64
#: No cell or start takes this long, even at 1,024 hosts on two cores: one that does is a hang, said as such.
HANG_S = 600.0
#: Sessions stop themselves after this long without a cell, should this process be SIGKILLed.
IDLE_TIMEOUT_S = 900.0
#: ipyparallel's engines on a loaded machine: how long each may take to register with the controller (5 s by
#: default: under load, some gave up), the wait for N of them (60 s by default: 60 of 64 were ready), and the
#: controller's missed heartbeats (3 s apart) before it drops an engine that is busy starting its peers.
ENGINE_REGISTRATION_S = 300.0
ENGINE_WAIT_S_PER_ENGINE = 3.0
ENGINE_WAIT_MIN_S = 120.0
HEARTBEAT_MISSES = 100
#: The gs:// figures: the pause after the warm-up cell (past the hosts' busy looks), and the idle session's pause
#: after its last cell. Then the cells' own stores, which a busy bucket answers late (2 a host a cell at 1,024 hosts
#: here, drained at the emulator's pace for 30 s and more), are waited out: windows of ``QUIET_WINDOW_S`` until one
#: has at most ``IDLE_NOISE`` requests (at most ``QUIET_WINDOWS_MOST`` of them; an idle cost of a request every
#: second or more never gets there, and is said so). The idle rate is then counted over one whole idle heartbeat
#: period (every host's agent beats it once in it: ``runner.status.IDLE_HEARTBEAT_INTERVAL_S``), and a little more.
GCS_SETTLE_S = 2.0
IDLE_SETTLE_S = 5.0
QUIET_WINDOW_S = 10.0
QUIET_WINDOWS_MOST = 18
IDLE_NOISE = 5
IDLE_WINDOW_S = IDLE_HEARTBEAT_INTERVAL_S + 5.0
BUCKET = "kinetic-scale"


def kinetic_sources(hosts: int) -> dict[str, str]:
    """Each kind of cell as a session runs it (a host's rank is in its environment)."""
    last = hosts - 1
    return {
        "trivial": TRIVIAL,
        "print": "import os\nprint(f\"host {os.environ['KINETIC_RANK']}: one line\")",
        "fail": f"import os\nif os.environ['KINETIC_RANK'] == '{last}':\n    raise ValueError('host {last} fails')",
    }


def engine_sources(hosts: int) -> dict[str, str]:
    """Each kind of cell as the engines run it (``rank`` pushed to each)."""
    last = hosts - 1
    return {
        "trivial": TRIVIAL,
        "print": "import os\nprint(f'host {rank}: one line')",
        "fail": f"if rank == {last}:\n    raise ValueError('host {last} fails')",
    }


def failing(call: Callable[[], object]) -> Callable[[], None]:
    """``call``, which must raise: the time to its exception is what is measured."""
    def expect_failure() -> None:
        try:
            call()
        except Exception as error:  # any exception is the cell's: kinetic's ValueError, ipyparallel's wrapper of it
            stop_if_interrupted(error)
            return
        raise AssertionError("the failing cell did not fail")
    return expect_failure


#: Pause before each measured call (``--settle``): with it, each side's cell starts once the other's has left
#: the machine (the engines' messages after their answer, the agent's storing after ours), not in the middle.
settle_s = 0.0


def paired_medians(runs: int, calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """The median wall time of each of ``calls``, called in turn ``runs`` times each (after one unmeasured call
    of each), so that all meet the same load on the machine rather than one before the other."""
    for call in calls.values():
        call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            time.sleep(settle_s)
            started = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(times) for name, times in samples.items()}


def cpu_per_call(runs: int, call: Callable[[], object]) -> float:
    """This process's CPU seconds (user and system, every thread) per call, over ``runs`` calls in a row."""
    call()
    this = psutil.Process()
    before = sum(this.cpu_times()[:2])
    for _ in range(runs):
        call()
    return (sum(this.cpu_times()[:2]) - before) / runs


def growth_exponent(points: list[tuple[int, float]]) -> tuple[float, int, int] | None:
    """The slope of log(seconds) on log(hosts) by least squares over the points from FIT_FROM hosts up (over
    all of them when fewer than two are), with the range fitted; None with fewer than two sizes."""
    chosen = [point for point in points if point[0] >= FIT_FROM]
    if len(chosen) < 2:
        chosen = points
    if len({hosts for hosts, _ in chosen}) < 2:
        return None
    slope, _ = statistics.linear_regression([math.log(h) for h, _ in chosen], [math.log(s) for _, s in chosen])
    return slope, min(h for h, _ in chosen), max(h for h, _ in chosen)


# -- processes: started here, stopped here -------------------------------------------------------------------


class Interrupts:
    """Ctrl-C and SIGTERM stop the run once (KeyboardInterrupt); while it cleans up, more are ignored."""

    #: Set by the first: an interrupt that lands in a cell's wait ends that cell as interrupted (a KineticError,
    #: as in a notebook), and the run must stop all the same.
    stopping = False

    def __init__(self) -> None:
        self.raised = False
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.raised:
            print("scale.py: still stopping what it started", file=sys.stderr, flush=True)
            return
        self.raised = Interrupts.stopping = True
        print("scale.py: interrupted; stopping everything it started", file=sys.stderr, flush=True)
        raise KeyboardInterrupt


def session_processes(session_id: str) -> list[psutil.Process]:
    """A local session's agent (by its own record: its pid and when it started) and every process under it."""
    state = AgentState.read(agent_files(session_id)[1])
    if state is None or process_start(state.pid) != state.process_start:
        return []
    try:
        agent = psutil.Process(state.pid)
        return [agent, *agent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def end_processes(processes: list[psutil.Process], wait_s: float = 5.0) -> None:
    """Wait a moment for ``processes`` to end, then kill what is left."""
    _, alive = psutil.wait_procs(processes, timeout=wait_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=wait_s)


def stop_session(session: kinetic_nb.Session) -> None:
    """Stop ``session``; kill what of it is left (a local one) when its stop did not end it."""
    said = session.stop("stopped by benchmarks/scale.py")
    left = session_processes(session.session_id)
    if left:
        print(f"  {said}; killing {len(left)} of its processes that are left", flush=True)
        end_processes(left, wait_s=1.0)


@contextlib.contextmanager
def running_session(hosts: int, **options) -> Iterator[kinetic_nb.Session]:
    """A warm session of ``hosts`` hosts with no framework, stopped on the way out whatever happens (one whose
    start failed is stopped by ``start``, and what of it did not end in its stop's wait is killed here)."""
    agents = Path(agent_files("-")[1]).parent
    before = set(agents.glob("*.json"))
    try:
        session = kinetic_nb.start(hosts=hosts, framework="none", idle_timeout=IDLE_TIMEOUT_S, echo=False,
                                   quiet=True, ready_timeout=max(HANG_S, client_plan.DEFAULT_BARRIER_TIMEOUT_S),
                                   **options)
    except BaseException:
        for record in set(agents.glob("*.json")) - before:
            left = session_processes(record.stem)
            if left:
                print(f"  session {record.stem} did not start; killing {len(left)} of its processes that are left",
                      flush=True)
                end_processes(left, wait_s=1.0)
        raise
    try:
        yield session
    finally:
        stop_session(session)


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """``os.environ`` with ``values`` set (None: removed), as it was on the way out."""
    before = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Engines:
    """ipyparallel's controller and engines on loopback, grown to the N asked for; stopped by ``stack``."""

    def __init__(self, stack: contextlib.ExitStack, workdir: Path):
        import ipyparallel

        profile = workdir / "ipython"
        profile.mkdir()
        (profile / "ipengine_config.py").write_text(f"c.IPEngine.timeout = {ENGINE_REGISTRATION_S}\n")
        (profile / "ipcontroller_config.py").write_text(
            f"c.HeartMonitor.max_heartmonitor_misses = {HEARTBEAT_MISSES}\n")
        self.cluster = ipyparallel.Cluster(n=0, controller_ip="127.0.0.1", profile_dir=str(profile), log_level=30)
        stack.callback(self._stop)
        self.cluster.start_controller_sync()
        self.client = self.cluster.connect_client_sync()
        stack.callback(self.client.close)
        self.started = 0
        self.ranked: dict[int, int] = {}

    def views(self, hosts: int) -> tuple[dict[str, Callable[[str], object]] | None, str]:
        """A way to execute a cell on ``hosts`` engines, by DirectView and by BroadcastView (None when they did
        not all register in time), and what it took to have them."""
        if self.started < hosts:
            self.cluster.start_engines_sync(n=hosts - self.started)
            self.started = hosts
        wait_s = max(ENGINE_WAIT_MIN_S, ENGINE_WAIT_S_PER_ENGINE * hosts)
        started = time.monotonic()
        try:
            self.client.wait_for_engines(hosts, timeout=wait_s, interactive=False)
        except TimeoutError:
            return None, f"{len(self.client.ids)} engines of {hosts} ready after {time.monotonic() - started:.0f} s"
        ids = sorted(self.client.ids)[:hosts]
        for rank, engine in enumerate(ids):
            if self.ranked.get(engine) != rank:
                self.client[engine].push({"rank": rank}, block=True)
                self.ranked[engine] = rank
        direct, broadcast = self.client[ids], self.client.broadcast_view(targets=ids)
        return ({"DirectView": lambda source: direct.execute(source, block=True),
                 "BroadcastView": lambda source: broadcast.execute(source, block=True)},
                f"{hosts} engines ready")

    def _stop(self) -> None:
        """Stop the cluster, then end what of it is left: each engine's nanny, which outlives its engine by up to
        a minute, no longer under this process once its engine is gone, so they are all found before the stop."""
        started = []
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "ipyparallel" in " ".join(child.cmdline()):
                    started.append(child)
        try:
            self.cluster.stop_cluster_sync()
        finally:
            end_processes(started)


class Store:
    """A real fake-gcs-server (in memory) that logs every request, counted from its log; the notebook and the
    sessions started while it is up reach it directly (no proxy in Python between: at 1,024 hosts one spent more
    than a core of two and held the hosts' requests up)."""

    def __init__(self, stack: contextlib.ExitStack, workdir: Path):
        # In memory: the emulator's filesystem backend lists a prefix by walking the whole bucket.
        emulator = stack.enter_context(GcsEmulator(workdir / "emulator", backend="memory", log_requests=True))
        emulator.create_bucket(BUCKET)
        self.requests = RequestLog(emulator)
        stack.enter_context(environment(STORAGE_EMULATOR_HOST=emulator.url))


# -- one row ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GcsFigures:
    cell_s: float
    requests_per_cell: float
    kinds_per_cell: dict[str, float]
    idle_per_s: float
    #: The requests per cell answered after its end beyond the idle rate (in ``requests_per_cell``), and the
    #: seconds from the last cell's end to the idle window that settled.
    late_per_cell: float
    settled_after_s: float
    #: Whether the notebook reached the session's hub: without it, cells travel through storage alone.
    channel: bool
    #: Whether the session's requests came to a quiet window before its idle rate was counted (else they never
    #: stopped: the rate then holds what the cells' stores still brought).
    quiet: bool = True


@dataclasses.dataclass
class Row:
    hosts: int
    light: bool
    kinetic: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Per kind of cell: ipyparallel's best median and the view that gave it.
    engines: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)
    engines_note: str = ""
    cpu_s: float = math.nan
    engines_cpu_s: float = math.nan
    gcs: GcsFigures | None = None
    not_run: str = ""
    #: Why the gs:// session of this N did not run (it did not start, say), where it did not.
    gcs_not_run: str = ""


def measure_cells(session: kinetic_nb.Session, hosts: int, runs: int,
                  views: dict[str, Callable[[str], object]] | None, row: Row) -> None:
    """The three kinds of cell, the session's and the engines' in turn; then the notebook's CPU per cell."""
    ours, theirs = kinetic_sources(hosts), engine_sources(hosts)
    for kind in KINDS:
        calls: dict[str, Callable[[], object]] = {
            "kinetic": lambda source=ours[kind]: session.run(source).result(timeout=HANG_S)}
        for name, execute in (views or {}).items():
            calls[name] = lambda execute=execute, source=theirs[kind]: execute(source)
        if kind == "fail":
            calls = {name: failing(call) for name, call in calls.items()}
        medians = paired_medians(runs, calls)
        row.kinetic[kind] = medians.pop("kinetic")
        if medians:
            best = min(medians, key=medians.get)
            row.engines[kind] = (medians[best], best)
    row.cpu_s = cpu_per_call(runs, lambda: session.run(TRIVIAL).result(timeout=HANG_S))
    if views:
        row.engines_cpu_s = cpu_per_call(runs, lambda: views["DirectView"](TRIVIAL))


def measure_gcs(store: Store, hosts: int, runs: int, light: bool) -> GcsFigures:
    """A gs:// session's trivial cell, its requests per cell, and its requests per second idle."""
    log = store.requests
    with environment(KINETIC_LIGHT_HOSTS="1" if light else None), \
            running_session(hosts, storage=f"gs://{BUCKET}/scale-{hosts}") as session:
        session.run(TRIVIAL).result(timeout=HANG_S)
        time.sleep(GCS_SETTLE_S)
        mark = log.mark()
        seconds = []
        for _ in range(runs):
            started = time.perf_counter()
            session.run(TRIVIAL).result(timeout=HANG_S)
            seconds.append(time.perf_counter() - started)
        cells, after_cells, ended = log.since(mark), log.mark(), time.monotonic()
        channel = session.channel is not None
        time.sleep(IDLE_SETTLE_S)
        idle, settled_at, quiet = settled_idle(log)
        late = max(0.0, len(log.since(after_cells)) - len(idle) - len(idle) / IDLE_WINDOW_S * (settled_at - ended))
    kinds = collections.Counter(request.kind for request in cells)
    return GcsFigures(statistics.median(seconds), (len(cells) + late) / runs,
                      {kind: count / runs for kind, count in kinds.most_common()}, len(idle) / IDLE_WINDOW_S,
                      late / runs, settled_at - ended, channel, quiet)


def settled_idle(log: RequestLog) -> tuple[list[Request], float, bool]:
    """An idle session's requests over ``IDLE_WINDOW_S`` once its cells' stores have landed (a window of
    ``QUIET_WINDOW_S`` with at most ``IDLE_NOISE`` requests), when that window began (monotonic), and whether a
    quiet window came. One window of 10 s 5 s after the cells counted 0.133 requests a second per host at 1,024
    hosts, 0.001 at 256, and windows until two agreed 0.121 at 1,024: the cells' status and heartbeat stores,
    drained at the emulator's steady pace; a quiet window then came 40 s after the cells. And a window shorter than
    the idle heartbeat period misses the hosts' idle beats, or catches them all at once."""
    quiet = False
    for _ in range(QUIET_WINDOWS_MOST):
        mark = log.mark()
        time.sleep(QUIET_WINDOW_S)
        if len(log.since(mark)) <= IDLE_NOISE:
            quiet = True
            break
    began, mark = time.monotonic(), log.mark()
    time.sleep(IDLE_WINDOW_S)
    return log.since(mark), began, quiet


def stop_if_interrupted(error: BaseException) -> None:
    """The run stops when ``error`` is what an interrupt made of a cell or a start (a SIGTERM ran on past one)."""
    if Interrupts.stopping:
        raise KeyboardInterrupt from error


def measure_row(hosts: int, light: bool, runs: int, engines: Engines | None, store: Store | None) -> Row:
    """One N: the session's cells (against the engines' where there are engines), then gs:// where asked."""
    row = Row(hosts, light)
    views = None
    if engines is not None and not light:
        views, row.engines_note = engines.views(hosts)
    with contextlib.ExitStack() as stack:
        stack.enter_context(environment(KINETIC_LIGHT_HOSTS="1" if light else None))
        try:
            session = stack.enter_context(running_session(hosts))
        except (KineticError, ValueError) as error:  # a size this machine cannot start: said, and the run goes on
            stop_if_interrupted(error)
            row.not_run = str(error).splitlines()[0]
            return row
        measure_cells(session, hosts, runs, views, row)
    if store is not None:
        try:
            row.gcs = measure_gcs(store, hosts, runs, light)
        except (KineticError, ValueError) as error:  # the local figures stand; the gs:// session is said not to
            stop_if_interrupted(error)
            row.gcs_not_run = str(error).splitlines()[0]
    return row


# -- the table ----------------------------------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return ""
    return f"{seconds * 1000:,.1f} ms" if seconds < 0.1 else f"{seconds * 1000:,.0f} ms"


def ratio(row: Row, kind: str) -> str:
    if kind not in row.engines:
        return ""
    value = round(row.kinetic[kind] / row.engines[kind][0], 2)  # as shown: 1.00x meets the goal
    return f"{value:.2f}x" + ("" if value <= GOAL_RATIO else " !")


def with_ratio(row: Row, kind: str) -> str:
    return ms(row.kinetic[kind]) + (f" ({ratio(row, kind)})" if kind in row.engines else "")


def gcs_cells(gcs: GcsFigures | None) -> str:
    """The table's two gs:// cells: requests per cell (said when the notebook had no channel), idle per second."""
    if gcs is None:
        return " | "
    return f"{gcs.requests_per_cell:.1f}{'' if gcs.channel else ' (no channel)'} | {gcs.idle_per_s:.2f}"


def say_row(row: Row) -> None:
    """The row's figures as soon as they are measured."""
    name = f"{row.hosts} {'light ' if row.light else ''}hosts"
    if row.not_run:
        print(f"{name}: not run: {row.not_run}", flush=True)
        return
    cells = "; ".join(f"{kind} {ms(row.kinetic[kind])}" + (f" vs {ms(row.engines[kind][0])} "
                      f"({row.engines[kind][1]}) = {ratio(row, kind)}" if kind in row.engines else "")
                      for kind in KINDS)
    print(f"{name}: {cells}; notebook CPU per cell {ms(row.cpu_s)}"
          + (f" (ipyparallel's client {ms(row.engines_cpu_s)})" if not math.isnan(row.engines_cpu_s) else "")
          + (f"; ipyparallel: {row.engines_note}" if row.engines_note and not row.engines else ""), flush=True)
    if row.gcs is not None:
        kinds = ", ".join(f"{kind} {count:.1f}" for kind, count in row.gcs.kinds_per_cell.items())
        print(f"{'':{len(name)}}  gs://: cell {ms(row.gcs.cell_s)}, {row.gcs.requests_per_cell:.1f} requests per "
              f"cell ({kinds}"
              + (f"; and {row.gcs.late_per_cell:.1f} answered after it" if row.gcs.late_per_cell >= 0.05 else "")
              + f"), idle {row.gcs.idle_per_s:.2f} requests/s ({row.gcs.idle_per_s / row.hosts:.3f} per host, "
              f"over {IDLE_WINDOW_S:.0f} s from {row.gcs.settled_after_s:.0f} s after the last cell"
              + ("" if row.gcs.quiet else f"; never quiet for {QUIET_WINDOW_S:.0f} s before it") + ")"
              + ("" if row.gcs.channel else "; on storage alone: the notebook had no direct channel"), flush=True)
    if row.gcs_not_run:
        print(f"{'':{len(name)}}  gs://: not run: {row.gcs_not_run}", flush=True)


def print_table(rows: list[Row]) -> None:
    print()
    print("| hosts | ipyparallel, best of DirectView / BroadcastView | kinetic_nb trivial cell | ratio "
          "| print cell (ratio) | failing cell (ratio) | notebook CPU per cell | gs:// requests per cell "
          "| gs:// idle requests/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        hosts = f"{row.hosts:,}" + (" light" if row.light else "")
        if row.not_run:
            print(f"| {hosts} | | not run: {row.not_run} | | | | | | |")
            continue
        trivial = row.engines.get("trivial")
        baseline = ms(trivial[0]) if trivial else f"({row.engines_note})" if row.engines_note else ""
        print(f"| {hosts} | {baseline} | {ms(row.kinetic['trivial'])} | {ratio(row, 'trivial')} "
              f"| {with_ratio(row, 'print')} | {with_ratio(row, 'fail')} | {ms(row.cpu_s)} | {gcs_cells(row.gcs)} |")
    print(f"(! marks a ratio above the goal, {GOAL_RATIO:.1f}x"
          + ("; no channel: the gs:// session's cells went through storage alone, as the notebook could not join "
             "its hub" if any(row.gcs and not row.gcs.channel for row in rows) else "") + ".)")
    print()
    measured = [row for row in rows if not row.not_run]
    for kind in KINDS:
        ours = growth_exponent([(row.hosts, row.kinetic[kind]) for row in measured])
        theirs = growth_exponent([(row.hosts, row.engines[kind][0]) for row in measured if kind in row.engines])
        print(f"growth exponent, {kind} cell: kinetic_nb {exponent_text(ours)}; ipyparallel {exponent_text(theirs)}"
              f"  goal <= {GOAL_EXPONENT} from {FIT_FROM} to 1,024 hosts")
    cpu = growth_exponent([(row.hosts, row.cpu_s) for row in measured])
    print(f"growth exponent, notebook CPU per cell: kinetic_nb {exponent_text(cpu)}")
    gcs = growth_exponent([(row.hosts, row.gcs.requests_per_cell) for row in measured if row.gcs])
    print(f"growth exponent, gs:// requests per cell: kinetic_nb {exponent_text(gcs)}")


def exponent_text(fit: tuple[float, int, int] | None) -> str:
    if fit is None:
        return "(fewer than two sizes)"
    slope, low, high = fit
    note = "" if low >= FIT_FROM else f", not the goal's range: fewer than two sizes from {FIT_FROM} up"
    return f"{slope:.2f} (over {low:,}-{high:,} hosts{note})"


def sizes(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected host counts separated by commas, got {text!r}") from None
    if any(value < 2 for value in values):
        raise argparse.ArgumentTypeError(f"host counts must be at least 2, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=sizes, default=[8, 16, 32, 64, 128],
                        help="local hosts, side by side with as many ipyparallel engines")
    parser.add_argument("--light", type=sizes, default=[256, 1024],
                        help="light local hosts, the session alone (KINETIC_LIGHT_HOSTS=1)")
    parser.add_argument("--gcs-hosts", type=sizes, default=None,
                        help="the N (of those run) also measured on gs:// (default: those up to 64)")
    parser.add_argument("--cells", type=int, default=7, help="cells per median, of each kind")
    parser.add_argument("--no-ipyparallel", action="store_true", help="the sessions alone")
    parser.add_argument("--no-gcs", action="store_true", help="no gs:// figures (no emulator)")
    parser.add_argument("--start-timeout", type=float, default=900.0, metavar="SECONDS",
                        help="how long a session's hosts may take to start (a plan's own is 300 s: a thousand hosts "
                             "on gs:// take longer on a small machine)")
    parser.add_argument("--settle", type=float, default=0.0, metavar="SECONDS",
                        help="pause before each measured call, so that neither side's cell meets the other's tail")
    args = parser.parse_args()
    if args.cells < 1:
        parser.error("--cells must be at least 1")
    if not args.settle >= 0:
        parser.error(f"--settle must be a number of seconds, 0 or more, got {args.settle}")
    if not args.start_timeout > 0:
        parser.error(f"--start-timeout must be a number of seconds, more than 0, got {args.start_timeout}")
    global settle_s
    settle_s = args.settle
    client_plan.DEFAULT_BARRIER_TIMEOUT_S = args.start_timeout  # read as each session's plan is made
    on_gcs = set() if args.no_gcs else set(args.gcs_hosts or [n for n in args.hosts + args.light if n <= FIT_FROM])
    if not args.no_ipyparallel:
        try:
            import ipyparallel
        except ImportError:
            sys.exit("scale.py needs ipyparallel (a benchmark-only dependency): pip install ipyparallel "
                     "(--no-ipyparallel runs the sessions alone)")
    sys.stdout.reconfigure(line_buffering=True)  # each row as it is measured, also into a file
    interrupts = Interrupts()
    workdir = Path(tempfile.mkdtemp(prefix="kinetic-scale-"))
    os.environ["KINETIC_STORAGE"] = str(workdir / "jobs")
    print(f"hosts {', '.join(map(str, args.hosts)) or '-'}; light hosts {', '.join(map(str, args.light)) or '-'}; "
          f"gs:// at {', '.join(map(str, sorted(on_gcs))) or '-'}; medians of {args.cells} cells; "
          + ("" if args.no_ipyparallel else f"ipyparallel {ipyparallel.__version__}; ")
          + f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    rows: list[Row] = []
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, workdir, ignore_errors=True)
            store = Store(stack, workdir) if on_gcs else None
            with contextlib.ExitStack() as engine_stack:  # stopped before the light hosts, which need the memory
                engines = None if args.no_ipyparallel or not args.hosts else Engines(engine_stack, workdir)
                for hosts in args.hosts:
                    rows.append(measure_row(hosts, False, args.cells, engines, store if hosts in on_gcs else None))
                    say_row(rows[-1])
            for hosts in args.light:
                rows.append(measure_row(hosts, True, args.cells, None, store if hosts in on_gcs else None))
                say_row(rows[-1])
    except BaseException as error:
        if not isinstance(error, KeyboardInterrupt) and not Interrupts.stopping:
            raise
        print("scale.py: stopped" + ("; what was measured so far:" if rows else ""), file=sys.stderr)
    finally:
        interrupts.raised = True  # what is left is printing
        if rows:
            print_table(rows)


if __name__ == "__main__":
    main()
