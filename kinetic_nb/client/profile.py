"""A profiled cell's hosts' traces, merged into one Chrome trace (``--profile``, ``runner.profiling``).

Each host stored ``profile/host-{rank}.json.gz``, sealed under the cell's key:
its framework's trace and, on its own clock, when it passed the cell's
barrier and when it entered the cell's annotation. The merged trace has one
process per host (``host 2``, or ``host 1, process 0 (rank 2)``), each
framework process and thread of that host a thread of it, and every host's
events placed relative to its own barrier exit: host clocks differ, but the
hosts leave the barrier together. kinetic_nb's own track on each host marks
the barrier (0) and the cell's span.

A host that left no record (killed, lost) is a process with no events, named
as such, and said in the summary; a record that does not verify is never read.
The merged file is this user's: written 0600 next to the notebook (the
kernel's working directory, or the directory ``--profile-dir`` names), where
the notebook's file browser shows it and a link in the cell's output opens it,
named after the cell and the time (``profile-In5-20261203-202213.trace.json``);
never into the job's storage, where anyone who may write there could replace it
after the merge; nothing reads it back (a handle asked again merges the hosts'
verified records again). Perfetto's UI (https://ui.perfetto.dev) and
``chrome://tracing`` open it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import html
import json
import os
import pathlib
import re
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from kinetic_nb.client.waiting import wait_for
from kinetic_nb.errors import IntegrityError, ObjectNotFoundError
from kinetic_nb.runner import envelope, protocol
from kinetic_nb.storage import Storage

__all__ = ["MergedProfile", "merge_records", "merged_profile", "trace_path"]

#: The merged trace is this user's only: the file's mode, in a directory only this user may enter.
TRACE_MODE = 0o600
#: Creates the merged trace's temporary file: new (never one someone put there), never through a link.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: How long the notebook waits for a host still running to store its record.
GATHER_WAIT_S = 10.0
GATHER_LOOK_S = 0.1
#: kinetic_nb's own track in each host's process.
KINETIC_TRACK = 0
#: Events that link across tracks by id: their ids are made unique per host.
_FLOW_PHASES = frozenset("stf")
#: What a trace's file name keeps of the cell's name: ``In[5]`` -> ``In5`` (no brackets for a shell to glob).
_UNSAFE_IN_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


def trace_path(cell: str, directory: str | os.PathLike | None = None, when: float | None = None) -> pathlib.Path:
    """Where a cell's merged trace goes: ``{directory}/profile-In5-20261203-202213.trace.json``.

    Parameters
    ----------
    cell : str
        The cell as the notebook names it (``In[5]``, or ``kinetic In[5]``), else its job id.
    directory : str or path-like, optional
        Where to put it (``--profile-dir``); created if missing. Default: the kernel's working
        directory, which is the notebook's own, so its file browser shows the trace.
    when : float, optional
        The time it names (seconds since the epoch); default now.

    Returns
    -------
    pathlib.Path
    """
    folder = pathlib.Path(directory if directory is not None else os.getcwd()).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    name = _UNSAFE_IN_NAME.sub("", cell.removeprefix("kinetic ").replace("/", "-")) or "cell"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if when is None else when))
    return folder / f"profile-{name}-{stamp}.trace.json"


@dataclasses.dataclass(frozen=True)
class MergedProfile:
    """Where a cell's merged trace is, which hosts it has a framework trace of, and why the others have none."""

    #: A file on this machine, 0600, next to the notebook (or where ``--profile-dir`` said); never the job's storage.
    path: str
    traced: tuple[int, ...]
    #: Rank to why its host has no framework trace in it.
    missing: dict[int, str]
    framework: str
    #: The cell as the notebook names it (``In[5]``); "" when not known.
    cell: str = ""

    def shown_path(self, start: str | None = None) -> str:
        """The trace's path as the notebook's user reads it: relative to ``start`` (default: the kernel's working
        directory, the notebook's) when it lies below it, else absolute."""
        relative = os.path.relpath(self.path, start or os.getcwd())
        return self.path if relative.startswith(os.pardir) else relative

    def describe(self, name_of: Callable[[int], str] = lambda rank: f"host {rank}", start: str | None = None
                 ) -> list[str]:
        """What the cell's output says of it: where it is, how to open it, and the hosts it lacks (grouped by why)."""
        hosts = len(self.traced)
        of = f" of {self.cell}" if self.cell else ""
        if hosts:
            head = (f"kinetic_nb: profile{of} on {hosts} host{'s' if hosts != 1 else ''} ({self.framework}), one "
                    f"process per host, aligned on the cell's barrier: {self.shown_path(start)}")
        else:
            head = (f"kinetic_nb: profile{of} with no framework trace, each host's barrier and cell span only: "
                    f"{self.shown_path(start)}")
        lines = [head, "  open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing"]
        by_reason: dict[str, list[int]] = {}
        for rank, why in sorted(self.missing.items()):
            by_reason.setdefault(why, []).append(rank)
        for why, ranks in by_reason.items():
            names = [name_of(rank) for rank in ranks]
            plain = all(name == f"host {rank}" for name, rank in zip(names, ranks, strict=True))
            who = protocol.hosts_named(ranks) if plain else "; ".join(names)
            lines.append(f"  {who}: {why}")
        return lines

    def notice(self, name_of: Callable[[int], str] = lambda rank: f"host {rank}", start: str | None = None
               ) -> dict[str, str]:
        """The cell's notice as a display bundle (``display(bundle, raw=True)``): the lines of :meth:`describe` as
        text, and as HTML where the path is a link relative to the notebook, which JupyterLab opens."""
        lines = self.describe(name_of, start)
        shown = self.shown_path(start)
        link = (f'<a href="{html.escape(urllib.parse.quote(shown))}" target="_blank">{html.escape(shown)}</a>'
                if not os.path.isabs(shown) else f"<code>{html.escape(shown)}</code>")
        head = html.escape(lines[0].removesuffix(shown)) + link
        rest = "".join(f"<div>{html.escape(line.strip())}</div>" for line in lines[1:])
        return {"text/plain": "\n".join(lines),
                "text/html": f'<div style="font-family:monospace"><div>{head}</div>{rest}</div>'}


