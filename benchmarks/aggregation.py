"""What deciding a failed job's outcome costs as it grows, and how fast a large result moves.

1. Aggregation: jobs whose N hosts all fail (N = 4, 64, 256), their records in
   a real fake-gcs-server. No host process runs: the records a finished job
   leaves (plan, every host's failure payload as the runner builds it,
   ``hosts/{i}/exit.json`` and ``status.json``) are written straight into the
   emulator, then ``kinetic_nb.client.outcome.resolve_outcome`` decides through a
   storage wrapper that counts payload downloads and listings. Goals: exactly
   one payload download per outcome, and the time at N = 256 under 2x the time
   at N = 4.
2. Transfer: a result of ``--size-mib`` (default 512 MiB) written and read
   back through each storage's streaming API (``write_file``, ``open_read``),
   against ``shutil.copyfile`` of the same bytes on the same disk; and the
   client's peak memory (growth of ru_maxrss, in a fresh process) relative to
   the result's size.
3. Signing: the same result end to end through ``file://`` (pickling,
   writing, reading, verifying, unpickling), signed (``runner.envelope``: the
   MAC computed in the same pass as the write, verified before the unpickle)
   against unsigned, each in a fresh process, with its peak memory. Goal:
   signed >= 0.8x unsigned throughput, peak memory unchanged.

    python benchmarks/aggregation.py [--hosts 4 64 256] [--repeat 15] [--size-mib 512] [--skip-transfer]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import pickle
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import cloudpickle

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' emulator helper

from kinetic_nb.client.outcome import resolve_outcome
from kinetic_nb.errors import ObjectNotFoundError
from kinetic_nb.runner import envelope, protocol
from kinetic_nb.runner.protocol import ExitSummary, HostState, HostStatus, JobPlan, ResultPayload
from kinetic_nb.state import JobStatus
from kinetic_nb.storage import GcsStorage, ObjectInfo, Storage, open_storage
from tests.gcs_emulator import GcsEmulator

BUCKET = "kinetic-bench"
#: The benchmark job's key: its payloads are signed as the hosts sign theirs.
KEY = bytes(range(32))
#: Parallel writers when laying down a job's records (below the client's pool of 10 connections).
WRITERS = 8


class CountingStorage(Storage):
    """Passes everything to ``inner``, counting payload downloads, missing objects and listings."""

    def __init__(self, inner: Storage):
        self.inner = inner
        self.uri = inner.uri
        self.counts: collections.Counter[str] = collections.Counter()

    def child(self, name: str) -> Storage:
        return CountingStorage(self.inner.child(name))

    def write_bytes(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        self.counts["writes"] += 1
        self.inner.write_bytes(name, data, exclusive=exclusive)

    def read_bytes(self, name: str) -> bytes:
        try:
            data = self.inner.read_bytes(name)
        except ObjectNotFoundError:
            self.counts["missing"] += 1
            raise
        self.counts["downloads"] += 1
        return data

    def open_read(self, name: str) -> IO[bytes]:
        try:
            file = self.inner.open_read(name)
        except ObjectNotFoundError:
            self.counts["missing"] += 1
            raise
        self.counts["downloads"] += 1
        return file

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        self.counts["lists"] += 1
        return self.inner.list(prefix)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)


# -- 1. aggregation ------------------------------------------------------------------

#: The outcomes measured: how the leader ended, and what every worker reports.
OUTCOMES = {
    "leader's own failure (rule 1)": "own",
    "leader failed as a consequence (rule 6)": "consequence",
    "leader killed, no payload (rule 4)": "killed",
}


def failure_payload(host: int, error: BaseException) -> bytes:
    """A host's failure payload, built as ``runner/execute.py`` builds it."""
    try:
        raise error
    except BaseException as raised:
        text = "".join(traceback.format_exception(raised))
    return envelope.seal(KEY, protocol.result_object(host), cloudpickle.dumps(ResultPayload(
        success=False,
        exception=cloudpickle.dumps(error),
        exception_type=type(error).__qualname__,
        exception_message=str(error),
        traceback=text,
        phase="execute",
        host_index=host,
    ).to_dict()))


