"""A warm session's round trips against ipyparallel's warm engines, side by side in one run.

Starts 4 ipyparallel engines (loopback only) and a 4-host local kinetic
session (``framework="jax"``), and prints each figure with its ratio and the
goal from issue 13:

1. trivial cell (``x = 1; x``), median round trip: ``Session.run(...).result()``
   against ``view.execute(..., block=True)``, the two called in turn so that both
   meet the same load; goal <= 1.0x;
   1b. the same with a 4-host ``-b ray`` session on a local 4-node Ray cluster
   (``tests/ray_cluster.py``, one host per node), started for this row and
   stopped after it; no goal, a figure to watch (``--no-ray`` skips it);
2. JAX allgather cell, the engines initialized once with ``jax.distributed``
   as the hosts are (CPU, 4 processes, coordinator on 127.0.0.1); goal <= 1.5x;
3. session start against one one-shot job of the same shape, framework
   included (``submit(..., hosts=4, framework="jax")`` of a trivial JAX cell,
   timed to its result); goal <= 1.2x;
4. a trivial cell with the session's storage on ``gs://`` (a real
   fake-gcs-server), median; goal <= 0.5 s;
   4b. a cell's cost against the session's age on ``gs://``: the median of
   cells 550-600 of a 600-cell session against that of cells 1-50; goal
   <= 1.2x (``--age`` sets the number of cells). The emulator's own requests
   slow down as its bucket fills (its memory backend scans its objects on a
   write or a miss; Cloud Storage does not), so the row compares the old
   session's last 50 cells with the first 50 of a new session in the same
   bucket, the two run in turn: both meet the same emulator, and what is left
   is the session's age alone. The same session's first 50 cells are printed
   beside it, with the emulator's cost of a 404 and a new object before and
   after; 4c. the same on a local disk;
5. the hosts' RSS (psutil on the host processes) before and after 200 more
   trivial cells; goal <= 5% growth;
6. idle CPU per host on a local disk (psutil CPU times over 10 s of no cell,
   after the hosts settle) of a session with no framework: kinetic_nb's own
   cost, goal <= 0.1% per host; 6b. the same for the JAX session, whose
   hosts also run JAX's threads (no goal); each against an idle JAX engine's,
   with the agent's own beside it.

After rows 1 and 2, the trivial cell's hot path, a line per cost (the median
over ``--runs`` cells of the same session, then each feature's own cost
measured alone in this process, median of many): where a warm cell's time
goes (submit; the hosts' payload load, barrier and execute, and back to idle;
the notebook seeing the outcome; reading the value and removing the cell's
outcome objects), and what each feature a cell pays for costs on its own (a
record sealed and verified, a channel frame encrypted and decrypted, a marks
frame taken by a reader, the memory figures, the cell's count of ends that picks
the host that wakes the notebook, the outcome's cleanup).
``--hot-path-only`` runs rows 1 and 2 and these lines alone.

Then the remote table, twice (``--remote-only`` runs them alone): a 4-host
session on ``gs://``, the emulator behind ``benchmarks/delay_proxy.py``, which
delays each request by D; first with the notebook on the session's direct
channel (a loopback forward to its hub, delayed D/2 each way, as a
port-forward to a pod is), then with no channel (the storage-only fallback),
then with the channel on the tests' Kubernetes double (pods played as local
processes, the notebook through the official client's port-forward to the
tests' stand-in of the API server, behind the same delayed forward), then on a
Ray cluster with the channel carried by host 0's actor, as for a notebook off
the cluster's network (``--no-ray`` skips it):

R1. the trivial cell's median at D = 0, 10, 25 and 50 ms, and ``k``, the
    round trips on its critical path (the fit ``t0 + k·D``); goal k <= 3
    with the direct channel, k <= 12 on storage alone;
R2. requests per trivial cell, by kind, at D = 0;
R3. the most writes one object name takes in any one second over 100
    back-to-back cells; goal <= 1 (Cloud Storage answers 429 above it);
R4. requests per idle host per second (the agent's included), over 30 s
    after 10 s with no cell; goal <= 0.1;
R5. a cell after 10 s idle against a back-to-back one, at D = 25 ms; goal
    <= 1.5x.

Everything it starts (engines, sessions, the emulator, the Ray cluster) it stops, also on error.
ipyparallel is a benchmark-only dependency, not the package's (``--remote-only`` needs none):

    pip install ipyparallel
    python benchmarks/session_roundtrip.py [--runs 21] [--starts 3] [--cells 200] [--age 600] [--no-ray]
                                           [--remote-only | --hot-path-only]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' emulator and Ray cluster

import psutil

import kinetic_nb
from benchmarks.delay_proxy import DelayProxy, fit_k, most_writes_per_second
from kinetic_nb.backends import Backend
from kinetic_nb.backends.local import LocalBackend
from kinetic_nb.errors import ObjectNotFoundError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import HostStatus
from kinetic_nb.runner.records import read_host_status, read_record
from kinetic_nb.storage import Storage
from tests.gcs_emulator import GcsEmulator, free_port
from tests.tcp_forward import TcpForward

HOSTS = 4
#: Row 6: how long the hosts are left idle before their CPU is measured, and for how long it is measured.
IDLE_SETTLE_S = 3.0
IDLE_WINDOW_S = 10.0
#: Nodes of the local Ray cluster row 1b runs on: one host per node.
RAY_NODES = HOSTS
BUCKET = "kinetic-bench"
#: Row 4b compares the median of this many cells at the start of a session and at its end.
AGE_WINDOW = 50
TRIVIAL = "x = 1; x"
ALLGATHER = """\
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
float(multihost_utils.process_allgather(jnp.ones(2) * jax.process_index()).sum())"""
#: No round trip takes this long: one that does is a hang, reported as such rather than waited on for ever.
HANG_S = 120.0
#: The one-shot job session start is measured against: the same hosts, JAX initialized, a trivial cell.
ONE_SHOT = "import jax\njax.process_count()"
#: On each engine, as the local backend sets up a host: CPU devices, then jax.distributed across the 4.
ENGINE_JAX_INIT = """\
import os
os.environ['JAX_PLATFORMS'] = 'cpu'
import jax
jax.distributed.initialize(coordinator_address='127.0.0.1:{port}', num_processes={hosts}, process_id=rank)"""


def median_seconds(runs: int, call: Callable[[], object]) -> float:
    """The median wall time of ``runs`` calls, after one unmeasured call (compiles, warms caches)."""
    call()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def paired_medians(runs: int, ours: Callable[[], object], theirs: Callable[[], object]) -> tuple[float, float]:
    """The median wall times of ``ours`` and ``theirs``, called in turn ``runs`` times each (after one
    unmeasured call of each), so both meet the same load on the machine rather than one before the other."""
    ours()
    theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for call, samples in ((ours, times[0]), (theirs, times[1])):
            started = time.perf_counter()
            call()
            samples.append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def timed(call: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    value = call()
    return time.perf_counter() - started, value


def row(name: str, ours: float, theirs: float | None, goal: str, unit: str = "s") -> None:
    """One figure: ours, the baseline's, their ratio, and the goal."""
    if theirs is None:
        print(f"{name:<34} {ours:9.4f} {unit:<3} {'':>22}  goal {goal}")
    else:
        print(f"{name:<34} {ours:9.4f} {unit:<3} vs {theirs:9.4f} {unit:<3} = {ours / theirs:5.2f}x  goal {goal}")


