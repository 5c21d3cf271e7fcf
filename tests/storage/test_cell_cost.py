"""A session cell's cost on a bucket does not depend on how many cells came before it.

The notebook's storage requests of a trivial 4-host cell on ``gs://`` (the
emulator), counted as HTTP requests through the notebook's own client, are the
same at cell 5 as at cell 105. The notebook has no route to the session's
channel here (``storage_only``): this is the storage path's cost. Timing is taken out of the count: the cell is
submitted, its hosts are seen idle while nothing is counted (and not through
its handle), and only then is its outcome asked for, so each count holds
exactly one look at the hosts.
"""

from __future__ import annotations

import collections
import re
import time

import pytest

import kinetic_nb
from kinetic_nb.runner import protocol
from kinetic_nb.runner.records import read_host_status, read_log_chunk
from kinetic_nb.storage import gcs as kinetic_gcs

HOSTS = 4
HANG_GUARD_S = 60.0


def _kind(method: str, url: str) -> str:
    """``GET object``, ``GET list``, ``POST upload``, ...: what a request is, not which object."""
    path = url.split("?", 1)[0]
    if "/upload/" in path:
        return f"{method} upload"
    if re.search(r"/b/[^/]+/o/.+", path):
        return f"{method} object"
    if re.search(r"/b/[^/]+/o$", path):
        return f"{method} list"
    return f"{method} {'bucket' if re.search(r'/b/[^/]+$', path) else path}"


class RequestCount:
    """Counts the HTTP requests of this process's storage client while ``on``."""

    def __init__(self, client, monkeypatch):
        self.on = False
        self.kinds: collections.Counter = collections.Counter()
        session = client._http
        real = session.request

        def request(method, url, *args, **kwargs):
            if self.on:
                self.kinds[_kind(method, url)] += 1
            return real(method, url, *args, **kwargs)

        monkeypatch.setattr(session, "request", request)


def _wait_until_idle_on(session, seq: int) -> None:
    """While nothing is counted, and without the cell's handle: every host back to idle after cell ``seq``,
    the leader's output of it stored (its last chunk says it is the cell's last)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        statuses = [read_host_status(session.storage, session.group.key, index) for index in range(HOSTS)]
        chunks = [info.name for info in session.storage.list(f"{protocol.cell_dir(seq)}/log/0/")]
        last = read_log_chunk(session.storage, session.group.key, chunks[-1]) if chunks else None
        if all(status is not None and status.state == "idle" and status.cell == seq for status in statuses) \
                and last is not None and last.end:
            return
        time.sleep(0.05)
    raise AssertionError(f"the hosts were not idle after cell {seq} within {HANG_GUARD_S} s")


def test_a_trivial_cells_requests_are_the_same_at_cell_5_and_cell_105(gcs_root, monkeypatch, storage_only):
    session = kinetic_nb.start(hosts=HOSTS, framework="none", storage=gcs_root, idle_timeout=600, echo=False)
    try:
        # Pages of 50 names, not the API's 1000: a listing that grows with the session's age shows by cell 105.
        monkeypatch.setattr(kinetic_gcs, "LIST_PAGE_SIZE", 50)
        count = RequestCount(kinetic_gcs._client(), monkeypatch)
        counts = {}
        seq = 0
        for measured in (5, 105):
            while seq < measured - 1:
                seq += 1
                earlier = session.run(f"{seq}")
                assert earlier.result(timeout=HANG_GUARD_S) == seq
            earlier.cleanup.result()  # its outcome's deletes, in the background on a bucket: never counted as this cell's
            seq += 1
            count.kinds.clear()
            count.on = True
            cell = session.run(f"{seq}")
            count.on = False
            _wait_until_idle_on(session, seq)
            count.on = True
            assert cell.result(timeout=HANG_GUARD_S) == seq
            cell.cleanup.result()  # its outcome's deletes, in the background on a bucket
            count.on = False
            counts[measured] = dict(count.kinds)
        assert counts[5] == counts[105], counts
        # google-cloud-storage 3.17 would look the bucket up after each 404 (the stop request), from a thread of
        # its own: the notebook's client goes without that.
        assert "GET bucket" not in counts[5], counts
        # Lists: whether the session is up (the hosts' records), one look at the hosts (their records and the
        # cell's, side by side), its cleanup. Reads: the stop request, each host's end of the cell (its own
        # record: the hosts' status.json is stored at most once a second), the leader's output, the outcome (one
        # request, its first chunk being all of it), and the leader's status for the names it holds.
        assert counts[5].get("GET list", 0) <= 4, counts
        assert counts[5].get("GET object", 0) <= 1 + HOSTS + 1 + 1 + 1, counts
    finally:
        session.stop()


@pytest.mark.parametrize("route", ["storage", "channel"])
def test_the_names_the_hosts_hold_are_read_again_after_another_kernels_cell(gcs_root, route, request):
    """The held names a cell is not shipped come from this kernel's last cell only while the leader's status
    is the one that cell read: after another kernel's cell they are read again, so a name that cell bound on
    the hosts is taken from the hosts, not from this notebook. Through the channel, the leader's latest status
    is what the channel carried, whichever kernel's cell it ended."""
    if route == "storage":
        request.getfixturevalue("storage_only")
    session = kinetic_nb.start(hosts=2, framework="none", storage=gcs_root, idle_timeout=600, echo=False)
    try:
        assert session.run("a = 1\na").result(timeout=HANG_GUARD_S) == 1
        other = kinetic_nb.attach_session(session.session_id, storage=gcs_root, echo=False)  # a second kernel
        assert other.run("y = 'bound on the hosts'\ny").result(timeout=HANG_GUARD_S) == "bound on the hosts"
        cell = session.run("y", namespace={"y": "the notebook's"})
        assert cell.result(timeout=HANG_GUARD_S) == "bound on the hosts"
        assert {"a", "y"} <= set(session.held_names())
    finally:
        session.stop()
