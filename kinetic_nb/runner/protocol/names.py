"""Every name a job's objects are stored under (the layout in ``runner.protocol``), and their parsers."""

from __future__ import annotations

import re

from kinetic_nb.errors import StorageError

PLAN = "plan.json"
PAYLOAD = "payload.pkl"
LEADER_READY = ".leader_ready"
RESULT = "result.pkl"
HANDLE = "handle.json"
#: Where a session's hub listens (``runner.channel``), sealed: written by the leader's agent once it listens.
CHANNEL = "channel.json"
#: What steers every host's agent: one listing of this prefix per look, whatever the number of hosts.
CONTROL_DIR = "control"
CANCEL = f"{CONTROL_DIR}/cancel.json"
FAILED = f"{CONTROL_DIR}/failed.json"
OUTPUTS_DIR = "outputs"
HOSTS_DIR = "hosts"
#: What a pod installs before its agent starts (the prebuilt-image mode), each object signed:
#: ``install.json`` names the others (the notebook's kinetic_nb wheel, the user's requirements).
ENVIRONMENT_DIR = "environment"
ENVIRONMENT_INSTALL = f"{ENVIRONMENT_DIR}/install.json"
#: The notebook's folder, zipped, encrypted and sealed, for hosts that do not share its disk (``runner.workdir``).
WORKDIR = f"{ENVIRONMENT_DIR}/workdir.zip"

LEADER_INDEX = 0

_WORKER_RESULT_RE = re.compile(r"^result-worker-(\d+)\.pkl$")
_HOST_OBJECT_RE = re.compile(r"^hosts/(\d+)/(status\.json|exit\.json|heartbeat|log/(\d+)\.json|stacks/(\d+)\.txt)$")
_STACKS_REQUEST_RE = re.compile(r"^control/stacks-(\d+)\.json$")

def worker_result(host_index: int) -> str:
    """Name of the failure payload of non-leader host ``host_index``."""
    return f"result-worker-{host_index}.pkl"


def result_object(host_index: int) -> str:
    """Name of the payload host ``host_index`` writes (``result.pkl`` for the leader)."""
    return RESULT if host_index == LEADER_INDEX else worker_result(host_index)


def host_status(host_index: int) -> str:
    return f"{HOSTS_DIR}/{host_index}/status.json"


def host_heartbeat(host_index: int) -> str:
    return f"{HOSTS_DIR}/{host_index}/heartbeat"


def host_exit(host_index: int) -> str:
    return f"{HOSTS_DIR}/{host_index}/exit.json"


def host_log_prefix(host_index: int) -> str:
    return f"{HOSTS_DIR}/{host_index}/log/"


def host_log_chunk(host_index: int, seq: int) -> str:
    return f"{host_log_prefix(host_index)}{seq:06d}.json"


def host_stacks(host_index: int, seq: int) -> str:
    """Where host ``host_index``'s agent puts its answer to stacks request ``seq``."""
    return f"{HOSTS_DIR}/{host_index}/stacks/{seq:06d}.txt"


def stacks_request(seq: int) -> str:
    return f"{CONTROL_DIR}/stacks-{seq:06d}.json"


def parse_stacks_request(name: str) -> int | None:
    """The sequence number of a ``control/stacks-{seq}.json`` name, else None."""
    match = _STACKS_REQUEST_RE.match(name)
    return int(match.group(1)) if match else None


def parse_worker_result(name: str) -> int | None:
    """The host index of a ``result-worker-{i}.pkl`` name, else None."""
    match = _WORKER_RESULT_RE.match(name)
    return int(match.group(1)) if match else None


def parse_host_object(name: str) -> tuple[int, str, int | None] | None:
    """Split ``hosts/{i}/...`` into (host index, kind, sequence).

    ``kind`` is ``"status"``, ``"exit"``, ``"heartbeat"``, ``"log"`` or
    ``"stacks"`` (the last two with their sequence number); other names give None.
    """
    match = _HOST_OBJECT_RE.match(name)
    if not match:
        return None
    if match.group(3) is not None:
        return int(match.group(1)), "log", int(match.group(3))
    if match.group(4) is not None:
        return int(match.group(1)), "stacks", int(match.group(4))
    kind = {"status.json": "status", "exit.json": "exit", "heartbeat": "heartbeat"}[match.group(2)]
    return int(match.group(1)), kind, None


# -- sessions: a slice kept up across cells ------------------------------------------------------

SESSIONS_DIR = "sessions"
CELLS_DIR = "cells"


def cell_dir(seq: int) -> str:
    """Where cell ``seq`` of a session keeps its payload and its outcome."""
    return f"{CELLS_DIR}/{seq:06d}"