def read_records(storage: Storage, key: bytes, world_size: int, host_done: Callable[[int], bool],
                 wait_s: float = GATHER_WAIT_S) -> tuple[dict[int, dict], dict[int, str]]:
    """Each host's verified record, waiting up to ``wait_s`` for hosts that have not ended; ``(records, why)``
    where ``why`` says, for each rank without one, what stopped it."""
    records: dict[int, dict] = {}
    why: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    waiting = list(range(world_size))
    done: dict[int, bool] = {}

    def look() -> list[int]:
        """One look at every host still waited on; those still waited on after it."""
        nonlocal waiting
        done.update({rank: host_done(rank) for rank in waiting})  # asked before the look: a host stores, then ends
        for rank in waiting:
            try:
                body = envelope.read_sealed(storage, protocol.host_profile(rank), key)
                records[rank] = json.loads(gzip.decompress(body))
            except ObjectNotFoundError:
                pass
            except (IntegrityError, OSError, ValueError) as error:  # never read past a failed check
                why[rank] = f"its profile was not read ({str(error).splitlines()[0]})"
        waiting = [rank for rank in waiting if rank not in records and rank not in why]
        return waiting

    wait_for(look, lambda left: not left or all(done[rank] for rank in left) or time.monotonic() > deadline,
             max_pause=GATHER_LOOK_S)
    for rank in waiting:
        why[rank] = "left no profile (it ended before it could store one: killed, or lost)" if done[rank] else \
            f"stored no profile within {wait_s:g} s"
    return records, why


def _events(trace: Any) -> list[dict]:
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace if isinstance(trace, list) else []
    return [event for event in events if isinstance(event, dict) and "ph" in event]


def _offset(record: dict, events: list[dict], trace: Any) -> float | None:
    """What to add to the framework's ``ts`` (µs) to place an event relative to this host's barrier exit."""
    marker = (record["marker_at"] - record["barrier_at"]) * 1e6
    for event in events:
        if event.get("name") == record.get("annotation") and event.get("ph") in ("X", "B") and "ts" in event:
            return marker - float(event["ts"])  # the annotation began at marker_at on this host's clock
    base = trace.get("baseTimeNanoseconds") if isinstance(trace, dict) else None
    if isinstance(base, (int, float)):  # torch's ts are µs after this epoch time
        return base / 1000 - record["barrier_at"] * 1e6
    return None