def start_engines(stack: contextlib.ExitStack, workdir: Path) -> ipyparallel.DirectView:
    """4 ipyparallel engines on loopback, each with jax.distributed up (ranks 0..3), stopped by ``stack``."""
    profile = workdir / "ipython"
    profile.mkdir()
    started: list[psutil.Process] = []
    stack.callback(end_processes, started)  # last: an engine's nanny outlives it by seconds
    cluster = ipyparallel.Cluster(n=HOSTS, controller_ip="127.0.0.1", profile_dir=str(profile), log_level=30)
    stack.callback(cluster.stop_cluster_sync)
    client = cluster.start_and_connect_sync()
    stack.callback(client.close)
    stack.callback(client.shutdown, block=True)  # politely first: JAX holds SIGTERM back
    for rank, engine in enumerate(sorted(client.ids)):
        client[engine].push({"rank": rank}, block=True)
    view = client[:]
    view.execute(ENGINE_JAX_INIT.format(port=free_port(), hosts=HOSTS), block=True)
    started.extend(psutil.Process().children(recursive=True))  # controller, engines and their nannies
    return view


def end_processes(processes: list[psutil.Process]) -> None:
    """Wait a moment for ``processes`` to end, then kill what is left."""
    _, alive = psutil.wait_procs(processes, timeout=5)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=5)