def write_failed_job(storage: Storage, hosts: int, leader: str) -> tuple[JobPlan, dict[int, ExitSummary]]:
    """Lay down the records of a finished ``hosts``-host job whose every host failed."""
    plan = JobPlan(job_id=storage.uri.rsplit("/", 1)[-1], hosts=hosts, accelerator="cpu", devices_per_host=1,
                   framework="none", coordinator_address="127.0.0.1:1",
                   barrier_timeout_s=300.0, heartbeat_timeout_s=30, shutdown_timeout_s=10)
    now = time.time()
    records: dict[str, bytes] = {protocol.PLAN: envelope.seal(KEY, protocol.PLAN, plan.to_json())}
    exits = {}
    for host in range(hosts):
        killed = host == 0 and leader == "killed"
        exits[host] = ExitSummary(host, None if killed else 1, "SIGKILL" if killed else None, ended_at=now)
        records[protocol.host_exit(host)] = exits[host].to_json()
        records[protocol.host_status(host)] = HostStatus(host, HostState.FAILED.value, "execute", now, now, 1000 + host,
                                                         "bench", message="failed").to_json()
        if killed:
            continue
        if host == 0 and leader == "consequence":
            error: BaseException = RuntimeError("gloo: connection closed by peer")
        else:
            error = ValueError(f"host {host} failed on its own")
        records[protocol.result_object(host)] = failure_payload(host, error)
    with concurrent.futures.ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(lambda item: storage.write_bytes(*item), records.items()))
    return plan, exits


def decide(storage: CountingStorage, plan: JobPlan, exits: dict[int, ExitSummary],
           list_job: Callable[[], list[ObjectInfo]]) -> type:
    """Run the outcome rules once; return the exception type they raise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            resolve_outcome(storage, plan, JobStatus.FAILED, exits, list_job, lambda i: "exited with code 1", key=KEY)
        except Exception as error:
            return type(error)
    raise AssertionError("a failed job returned a value")


def measure(inner: Storage, plan: JobPlan, exits: dict[int, ExitSummary], repeat: int,
            own_listing: bool) -> tuple[float, type, collections.Counter, int]:
    """Median milliseconds of one decision, the exception it raises, its counts and HTTP list pages."""
    final_poll = inner.list()  # what JobHandle.result() hands over: the listing that saw the job end
    timings = []
    for _ in range(repeat + 1):  # the first one warms the connection
        storage = CountingStorage(inner)
        list_job = storage.list if own_listing else (lambda: final_poll)
        pages_before = inner.requests["list"] if isinstance(inner, GcsStorage) else 0
        started = time.perf_counter()
        raised = decide(storage, plan, exits, list_job)
        timings.append((time.perf_counter() - started) * 1000)
        pages = (inner.requests["list"] - pages_before) if isinstance(inner, GcsStorage) else 0
    return statistics.median(timings[1:]), raised, storage.counts, pages


def aggregation(emulator: GcsEmulator, host_counts: list[int], repeat: int) -> None:
    print(f"1. outcome of a job whose N hosts all fail, records in fake-gcs-server, one bucket per job "
          f"(median of {repeat})")
    print("   client: the listing comes from the client's last poll (as JobHandle.result() does);"
          " cold: the decision lists the job itself")
    print(f"{'outcome':<40} {'N':>4} {'raises':<11} {'downloads':>9} {'missing':>7} {'lists':>5} {'pages':>5} "
          f"{'client ms':>9} {'vs N=4':>6} {'cold ms':>8} {'vs N=4':>6}")
    for title, leader in OUTCOMES.items():
        base: tuple[float, float] | None = None
        for hosts in host_counts:
            bucket = f"{BUCKET}-{leader}-{hosts}"
            emulator.create_bucket(bucket)
            inner = open_storage(f"gs://{bucket}/job-{hosts}")
            plan, exits = write_failed_job(inner, hosts, leader)
            warm_ms, raised, _, _ = measure(inner, plan, exits, repeat, own_listing=False)
            cold_ms, _, counts, pages = measure(inner, plan, exits, repeat, own_listing=True)
            base = base or (warm_ms, cold_ms)
            print(f"{title:<40} {hosts:>4} {raised.__name__:<11} {counts['downloads']:>9} {counts['missing']:>7} "
                  f"{counts['lists']:>5} {pages:>5} {warm_ms:9.2f} {warm_ms / base[0]:5.2f}x {cold_ms:8.2f} "
                  f"{cold_ms / base[1]:5.2f}x")
    print("   downloads: payloads read (goal: 1); missing: reads of an absent payload; lists: listings the cold\n"
          "   decision asked for; pages: their HTTP requests. Goal: N = 256 under 2x N = 4.")


# -- 2. transfer -----------------------------------------------------------------------

def make_result_file(path: Path, size: int) -> None:
    """A pickled ``bytes`` value of ``size`` random bytes: what a large result.pkl looks like."""
    with open(path, "wb") as file:
        pickle.dump(os.urandom(size), file, protocol=pickle.HIGHEST_PROTOCOL)


def seconds(action: Any) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def copy_out(storage: Storage, name: str, destination: Path) -> None:
    with storage.open_read(name) as source, open(destination, "wb") as target:
        shutil.copyfileobj(source, target, 8 << 20)


def peak_rss() -> int:
    """This process's peak resident memory, in bytes.

    ``VmHWM`` belongs to the current address space; ``ru_maxrss`` would also
    count the parent's memory at the fork that preceded ``exec``.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def probe_memory(uri: str, source: str, destination: str, mode: str) -> dict[str, float]:
    """Run in a fresh process: growth of peak RSS while moving ``source`` through ``uri`` in ``mode``."""
    storage = open_storage(uri)
    storage.write_bytes("warm-up", b"x")  # the client and its connection exist before the baseline
    storage.read_bytes("warm-up")
    before = peak_rss()
    if mode == "stream":
        storage.write_file("result.pkl", source)
        copy_out(storage, "result.pkl", Path(destination))
    elif mode == "load-streamed":
        with storage.open_read("result.pkl") as file:
            value = cloudpickle.load(file)
        del value
    elif mode == "load-bytes":
        value = cloudpickle.loads(storage.read_bytes("result.pkl"))
        del value
    return {"growth": peak_rss() - before}