def _host_events(rank: int, record: dict, name: str, cell: str = "") -> tuple[list[dict], str]:
    """A host's events, as a process of the merged trace; and why its framework trace is not among them."""
    begin = (record["marker_at"] - record["barrier_at"]) * 1e6
    end = (record["ended_at"] - record["barrier_at"]) * 1e6
    events = [{"ph": "M", "pid": rank, "name": "process_name", "args": {"name": name}},
              {"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}},
              {"ph": "M", "pid": rank, "tid": KINETIC_TRACK, "name": "thread_name", "args": {"name": "kinetic_nb"}},
              {"ph": "i", "s": "t", "pid": rank, "tid": KINETIC_TRACK, "ts": 0.0, "name": "barrier passed"},
              {"ph": "X", "pid": rank, "tid": KINETIC_TRACK, "ts": begin, "dur": max(0.0, end - begin),
               "name": cell or f"cell {record.get('seq', '')}".strip()}]
    trace = record.get("trace")
    framework_events = _events(trace)
    if not framework_events:
        return events, record.get("problem") or "its trace is empty"
    offset = _offset(record, framework_events, trace)
    if offset is None:
        return events, f"its {record.get('framework')} trace lacks the cell's annotation, so it cannot be placed"
    processes: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for event in framework_events:
        if event["ph"] == "M" and event.get("name") == "process_name":
            processes.setdefault(event.get("pid"), str(event.get("args", {}).get("name", event.get("pid"))))
        elif event["ph"] == "M" and event.get("name") == "thread_name":  # torch may name a thread twice: the first stays
            threads.setdefault((event.get("pid"), event.get("tid")), str(event.get("args", {}).get("name")))
    tracks: dict[tuple[Any, Any], int] = {}

    def track(event: dict) -> int:
        """The host's thread for the framework's (process, thread), named after both, numbered from 1."""
        place = (event.get("pid"), event.get("tid"))
        if place not in tracks:
            tracks[place] = len(tracks) + 1
            label = f"{processes.get(place[0], place[0])} / {threads.get(place, f'thread {place[1]}')}"
            events.append({"ph": "M", "pid": rank, "tid": tracks[place], "name": "thread_name",
                           "args": {"name": label}})
        return tracks[place]

    for event in framework_events:
        if event["ph"] == "M":
            continue  # the host's process is named above; the framework's process and thread names label its tracks
        placed = dict(event, pid=rank, tid=track(event))
        if isinstance(event.get("ts"), (int, float)):
            placed["ts"] = float(event["ts"]) + offset
        if event["ph"] in _FLOW_PHASES and "id" in event:
            placed["id"] = f"{rank}:{event['id']}"
        if placed.get("s") == "g":
            placed["s"] = "p"  # an instant for the whole trace becomes its host's
        events.append(placed)
    return events, ""


def merge_records(records: dict[int, dict], world_size: int, name_of: Callable[[int], str],
                  missing: dict[int, str], cell: str = "") -> tuple[dict, dict[int, str]]:
    """The merged Chrome trace of the hosts' records, and why each rank without a framework trace has none;
    ``cell`` names each host's span of the cell (``In[5]``; default ``cell {seq}``)."""
    events: list[dict] = []
    why = dict(missing)
    for rank in range(world_size):
        if rank not in records:
            events.append({"ph": "M", "pid": rank, "name": "process_name",
                           "args": {"name": f"{name_of(rank)} (no profile)"}})
            continue
        host, problem = _host_events(rank, records[rank], name_of(rank), cell)
        events.extend(host)
        if problem:
            why[rank] = problem
    frameworks = sorted({record.get("framework") for record in records.values() if record.get("framework")})
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"kinetic_nb": "one process per host; microseconds since that host passed the cell's "
                                         "barrier", "frameworks": ", ".join(frameworks),
                           "missing": {str(rank): text for rank, text in sorted(why.items())}}}
    return trace, why


def _write_private(path: str, data: bytes) -> None:
    """``data`` as the file ``path``, mode 0600, whole or not at all: a new file beside it, renamed over it."""
    directory, name = os.path.split(path)
    temp = os.path.join(directory, f".{name}.{os.urandom(8).hex()}")
    fd = os.open(temp, _CREATE_FLAGS, TRACE_MODE)
    try:
        with open(fd, "wb") as file:
            file.write(data)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def merged_profile(storage: Storage, key: bytes, world_size: int, name_of: Callable[[int], str],
                   host_done: Callable[[int], bool], local_copy: str, wait_s: float = GATHER_WAIT_S, *,
                   cell: str = "") -> MergedProfile:
    """Read the hosts' verified records of a profiled cell in ``storage`` (its folder), merge them, and write the
    merged trace, 0600, to ``local_copy`` (:func:`trace_path`: next to the notebook, named after the cell);
    gzipped where its name ends in ``.gz``, plain JSON (which JupyterLab opens) otherwise. ``cell`` is the cell
    as the notebook names it (``In[5]``), for the trace's spans and the notice.

    Nothing is written to ``storage``: anyone who may write there could replace the trace after the merge.
    """
    records, unread = read_records(storage, key, world_size, host_done, wait_s)
    cell = cell.removeprefix("kinetic ")
    trace, why = merge_records(records, world_size, name_of, unread, cell)
    data = json.dumps(trace).encode()
    _write_private(str(local_copy), gzip.compress(data, compresslevel=5) if str(local_copy).endswith(".gz") else data)
    traced = tuple(rank for rank in sorted(records) if rank not in why)
    frameworks = sorted({record.get("framework") for record in records.values() if record.get("framework")})
    return MergedProfile(path=str(local_copy), traced=traced, missing=why, framework=", ".join(frameworks), cell=cell)