def start_session(stack: contextlib.ExitStack, **options) -> kinetic_nb.Session:
    """A 4-host session, stopped by ``stack``."""
    session = kinetic_nb.start(hosts=HOSTS, echo=False, quiet=True, idle_timeout=0, **options)
    stack.callback(session.stop)
    return session


def session_start_vs_one_shot(starts: int) -> tuple[float, float]:
    """Median seconds to a ready session, and to a one-shot job's result; the same shape, JAX included."""
    session_times, job_times = [], []
    for _ in range(starts):
        seconds, session = timed(lambda: kinetic_nb.start(hosts=HOSTS, framework="jax", echo=False, quiet=True))
        session.stop()
        session_times.append(seconds)
        seconds, _ = timed(lambda: kinetic_nb.submit(ONE_SHOT, hosts=HOSTS, framework="jax", quiet=True)
                           .result(timeout=HANG_S))
        job_times.append(seconds)
    return statistics.median(session_times), statistics.median(job_times)


def cpu_percent(processes: list[psutil.Process], seconds: float) -> list[float]:
    """Each process's CPU use over ``seconds``, in percent of one core."""
    before = [sum(process.cpu_times()[:2]) for process in processes]
    time.sleep(seconds)
    return [100 * (sum(process.cpu_times()[:2]) - used) / seconds for process, used in zip(processes, before, strict=True)]


def engine_processes() -> list[psutil.Process]:
    """This process's ipyparallel engines (not their nannies or the controller)."""
    return [child for child in psutil.Process().children(recursive=True)
            if "ipyparallel.engine" in " ".join(child.cmdline()) and "nanny" not in " ".join(child.cmdline())]


def hosts_rss(session: kinetic_nb.Session) -> list[int]:
    """Each host process's resident set size in bytes (their pids from the hosts' status records)."""
    pids = [read_host_status(session.storage, session.group.key, i).pid for i in range(HOSTS)]
    return [psutil.Process(pid).memory_info().rss for pid in pids]


def gcs_trivial_cell(stack: contextlib.ExitStack, workdir: Path, runs: int) -> float:
    """The trivial cell's median round trip on a session whose storage is a real fake-gcs-server."""
    # In memory: the emulator's filesystem backend lists a prefix by walking the whole bucket (a listing of 12
    # objects takes 2 ms in an empty bucket and 125 ms beside 3,000 others), which Cloud Storage does not.
    emulator = stack.enter_context(GcsEmulator(workdir / "emulator", backend="memory"))
    emulator.create_bucket(BUCKET)
    os.environ.update(emulator.environ())  # the hosts inherit it
    session = start_session(stack, framework="none", storage=f"gs://{BUCKET}/kinetic")
    return median_seconds(runs, lambda: session.run(TRIVIAL).result(timeout=HANG_S))


def gcs_cells_by_age(stack: contextlib.ExitStack, cells: int) -> dict[str, float]:
    """Row 4b, on the emulator row 4 started: ``old``, the median of the last AGE_WINDOW of ``cells`` trivial
    cells of one session, each run in turn with one of a session started just before them in the same bucket
    (``new``, their median); ``first``, the old session's own first AGE_WINDOW; and the emulator's cost of a
    404 and a new object before the cells and after them."""
    with contextlib.ExitStack() as own:
        old = start_session(own, framework="none", storage=f"gs://{BUCKET}/kinetic-age")
        before = emulator_cost(old.storage.child("probe"))
        seconds = [timed(lambda: old.run(TRIVIAL).result(timeout=HANG_S))[0] for _ in range(cells - AGE_WINDOW)]
        new = start_session(own, framework="none", storage=f"gs://{BUCKET}/kinetic-age")
        late, fresh = [], []
        for _ in range(AGE_WINDOW):  # in turn: the two meet the emulator as it is at that moment
            late.append(timed(lambda: old.run(TRIVIAL).result(timeout=HANG_S))[0])
            fresh.append(timed(lambda: new.run(TRIVIAL).result(timeout=HANG_S))[0])
        after = emulator_cost(old.storage.child("probe"))
    return {"old": statistics.median(late), "new": statistics.median(fresh),
            "first": statistics.median(seconds[:AGE_WINDOW]), "before": before, "after": after}