#: What the name of a host's marker at a cell's barrier begins with, inside the cell's directory.
CELL_READY_PREFIX = "ready-"


def cell_ready(host_index: int) -> str:
    """Host ``host_index`` has loaded the cell and waits at its barrier (inside the cell's directory)."""
    return f"{CELL_READY_PREFIX}{host_index}"


#: What the name of a host's end of a cell begins with, inside the cell's directory.
CELL_DONE_PREFIX = "done-"


_CELL_RECORD_RE = re.compile(r"^(?:cells/(\d+)/|control/cell-(\d+)-)")


def cell_of(name: str) -> int | None:
    """The cell a session's record belongs to (one in its directory, or its control record), or None."""
    match = _CELL_RECORD_RE.match(name)
    return None if match is None else int(match.group(1) or match.group(2))


_CELL_MARKER_RE = re.compile(r"^cells/(\d+)/(ready-\d+|\.leader_ready)$")


def is_cell_marker(name: str) -> bool:
    """Whether ``name`` is one of a cell's barrier markers (``ready-{i}``, the leader's verdict)."""
    return _CELL_MARKER_RE.match(name) is not None


def cell_marker_seq(name: str) -> int | None:
    match = _CELL_MARKER_RE.match(name)
    return int(match.group(1)) if match else None


_CELL_READY_RE = re.compile(r"^cells/(\d+)/ready-(\d+)$")


def parse_cell_ready(name: str) -> tuple[int, int] | None:
    """``cells/{seq}/ready-{i}`` (host ``i`` has loaded cell ``seq``: ``cell_ready``) as (cell, host index); other
    names give None."""
    match = _CELL_READY_RE.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def cell_done(seq: int, host_index: int) -> str:
    """Host ``host_index``'s status as cell ``seq`` left it (its own name each cell, so written at once where
    ``status.json`` is stored at most once a second: a notebook reading storage sees the cell end without
    waiting for it)."""
    return f"{cell_dir(seq)}/{CELL_DONE_PREFIX}{host_index}"


_CELL_DONE_RE = re.compile(r"^cells/(\d+)/done-(\d+)$")


def parse_cell_done(name: str) -> tuple[int, int] | None:
    """``cells/{seq}/done-{i}`` as (cell, host index); other names give None."""
    match = _CELL_DONE_RE.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


#: What the name of a host's "output stored" marker begins with, inside a cell's directory.
CELL_OUTPUT_STORED_PREFIX = "output-"

#: In a cell's directory on a local disk: a byte appended by each host once it has stored its end of the cell (no
#: record: it says nothing anyone reads but its length). The host whose byte completes it wakes the notebooks, one
#: wake per cell where each host's was one (``runner.wakeup.last_to_end``).
CELL_ENDS = "ends"


def cell_output_stored(seq: int, host_index: int) -> str:
    """Host ``host_index``'s output of cell ``seq`` is all stored (an empty marker its agent writes on a local
    disk once it has stored the cell's last chunk, or found nothing more to store): a notebook shows each host's
    last line as it is, not as far as the agent got."""
    return f"{cell_dir(seq)}/{CELL_OUTPUT_STORED_PREFIX}{host_index}"


def cell_log_chunk(seq: int, host_index: int, chunk: int) -> str:
    """Host ``host_index``'s output during cell ``seq``, numbered from 0 in each cell: a cell's feed lists
    (or looks up) its own chunks only, however many cells came before it."""
    return f"{cell_dir(seq)}/log/{host_index}/{chunk:06d}.json"


_CELL_LOG_RE = re.compile(r"^cells/(\d+)/log/(\d+)/(\d+)\.json$")


def parse_cell_log_chunk(name: str) -> tuple[int, int, int] | None:
    """``cells/{seq}/log/{i}/{n}.json`` as (cell, host index, chunk number); other names give None."""
    match = _CELL_LOG_RE.match(name)
    return (int(match.group(1)), int(match.group(2)), int(match.group(3))) if match else None


def cell_control(seq: int, what: str) -> str:
    """``control/cell-{seq}-{what}.json``: ``submitted`` (a cell is waiting), ``failed``, ``interrupt``."""
    return f"{CONTROL_DIR}/cell-{seq:06d}-{what}.json"


_CELL_CONTROL_RE = re.compile(r"^control/cell-(\d+)-(\w+)\.json$")


def parse_cell_control(name: str) -> tuple[int, str] | None:
    match = _CELL_CONTROL_RE.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def post_mortem_request(seq: int, rank: int, number: int) -> str:
    """The notebook's ``number``-th question (from 1) to ``rank`` about its failure in cell ``seq``
    (``%kinetic pm``): an expression to evaluate in the failing frame it keeps until its next cell."""
    return f"{cell_dir(seq)}/post-mortem/{rank}-{number}.json"


