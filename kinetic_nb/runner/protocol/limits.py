"""How large each kind of stored record may be: a reader reads at most that much before it verifies.

Storage is not trusted: anyone who may write there can put a gigabyte where a
host's status belongs. Every reader of a record (``runner.records``,
``runner.envelope.read_sealed``, the poller, the catalog) asks
:func:`record_limit` for the object's name and reads at most that many bytes;
a record over its limit is refused like one that does not verify, without
being read. Each limit sits far above what kinetic_nb's own writers produce,
so only a planted object meets it.

Pickles (a cell's payload, the hosts' results) have no limit here: they are
the user's values, of any size, and are verified as a stream
(``envelope.verify_file``) without being held whole. The shipped folder's
reader passes its own bound (``runner.workdir``).
"""

from __future__ import annotations

import re

__all__ = ["RECORD_LIMITS", "record_limit"]

_KIB = 1024
_MIB = 1024 * _KIB

#: (kind, pattern on the object's name below a job's, a session's or a cell's folder, most bytes), each with why.
#: The first pattern that matches names the kind; a name that none matches has no limit here.
RECORD_LIMITS: tuple[tuple[str, re.Pattern[str], int], ...] = (
    # A plan or a handle is a few hundred bytes (a few KiB with many -e names or backend options).
    ("plan", re.compile(r"(^|/)plan\.json$"), 64 * _KIB),
    ("handle", re.compile(r"(^|/)handle\.json$"), 64 * _KIB),
    # A host's status: its traceback, its failing frames' variables (each value cut to
    # runner.frame_locals.MAX_VALUE_CHARS), a session's names: a few hundred KiB for a deep traceback in a large
    # namespace. A cell's end (done-{i}) is the same record.
    ("status", re.compile(r"(^|/)hosts/\d+/status\.json$|(^|/)cells/\d+/done-\d+$"), 8 * _MIB),
    # An exit record: a code or signal and the last 20 stderr lines, each cut to 1000 characters by the agent.
    ("exit", re.compile(r"(^|/)hosts/\d+/exit\.json$"), 1 * _MIB),
    # A log chunk holds what a host printed in half a second (runner.logs.FLUSH_INTERVAL_S), at most
    # runner.logs.MAX_CHUNK_CHARS (4 Mi characters, up to 6 bytes each once JSON-escaped), and at most one display
    # record of runner.marks.MAX_FRAME_BYTES (64 MiB, JSON-escaped once more): twice that is room enough.
    ("log chunk", re.compile(r"(^|/)hosts/\d+/log/\d+\.json$|(^|/)cells/\d+/log/\d+/\d+\.json$"), 128 * _MIB),
    # Every thread's Python stack on a host: a few KiB a thread, thousands of threads at most.
    ("stacks", re.compile(r"(^|/)hosts/\d+/stacks/\d+\.txt$"), 16 * _MIB),
    # A host's profile of one cell (gzipped JSON): a framework's trace of a long cell runs to tens of MiB.
    ("profile", re.compile(r"(^|/)profile/host-\d+\.json\.gz$"), 128 * _MIB),
    # A post-mortem answer: a repr cut to runner.post_mortem.MAX_CHARS (10,000 characters), JSON-escaped.
    # A question is one expression the user typed.
    ("post-mortem", re.compile(r"(^|/)cells/\d+/post-mortem/\d+-\d+(-answer)?\.json$"), 1 * _MIB),
    # What steers hosts and agents: a cancel, a failure's first line, a stacks request, a cell's submission,
    # interrupt or failure, the start verdict, where a session's hub listens: each a few hundred bytes.
    ("control record", re.compile(r"(^|/)control/[^/]+\.json$|(^|/)\.leader_ready$|(^|/)channel\.json$"),
     1 * _MIB),
    # What a pod installs before its agent starts names its other objects: a few hundred bytes.
    ("install record", re.compile(r"(^|/)environment/install\.json$"), 64 * _KIB),
)


def record_limit(name: str) -> tuple[str, int] | None:
    """The kind of record ``name`` is and the most bytes it may hold; None when it has no limit here.

    Parameters
    ----------
    name : str
        The object's name, below a job's, a session's or a cell's folder (``hosts/3/status.json``,
        ``cells/000002/done-1``, ``control/cancel.json``).

    Returns
    -------
    tuple of (str, int), or None
        The kind (as a reader names it in its error) and its limit in bytes; None for a pickle, the shipped
        folder, or any name kinetic_nb does not read as a record.
    """
    for kind, pattern, limit in RECORD_LIMITS:
        if pattern.search(name):
            return kind, limit
    return None