def memory_growth(uri: str, source: Path, destination: Path, mode: str, env: dict[str, str]) -> int:
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import aggregation; "
            f"print(json.dumps(aggregation.probe_memory({uri!r}, {str(source)!r}, {str(destination)!r}, {mode!r})))")
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(output.splitlines()[-1])["growth"]


def transfer(storages: dict[str, str], size_mib: int, workdir: Path, repeat: int) -> None:
    size = size_mib << 20
    source, copy = workdir / "result.pkl", workdir / "copy.pkl"
    make_result_file(source, size)
    size = source.stat().st_size
    copy_s = float("inf")
    for _ in range(repeat):
        copy_s = min(copy_s, seconds(lambda: shutil.copyfile(source, copy)))
        copy.unlink()
    mib = size / (1 << 20)
    print(f"\n2. a {mib:.0f} MiB result through each storage's streaming API, against shutil.copyfile on the same disk "
          f"(best of {repeat})")
    print(f"   shutil.copyfile: {copy_s:.2f} s, {mib / copy_s:.0f} MiB/s")
    print(f"{'storage':<8} {'write s':>8} {'MiB/s':>7} {'vs copy':>8} {'read s':>8} {'MiB/s':>7} {'vs copy':>8}   "
          f"peak memory growth / result size: stream, cloudpickle.load(open_read), loads(read_bytes)")
    env = dict(os.environ)
    for label, uri in storages.items():
        storage = open_storage(uri)
        write_s = read_s = float("inf")
        for _ in range(repeat):  # the best of a few: the first write of a fresh file is often slow
            write_s = min(write_s, seconds(lambda s=storage: s.write_file("result.pkl", source)))
            read_s = min(read_s, seconds(lambda s=storage: copy_out(s, "result.pkl", copy)))
            assert copy.stat().st_size == size
            copy.unlink()
            storage.delete("result.pkl")
        growth = [memory_growth(uri, source, copy, mode, env) / size for mode in ("stream",)]
        copy.unlink(missing_ok=True)
        growth += [memory_growth(uri, source, copy, mode, env) / size for mode in ("load-streamed", "load-bytes")]
        storage.delete("result.pkl")
        print(f"{label:<8} {write_s:8.2f} {mib / write_s:7.0f} {copy_s / write_s:7.2f}x {read_s:8.2f} "
              f"{mib / read_s:7.0f} {copy_s / read_s:7.2f}x   " + ", ".join(f"{g:.2f}x" for g in growth))
    print("   'vs copy' is throughput relative to shutil.copyfile (1.00x = as fast); memory growth is the rise of\n"
          "   the client process's peak RSS over its size after start-up (the value itself is 1x when loaded)")