def post_mortem_answer(seq: int, rank: int, number: int) -> str:
    """``rank``'s answer to that question: the value's text, or the error the expression raised."""
    return f"{cell_dir(seq)}/post-mortem/{rank}-{number}-answer.json"


#: Where a profiled cell's records go, inside its folder (a one-shot job's root, a session's ``cells/{seq}``).
PROFILE_DIR = "profile"


#: Where an earlier kinetic_nb stored the merged Chrome trace, unsigned, beside the hosts' records: anyone who may
#: write there could replace it. Nothing writes or reads it now (``client.profile`` writes the merged trace to the
#: user's own cache); the name stays so that such a leftover is known for what it is.
PROFILE_MERGED = f"{PROFILE_DIR}/trace.json.gz"


def host_profile(rank: int) -> str:
    """Process ``rank``'s profile of the cell (``runner.profiling``): gzipped JSON, sealed under the cell's key."""
    return f"{PROFILE_DIR}/host-{rank}.json.gz"


# -- what a name is, in a user's words ------------------------------------------------------------------------

_OBJECT_WORDS = {
    PLAN: "the job's plan",
    PAYLOAD: "the cell's code",
    RESULT: "the cell's value",
    HANDLE: "the job's record",
    CHANNEL: "the session's channel address",
    LEADER_READY: "the hosts' start verdict",
    CANCEL: "the stop request",
    FAILED: "the record of the first failure",
    ENVIRONMENT_INSTALL: "the hosts' install list",
    WORKDIR: "the notebook's folder",
    CELL_ENDS: "the hosts' count of their ends of the cell",
}
_HOST_OBJECT_WORDS = {"status": "state", "exit": "end", "heartbeat": "heartbeat", "log": "output",
                      "stacks": "stacks"}
_FOLDER_WORDS = {CONTROL_DIR: "the job's requests", HOSTS_DIR: "the hosts' records", OUTPUTS_DIR: "the hosts' files",
                 ENVIRONMENT_DIR: "the hosts' environment", PROFILE_DIR: "the profile", CELLS_DIR: "the session's cells"}
_CELL_PREFIX_RE = re.compile(r"^cells/\d+/?")
_HOST_FOLDER_RE = re.compile(r"^(?:hosts/(\d+)|log/(\d+))/")
_NUMBERED_RE = re.compile(r"^(ready|done|output)-(\d+)$")


def object_words(name: str) -> str:
    """What a stored object (or folder) is, as a user would say it, for messages that must not name storage
    objects: ``cells/000002/payload.pkl`` -> ``"the cell's code"``, ``hosts/3/exit.json`` -> ``"host 3's end"``."""
    if _CELL_PREFIX_RE.match(name):
        name = _CELL_PREFIX_RE.sub("", name)
        if not name:
            return "the cell's records"
    if name in _OBJECT_WORDS:
        return _OBJECT_WORDS[name]
    worker = parse_worker_result(name)
    if worker is not None:
        return f"host {worker}'s failure"
    host_object = parse_host_object(name)
    if host_object is not None:
        return f"host {host_object[0]}'s {_HOST_OBJECT_WORDS[host_object[1]]}"
    numbered = _NUMBERED_RE.match(name)
    if numbered:
        what = {"ready": "arrival at the start", "done": "end of the cell", "output": "output"}[numbered.group(1)]
        return f"host {numbered.group(2)}'s {what}"
    host_folder = _HOST_FOLDER_RE.match(name)
    if host_folder:
        return f"host {host_folder.group(1) or host_folder.group(2)}'s output"
    cell_control_record = parse_cell_control(name)
    if cell_control_record is not None:
        return {"submitted": "the cell's submission", "failed": "the cell's first failure",
                "interrupt": "the interrupt request"}.get(cell_control_record[1], "the cell's requests")
    if parse_stacks_request(name) is not None:
        return "a request for the hosts' stacks"
    if name.startswith("post-mortem/"):
        return "a post-mortem question"
    return _FOLDER_WORDS.get(name.split("/", 1)[0], "the job's records")


_STORAGE_VERBS = {"write": "store", "create": "store", "metadata": "read", "read": "read", "list": "list",
                  "delete": "delete"}


def storage_error_words(error: StorageError) -> str:
    """A storage error as the notebook says it: what could not be done to what, where, and why, never an object's
    name (``cannot store the cell's code in gs://b/kinetic/sessions/ks-...: its storage has not answered ...``);
    its message where the storage did not say what it was asked."""
    if not error.op:
        return str(error)
    return (f"cannot {_STORAGE_VERBS.get(error.op, error.op)} {object_words(error.name)} in {error.where}: "
            f"{error.reason}")