def emulator_cost(storage: Storage) -> float:
    """The median time of a read that finds nothing and an exclusive write: two of a cell's kinds of request."""
    def probe() -> None:
        with contextlib.suppress(ObjectNotFoundError):
            storage.read_bytes("missing")
        storage.write_bytes(f"new-{time.perf_counter_ns()}", b"", exclusive=True)
    return median_seconds(9, probe)


def local_cells_by_age(stack: contextlib.ExitStack, cells: int) -> tuple[float, float]:
    """Row 4c: the same on a local disk."""
    with contextlib.ExitStack() as own:
        session = start_session(own, framework="none")
        seconds = [timed(lambda: session.run(TRIVIAL).result(timeout=HANG_S))[0] for _ in range(cells)]
    return statistics.median(seconds[-AGE_WINDOW:]), statistics.median(seconds[:AGE_WINDOW])


def ray_trivial_cells(runs: int, view: ipyparallel.DirectView) -> tuple[float, float]:
    """Row 1b: a ray session's trivial cell against the engines', in turn, on a Ray cluster started and stopped here."""
    from tests.ray_cluster import RayCluster

    with RayCluster(RAY_NODES) as cluster, contextlib.ExitStack() as stack:
        session = start_session(stack, framework="jax", backend="ray", backend_options={"address": cluster.address})
        return paired_medians(runs, lambda: session.run(TRIVIAL).result(timeout=HANG_S), lambda: view.execute(TRIVIAL, block=True))


#: Each feature's own cost on the hot path is the median of this many calls.
FEATURE_CALLS = 300


def hot_path(session: kinetic_nb.Session, runs: int) -> None:
    """A line per cost the trivial cell pays on its way, from ``runs`` cells of ``session`` (medians): the
    stages as the hosts' status records and this notebook's clock tell them, then each feature alone."""
    stages: dict[str, list[float]] = collections.defaultdict(list)
    session.run(TRIVIAL).result(timeout=HANG_S)
    for _ in range(runs):
        started = time.time()
        cell = session.run(TRIVIAL)
        submitted = time.time()
        cell.wait(timeout=HANG_S)
        decided = time.time()
        cell.result(timeout=HANG_S)
        returned = time.time()
        # Each host's end of the cell, as it stored it at once (its status.json follows a moment later).
        statuses = [HostStatus.from_json(read_record(session.storage, session.group.key, protocol.cell_done(cell.seq, i)))
                    for i in range(HOSTS)]
        phases = [dict(status.history) for status in statuses]
        idle = max(status.updated_at for status in statuses)
        stages["submit: the payload sealed and stored, the hosts woken"].append(submitted - started)
        stages["hosts: woken -> the cell's payload loaded"].append(
            max(p.get("start barrier", submitted) for p in phases) - submitted)
        stages["hosts: the cell's barrier"].append(
            max(p.get("execute", submitted) for p in phases) - max(p.get("start barrier", submitted) for p in phases))
        stages["hosts: the cell run, its value stored, back to idle"].append(
            idle - max(p.get("execute", submitted) for p in phases))
        stages["notebook: the last host idle -> the outcome seen"].append(decided - idle)
        stages["notebook: the value read, the outcome's objects removed"].append(returned - decided)
        stages["the whole round trip"].append(returned - started)
    for name, samples in stages.items():
        print(f"   {name:<58} {statistics.median(samples) * 1000:7.2f} ms")
    for name, seconds in feature_costs().items():
        print(f"   {'feature: ' + name:<58} {seconds * 1e6:7.0f} us")