# -- 3. signing -----------------------------------------------------------------------

def probe_round_trip(uri: str, size: int, signed: bool) -> dict[str, float]:
    """Run in a fresh process: a ``size``-byte value pickled, stored, read back and unpickled through ``uri``,
    signed or not; seconds for each half and the growth of peak RSS over the value itself."""
    storage = open_storage(uri)
    value = os.urandom(size)
    before = peak_rss()
    started = time.perf_counter()
    if signed:
        envelope.dump_sealed(storage, "result.pkl", KEY, value)
    else:
        with tempfile.TemporaryFile() as spool:  # as the runner wrote results before signing
            cloudpickle.dump(value, spool)
            spool.seek(0)
            storage.write_file("result.pkl", spool)
    wrote = time.perf_counter()
    del value
    if signed:
        back = envelope.load_sealed(storage, "result.pkl", KEY)
    else:
        with storage.open_read("result.pkl") as file:
            back = cloudpickle.load(file)
    read = time.perf_counter()
    assert len(back) == size
    storage.delete("result.pkl")
    return {"write": wrote - started, "read": read - wrote, "growth": peak_rss() - before}


def round_trip(uri: str, size: int, signed: bool, env: dict[str, str]) -> dict[str, float]:
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import aggregation; "
            f"print(json.dumps(aggregation.probe_round_trip({uri!r}, {size}, {signed})))")
    output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(output.splitlines()[-1])


def signing(uri: str, size_mib: int, repeat: int) -> None:
    size = size_mib << 20
    print(f"\n3. a {size_mib} MiB result end to end through {uri.split('://')[0]}:// (pickle, write, read, verify, "
          f"unpickle), signed against unsigned (best of {repeat}, each in a fresh process, the two in turn)")
    print(f"{'':<9} {'write s':>8} {'read s':>7} {'total s':>8} {'MiB/s':>7} {'peak growth / size':>19}")
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for attempt in range(repeat):
        # In turn, and each first half the time: the disk's write-back of one run's bytes slows the next,
        # so neither side may always follow the other.
        for signed in (False, True) if attempt % 2 == 0 else (True, False):
            runs[signed].append(round_trip(uri, size, signed, dict(os.environ)))
    best = {signed: min(done, key=lambda run: run["write"] + run["read"]) for signed, done in runs.items()}
    for signed in (False, True):
        run = best[signed]
        total = run["write"] + run["read"]
        print(f"{'signed' if signed else 'unsigned':<9} {run['write']:8.2f} {run['read']:7.2f} {total:8.2f} "
              f"{size_mib / total:7.0f} {run['growth'] / size:18.2f}x")
    ratio = (best[False]["write"] + best[False]["read"]) / (best[True]["write"] + best[True]["read"])
    print(f"   signed throughput {ratio:.2f}x unsigned (goal >= 0.8x); peak memory growth "
          f"{best[True]['growth'] / max(1, best[False]['growth']):.2f}x unsigned's (goal: unchanged)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--size-mib", type=int, default=512, help="size of the transferred result (default 512)")
    parser.add_argument("--transfer-repeat", type=int, default=2, help="best of this many transfers (default 2)")
    parser.add_argument("--signing-repeat", type=int, default=6,
                        help="signed and unsigned round trips, best of this many each (default 6)")
    parser.add_argument("--skip-transfer", action="store_true", help="only the aggregation part")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kinetic-bench-"))
    try:
        with GcsEmulator(workdir / "emulator") as emulator:
            emulator.create_bucket(BUCKET)
            os.environ.update(emulator.environ())
            aggregation(emulator, args.hosts, args.repeat)
            if not args.skip_transfer:
                storages = {"file://": f"file://{workdir}/jobs", "gs://": f"gs://{BUCKET}/transfer"}
                transfer(storages, args.size_mib, workdir, args.transfer_repeat)
                signing(f"file://{workdir}/signing", args.size_mib, args.signing_repeat)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