def feature_costs() -> dict[str, float]:
    """Each feature a warm cell pays for, alone in this process: the median seconds of one use."""
    from kinetic_nb.client.host_group import remove_job_objects
    from kinetic_nb.runner import encryption, envelope, marks, memory
    from kinetic_nb.runner.marks import MarkReader
    from kinetic_nb.runner.wakeup import last_to_end
    from kinetic_nb.storage import LocalStorage

    key = os.urandom(32)
    status = b'{"state": "idle", "phase": "execute"}' * 8
    frame = os.urandom(1024)

    def sealed_record() -> None:
        envelope.unseal(key, "hosts/0/status.json", envelope.seal(key, "hosts/0/status.json", status), where="bench")

    def channel_frame() -> None:
        encryption.decrypt(key, "bench", "frame", encryption.encrypt(key, "bench", "frame", frame))

    costs = {"a record sealed and verified (HMAC-SHA256)": median_seconds(FEATURE_CALLS, sealed_record),
             "a channel frame encrypted and decrypted (AES-GCM, 1 KiB)": median_seconds(FEATURE_CALLS, channel_frame),
             "the memory figures": median_seconds(FEATURE_CALLS, memory.measure)}
    read_end, write_end = os.pipe()
    reader = threading.Thread(target=lambda: [MarkReader().feed(data) for data in iter(
        lambda: os.read(read_end, 1 << 16), b"")], daemon=True)
    reader.start()
    marks.attach(write_end)
    try:
        costs["a marks frame sent and taken by a reader thread"] = median_seconds(
            FEATURE_CALLS, lambda: (marks.cell_started(1), marks.taken()))
    finally:
        marks.attach(None)
        os.close(write_end)
        reader.join(5)
        os.close(read_end)
    with tempfile.TemporaryDirectory(prefix="kinetic-bench-cleanup-") as folder:
        root = LocalStorage(folder)
        removals, counts = [], []
        for seq in range(1, FEATURE_CALLS // 10 + 1):  # what a warm 4-host cell leaves in its folder
            cell = root.child(protocol.cell_dir(seq))
            for name in (protocol.PAYLOAD, protocol.RESULT, protocol.LEADER_READY, "log/0/000000.json"):
                cell.write_bytes(name, b"x" * 64)
            for index in range(HOSTS):
                cell.write_bytes(protocol.cell_ready(index), b"")
                cell.write_bytes(f"{protocol.CELL_DONE_PREFIX}{index}", b"{}")
                if index:
                    cell.write_bytes(f"{protocol.CELL_OUTPUT_STORED_PREFIX}{index}", b"")
            ends = cell.local_path(protocol.CELL_ENDS)
            counts.append(timed(lambda ends=ends: [last_to_end(ends, HOSTS) for _ in range(HOSTS)])[0])
            removals.append(timed(lambda cell=cell: remove_job_objects(cell, keep=(
                protocol.PAYLOAD, "log/", protocol.CELL_DONE_PREFIX, protocol.PROFILE_DIR + "/")))[0])
        costs["the cell's count of ends (a byte from each of 4 hosts)"] = statistics.median(counts)
        costs["the outcome's objects removed (a 4-host cell's)"] = statistics.median(removals)
    return costs


#: The delays of the remote table, per request (Cloud Storage answers in tens of milliseconds).
DELAYS_S = (0.0, 0.010, 0.025, 0.050)
REMOTE_BURST = 100
IDLE_FOR_S = 10.0
#: How long R4 counts an idle session's requests, once it has been idle IDLE_FOR_S.
IDLE_MEASURED_S = 30.0


def routed(base: type, *, channel: bool) -> Backend:
    """``base`` (a backend class), its notebook reaching the session's hub by the backend's own route, behind a
    forward delayed D/2 each way (so a round trip over the channel costs D, as one request to storage does); or,
    with ``channel=False``, not at all: the storage-only fallback."""

    class Routed(base):
        forward: TcpForward | None = None

        def channel_route(self, plan, announced):
            if not channel:
                return None
            self.forward = TcpForward(super().channel_route(plan, announced))
            return self.forward.address

    return Routed


def remote_table(stack: contextlib.ExitStack, workdir: Path, runs: int, *, channel: bool,
                 ray_address: str | None = None, kubernetes: bool = False) -> None:
    """Rows R1-R5: a gs:// session behind the delay proxy (its own emulator, in memory), its notebook on the
    direct channel (delayed alike) or on storage alone; on this machine's processes, on a Ray cluster, or on
    the tests' Kubernetes double (pods played as local processes, the notebook through the API's port-forward)."""
    print(("on Ray, through host 0's actor, " if ray_address else "on the Kubernetes double, " if kubernetes else "")
          + ("with the direct channel (its link delayed D/2 each way):" if channel else "on storage alone:"))
    emulator = stack.enter_context(GcsEmulator(workdir / f"emulator-remote-{channel}-{bool(ray_address)}-"
                                               f"{kubernetes}", backend="memory"))
    emulator.create_bucket(BUCKET)
    proxy = stack.enter_context(DelayProxy(emulator))
    stack.callback(os.environ.update, {"STORAGE_EMULATOR_HOST": os.environ.get("STORAGE_EMULATOR_HOST", "")})
    os.environ["STORAGE_EMULATOR_HOST"] = proxy.url  # this notebook's storage client, and the local hosts'
    storage = f"gs://{BUCKET}/remote"
    if ray_address:  # the cluster's processes did not inherit it: the hosts get it as a -e value
        from kinetic_nb.backends.ray import backend as ray_backend

        # As from off the cluster's network (Ray Client): the node's address does not answer, host 0's actor
        # carries the channel.
        stack.enter_context(mock.patch.object(ray_backend, "answers", return_value=False))
        backend = routed(ray_backend.RayBackend, channel=channel)(address=ray_address)
        session = start_session(stack, framework="none", storage=storage, backend=backend,
                                env={"STORAGE_EMULATOR_HOST": proxy.url})
        # its actors cannot read the emulator themselves: the backend removes what they would have
        stack.callback(backend.cleanup, session.plan)
    elif kubernetes:
        backend, session = kubernetes_double_session(stack, workdir, storage, channel=channel)
    else:
        backend = routed(LocalBackend, channel=channel)()
        session = start_session(stack, framework="none", storage=storage, backend=backend)
    session.run("None").result(timeout=HANG_S)
    assert (session.channel is not None) == channel, "the channel is not as this table says"

    def cell() -> float:
        return timed(lambda: session.run(TRIVIAL).result(timeout=HANG_S))[0]

    def delay(seconds: float) -> None:
        proxy.delay_s = seconds
        if backend.forward is not None:
            backend.forward.one_way_s = seconds / 2

    medians = []
    for seconds in DELAYS_S:
        delay(seconds)
        cell()
        medians.append(statistics.median(cell() for _ in range(runs)))
    t0, k = fit_k(list(DELAYS_S), medians)
    print("R1. trivial cell on gs:// at D = " + ", ".join(f"{d * 1000:g}" for d in DELAYS_S) + " ms: "
          + ", ".join(f"{m:.3f}" for m in medians) + f" s; fit {t0:.3f} s + k·D, k = {k:.1f}  goal <= "
          + ("3 (the direct channel)" if channel else "12 (storage alone)"))

    delay(0.0)
    time.sleep(2)  # past the hosts' busy looks: what follows is the cells'
    mark = proxy.mark()
    for _ in range(REMOTE_BURST):
        cell()
    burst = proxy.since(mark)
    kinds = collections.Counter(request.kind for request in burst)
    print(f"R2. requests per trivial cell      {len(burst) / REMOTE_BURST:.1f}: "
          + ", ".join(f"{kind} {count / REMOTE_BURST:.1f}" for kind, count in kinds.most_common()))
    most, name = most_writes_per_second(burst)
    print(f"R3. most writes of one object in 1 s over {REMOTE_BURST} cells: {most} ({name})  goal <= 1")

    delay(0.025)
    back_to_back = statistics.median(cell() for _ in range(runs))
    after_idle = []
    for attempt in range(3):
        time.sleep(IDLE_FOR_S)  # the hosts' looks for the next cell slow down to their idle pace
        if attempt == 0:  # idle: what an idle session costs, the agent's requests included
            mark = proxy.mark()
            time.sleep(IDLE_MEASURED_S)
            idle = proxy.since(mark)
            print(f"R4. idle requests per host per s   {len(idle) / IDLE_MEASURED_S / HOSTS:.3f} over seconds "
                  f"{IDLE_FOR_S:g}-{IDLE_FOR_S + IDLE_MEASURED_S:g} of idleness "
                  f"({collections.Counter(r.kind for r in idle).most_common()})  goal <= 0.1")
        after_idle.append(cell())
    row("R5. cell after 10 s idle, D=25 ms", statistics.median(after_idle), back_to_back, "<= 1.5x")


def kubernetes_double_session(stack: contextlib.ExitStack, workdir: Path, storage: str, *,
                              channel: bool) -> tuple[Backend, kinetic_nb.Session]:
    """A session on the kubernetes backend whose API is the tests' double and whose pods are real agents here;
    its host 0's pod address does not answer this notebook (as from a laptop), so it goes through the API
    server's port-forward (the official client's, to the tests' stand-in)."""
    from kinetic_nb.backends.kubernetes.backend import KubernetesBackend, KubernetesSettings
    from tests.backends.k8s_cluster import FakeKubernetes, session_on_pods
    from tests.backends.k8s_port_forward import PortForwardServer

    namespace = "bench"
    api = FakeKubernetes()
    forward = stack.enter_context(contextlib.closing(PortForwardServer(namespace)))
    api.core.connect_get_namespaced_pod_portforward = forward.core().connect_get_namespaced_pod_portforward
    backend = routed(KubernetesBackend, channel=channel)(
        KubernetesSettings(namespace=namespace, image="registry.example/kinetic:bench"), api=api)
    log_dir = Path(tempfile.mkdtemp(prefix="pods-", dir=workdir))
    session, kubelet = session_on_pods(api, lambda: kinetic_nb.start(
        hosts=HOSTS, backend=backend, storage=storage, framework="none", idle_timeout=3600, echo=False,
        quiet=True, ready_timeout=HANG_S), str(log_dir), pod_ip="192.0.2.1",
        extra_env={"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]})
    stack.callback(kubelet.close)
    stack.callback(session.stop)
    forward.pods = {pod["metadata"]["name"]: "127.0.0.1" for pod in kubelet.pods}
    return backend, session


def remote_tables(stack: contextlib.ExitStack, workdir: Path, runs: int, *, ray: bool) -> None:
    """The remote table with the channel and on storage alone; with the channel on the Kubernetes double; and,
    unless ``ray`` is False, with the channel on a Ray cluster started here (the hub on host 0's node)."""
    for channel in (True, False):
        with contextlib.ExitStack() as table:
            remote_table(table, workdir, runs, channel=channel)
    with contextlib.ExitStack() as table:
        remote_table(table, workdir, runs, channel=True, kubernetes=True)
    if ray:
        from tests.ray_cluster import RayCluster

        with RayCluster(RAY_NODES) as cluster, contextlib.ExitStack() as table:
            remote_table(table, workdir, runs, channel=True, ray_address=cluster.address)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=21, help="cells per median (at least 21 for the goals)")
    parser.add_argument("--starts", type=int, default=3, help="session starts and one-shot jobs per median")
    parser.add_argument("--cells", type=int, default=200, help="trivial cells between the two RSS readings")
    parser.add_argument("--age", type=int, default=600, help="cells of the gs:// session of row 4b")
    parser.add_argument("--no-ray", action="store_true", help="skip row 1b and the Ray remote table (a local Ray cluster)")
    parser.add_argument("--remote-only", action="store_true", help="only the remote table (rows R1-R5)")
    parser.add_argument("--hot-path-only", action="store_true",
                        help="only rows 1 and 2 and the trivial cell's hot path, a line per cost")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each row as it is measured, also into a file
    workdir = Path(tempfile.mkdtemp(prefix="kinetic-bench-"))
    os.environ["KINETIC_STORAGE"] = str(workdir / "jobs")
    if args.remote_only:  # kinetic_nb alone: no engines
        print(f"{HOSTS} hosts; medians of {args.runs} cells; {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f} at the start")
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, workdir, ignore_errors=True)
            remote_tables(stack, workdir, args.runs, ray=not args.no_ray)
        return
    global ipyparallel
    try:
        import ipyparallel
    except ImportError:
        sys.exit("session_roundtrip.py needs ipyparallel (a benchmark-only dependency): pip install ipyparallel "
                 "(--remote-only runs without it)")
    print(f"{HOSTS} hosts; ipyparallel {ipyparallel.__version__} engines vs a local kinetic session; "
          f"medians of {args.runs} cells, {args.starts} starts; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        view = start_engines(stack, workdir)
        session = start_session(stack, framework="jax")

        row("1. trivial cell round trip", *paired_medians(args.runs, lambda: session.run(TRIVIAL).result(timeout=HANG_S),
                                                          lambda: view.execute(TRIVIAL, block=True)), "<= 1.0x")
        if not args.no_ray:
            row("1b. trivial cell, ray session", *ray_trivial_cells(args.runs, view), "none (a figure)")
        row("2. JAX allgather cell", *paired_medians(args.runs, lambda: session.run(ALLGATHER).result(timeout=HANG_S),
                                                     lambda: view.execute(ALLGATHER, block=True)), "<= 1.5x")
        print("the trivial cell's hot path, a line per cost:")
        hot_path(session, args.runs)
        if args.hot_path_only:
            return

        started, one_shot = session_start_vs_one_shot(args.starts)
        row("3. session start vs one-shot job", started, one_shot, "<= 1.2x")

        row("4. trivial cell through gs://", gcs_trivial_cell(stack, workdir, args.runs), None, "<= 0.5 s")
        aged = gcs_cells_by_age(stack, args.age)
        window = f"cells {args.age - AGE_WINDOW}-{args.age} vs 1-{AGE_WINDOW}"
        row(f"4b. gs:// {window}", aged["old"], aged["new"], "<= 1.2x")
        print(f"{'':<34} (against a new session's first cells, in turn, in the same bucket; against the same "
              f"session's own first cells {aged['old'] / aged['first']:.2f}x, while the emulator's cost of a 404 "
              f"and a new object grew {aged['before'] * 1000:.1f} -> {aged['after'] * 1000:.1f} ms)")
        row(f"4c. local disk {window}", *local_cells_by_age(stack, args.age), "<= 1.2x")

        before = hosts_rss(session)
        for _ in range(args.cells):
            session.run(TRIVIAL).result(timeout=HANG_S)
        after = hosts_rss(session)
        growth = max(a / b - 1 for a, b in zip(after, before, strict=True))
        print(f"{'5. host RSS over ' + str(args.cells) + ' trivial cells':<34} "
              f"{sum(before) / 2**20:7.1f} MiB -> {sum(after) / 2**20:7.1f} MiB (4 hosts); "
              f"largest growth of one host {growth:+.1%}  goal <= 5%")

        # kinetic_nb's own idle cost on a session with no framework; then the JAX session's, whose hosts also
        # run JAX's own threads (its distributed client's heartbeats), as the engines do.
        plain = start_session(stack, framework="none")
        plain.run(TRIVIAL).result(timeout=HANG_S)
        time.sleep(IDLE_SETTLE_S)  # past the hosts' busy look after a cell
        for name, measured in (("6. idle CPU per host", plain), ("6b. the same, JAX session", session)):
            hosts = [psutil.Process(read_host_status(measured.storage, measured.group.key, i).pid) for i in range(HOSTS)]
            ours = cpu_percent([*hosts, hosts[0].parent()], IDLE_WINDOW_S)
            theirs = cpu_percent(engine_processes(), IDLE_WINDOW_S)
            print(f"{name:<34} {max(ours[:-1]):9.3f} %   vs {max(theirs, default=float('nan')):9.3f} % (an idle JAX "
                  f"engine); the agent {ours[-1]:.3f} %  goal <= 0.1% per host"
                  + ("" if measured is plain else " (none: JAX's own threads)"))

        remote_tables(stack, workdir, args.runs, ray=not args.no_ray)


if __name__ == "__main__":
    main()
