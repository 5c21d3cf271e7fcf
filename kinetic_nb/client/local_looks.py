"""How the poller finds what changed on a local disk without listing the job: a look by name.

A bucket is listed (one request gives every object's version); a local disk is
looked at by name, at the records that may have changed, by the same rules for
a session's cell and a one-shot job: the few records that decide the outcome
(a cell's folder, listed once: each host's marker at its barrier and its end of it; a one-shot job's own
folder: its payloads; the first-failure and cancel records, a stat each), the
leader's output, and a host's records once it ended or failed, at every look;
every host's own records and output every :data:`EVERY_HOST_LOOK_S` (plus
:data:`EVERY_HOST_LOOK_PER_HOST_S` per host; a cell's first such look one
interval in), when a host ended, and once all have. A look's cost follows what
changed, not the slice: at 16 and at 64 hosts a cell costs the notebook the
same stats and reads per host (``tests/test_poller.py``).

:class:`LocalLooks` is a part of :class:`kinetic_nb.client.poller.JobPoller`
(its records, its ``storage``, ``plan`` and ``cell``, and its state of what was
looked at are the poller's): kept apart so that each reads in one sitting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from kinetic_nb.errors import IntegrityError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import FirstFailure
from kinetic_nb.storage import ObjectInfo

logger = logging.getLogger(__name__)

__all__ = ["EVERY_HOST_LOOK_PER_HOST_S", "EVERY_HOST_LOOK_S", "LocalLooks"]

#: A cell on a local disk: how often a look also looks at every host's own records (status, heartbeat, exit) and
#: output. Looks in between read what the cell's folder gained (each host's end of the cell, in one listing), the
#: leader's output and a failing host's, and whether a host ended: a look costs what changed, not the slice.
#: At 1,024 hosts a look at every host takes about 15 ms of the notebook's CPU: 3% of it at this pace.
EVERY_HOST_LOOK_S = 0.5
#: ... plus this much per host: a large slice's cell lasts longer, and its looks at every host must not grow
#: with it, or a cell's reads would grow as the square of the hosts (a look reads each status that changed).
EVERY_HOST_LOOK_PER_HOST_S = 0.001
#: A one-shot job's records in its own folder that a look on a local disk lists (with the failing workers' payloads).
_JOB_FOLDER_RECORDS = (protocol.PLAN, protocol.PAYLOAD, protocol.LEADER_READY, protocol.RESULT, protocol.HANDLE)


class LocalLooks:
    """The looks by name of :class:`~kinetic_nb.client.poller.JobPoller` on a local disk (see the module)."""

    def _look_by_name(self) -> None:
        """A cell on a local disk: one listing of the cell's folder (each host's end of the cell), the leader's
        next output chunks and a failing host's, and one look at the first failure's record; every host's own
        records and output every ``EVERY_HOST_LOOK_S``, when a host ended, and once all are done with the cell.
        As cheap after a thousand cells as after one, and a look's cost follows what changed, not the slice."""
        self.requests["list"] += 1
        found, stored = self._ends_listed()
        ending = self._cell_ended | {parsed[1] for info in found if (parsed := protocol.parse_cell_done(info.name))}
        last = len(ending) == self.plan.world_size and not self._looked_at_every_end
        if last or self._every_host_look_due():
            self._schedule_every_host_look()
            self._looked_at_every_end = self._looked_at_every_end or last
            hosts: range | list[int] = range(self.plan.world_size)
            for index in hosts:
                found += self._host_records_by_name(index)
        elif self._looked_at_every_end:  # the cell's outcome waits for its last output: every host's may come
            hosts = range(self.plan.world_size)
        else:
            hosts = sorted({protocol.LEADER_INDEX} | {index for index in self._cell_ended
                                                       if self._failed_in_cell(index)})
        for index in sorted(set(hosts) | stored):  # a host whose output is all stored: looked for to the end
            if index not in self.output_complete:
                found += self._chunks_by_name(index)
        self._absorb(found)
        self.output_complete |= stored

    def _look_at_job_by_name(self) -> None:
        """A one-shot job on a local disk, by a session cell's rules (``_look_by_name``): one listing of the job's
        own folder (the leader's payload and each failing worker's: what the outcome rules read), its cancel and
        first-failure records, the hosts' exit records in order up to the first host still running, the leader's
        output, and every record of a host whose payload is stored, or that failed first, until its end is read;
        every host's records and output every ``EVERY_HOST_LOOK_S``, when a host failed, and once all have ended
        (a host's once more after its end was read, and then no more). A look's cost follows what changed, not
        the slice."""
        self.requests["list"] += 1
        folder = self._job_folder_listed()
        found = [info for info in [self._stat_by_name(protocol.CANCEL)] if info is not None]
        failed_first = self._first_failure_moved()
        if failed_first is not None:
            self._follow_first_failure(failed_first)
        ended = self._ends_in_order()
        last = self._ended_below == self.plan.world_size and not self._looked_at_every_end
        if last or failed_first is not None or time.monotonic() >= self._every_host_look_at:
            self._schedule_every_host_look()
            self._looked_at_every_end = self._looked_at_every_end or last
            hosts = [index for index in range(self.plan.world_size) if index not in self._read_to_the_end]
        else:
            hosts = sorted(ended | self._hosts_ending(folder))
        for index in hosts:  # its records before its output: a host's output is all stored before its end
            found += self._host_records_by_name(index)
        for index in sorted({protocol.LEADER_INDEX, *hosts} - self._read_to_the_end):
            found += self._chunks_by_name(index)
        self._looked_at.update((info.name, info) for info in found)
        self._listing = folder
        self._absorb(found)
        self._read_to_the_end.update(index for index in hosts if self.records[index].exit is not None)

    def _job_folder_listed(self) -> list[ObjectInfo]:
        """The job's records in its own folder (not below it): its plan, payload, handle, the leader's go and the
        payloads, a few objects however many hosts (a worker stores a payload only when it fails)."""
        found: list[ObjectInfo] = []
        try:
            entries = os.scandir(self.storage.local_path())
        except OSError:
            return found
        with entries:
            for entry in entries:
                if entry.name not in _JOB_FOLDER_RECORDS and protocol.parse_worker_result(entry.name) is None:
                    continue
                try:
                    stat = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                found.append(ObjectInfo(entry.name, stat.st_size, f"{stat.st_mtime_ns}:{stat.st_size}",
                                        stat.st_mtime))
        return sorted(found, key=lambda info: info.name)

    def _follow_first_failure(self, info: ObjectInfo) -> None:
        """Read the first failure's record for its host, which is looked at every look until its end is read."""
        data = self._read(info)
        if data is None:
            return
        try:
            record = FirstFailure.from_json(self._verified(protocol.FAILED, data))
        except (IntegrityError, ValueError, TypeError, AttributeError) as error:  # the hosts' agents ignore it too
            logger.warning("ignored the first failure's record: %s", error)
            return
        if isinstance(record.host_index, int):
            self._failed_first = record.host_index

    def _ends_in_order(self) -> set[int]:
        """The hosts found ended since the last look, from the lowest one still running upward to the next one
        still running, by their exit records: one stat per look, plus one per host that ended."""
        ended: set[int] = set()
        while self._ended_below < self.plan.world_size:
            index = self._ended_below
            if self.records[index].exit is None:
                if self._stat_by_name(protocol.host_exit(index)) is None:
                    break
                ended.add(index)
            self._ended_below += 1
        return ended

    def _hosts_ending(self, folder: list[ObjectInfo]) -> set[int]:
        """The hosts whose every record is looked at each look until their end is read: the leader once its payload
        is in the job's ``folder``, a worker once its failure payload is, the host that failed first."""
        listed = {protocol.LEADER_INDEX if info.name == protocol.RESULT else protocol.parse_worker_result(info.name)
                  for info in folder if info.name == protocol.RESULT or protocol.parse_worker_result(info.name)
                  is not None}
        if self._failed_first is not None:
            listed.add(self._failed_first)
        return {index for index in listed if index < self.plan.world_size and self.records[index].exit is None}

    def _every_host_look_due(self) -> bool:
        # A host that ended (its agent records the first failure before its exit) is looked at now.
        return time.monotonic() >= self._every_host_look_at or self._first_failure_moved() is not None

    def _schedule_every_host_look(self) -> None:
        """The next look at every host's records: one interval from now, longer for more hosts."""
        self._every_host_look_at = time.monotonic() + EVERY_HOST_LOOK_S \
            + EVERY_HOST_LOOK_PER_HOST_S * self.plan.world_size

    def _first_failure_moved(self) -> ObjectInfo | None:
        """The first failure's record (``protocol.FAILED``) when it is new since the last look (a stat), else None."""
        info = self._stat_by_name(protocol.FAILED)
        if info is None or info.version == self._first_failure_seen:
            return None
        self._first_failure_seen = info.version
        return info

    def _stat_by_name(self, name: str) -> ObjectInfo | None:
        """Object ``name`` as it is now on the local disk (one stat), or None when it is not there."""
        self.requests["stat"] += 1
        try:
            stat = os.stat(self.storage.local_path(name))
        except OSError:
            return None
        return ObjectInfo(name, stat.st_size, f"{stat.st_mtime_ns}:{stat.st_size}", stat.st_mtime)

    def _ends_listed(self) -> tuple[list[ObjectInfo], set[int]]:
        """The hosts' ends of this cell not read yet and their markers at its barrier not seen yet, and the hosts
        whose output of it is newly all stored (their agent's marker), from one listing of the cell's folder."""
        found: list[ObjectInfo] = []
        stored: set[int] = set()
        try:
            entries = os.scandir(self.storage.local_path(protocol.cell_dir(self.cell)))
        except OSError:
            return found, stored
        with entries:
            for entry in entries:
                if entry.name.startswith(protocol.CELL_OUTPUT_STORED_PREFIX):
                    index = entry.name[len(protocol.CELL_OUTPUT_STORED_PREFIX):]
                    if index.isdigit() and int(index) < self.plan.world_size \
                            and int(index) not in self.output_complete:
                        stored.add(int(index))
                    continue
                if entry.name.startswith(protocol.CELL_READY_PREFIX):
                    index = entry.name[len(protocol.CELL_READY_PREFIX):]
                    if index.isdigit() and int(index) not in self._cell_ready:
                        with contextlib.suppress(OSError):
                            found.append(ObjectInfo(f"{protocol.cell_dir(self.cell)}/{entry.name}", 0, "",
                                                    entry.stat(follow_symlinks=False).st_mtime))
                    continue
                if not entry.name.startswith(protocol.CELL_DONE_PREFIX):
                    continue
                index = entry.name[len(protocol.CELL_DONE_PREFIX):]
                if not index.isdigit() or int(index) in self._cell_ended or int(index) >= self.plan.world_size:
                    continue
                try:
                    stat = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                found.append(ObjectInfo(protocol.cell_done(self.cell, int(index)), stat.st_size,
                                        f"{stat.st_mtime_ns}:{stat.st_size}", stat.st_mtime))
        return found, stored

    def _failed_in_cell(self, index: int) -> bool:
        status = self.records[index].status
        return status is not None and status.cell == self.cell and status.cell_failed

    def _host_records_by_name(self, index: int) -> list[ObjectInfo]:
        """Host ``index``'s heartbeat, status and exit as they are (a stat each)."""
        names = (protocol.host_heartbeat(index), protocol.host_status(index), protocol.host_exit(index))
        return [info for name in names if (info := self._stat_by_name(name)) is not None]

    def _chunks_by_name(self, index: int) -> list[ObjectInfo]:
        """Host ``index``'s output chunks (of this cell, or of the job) written since the last look: numbered in
        order, never rewritten."""
        found: list[ObjectInfo] = []
        chunk = self.next_chunk[index]
        while True:
            name = protocol.host_log_chunk(index, chunk) if self.cell is None \
                else protocol.cell_log_chunk(self.cell, index, chunk)
            self.requests["stat"] += 1
            try:
                stat = os.stat(self.storage.local_path(name))
            except OSError:
                return found
            found.append(ObjectInfo(name, stat.st_size, "", stat.st_mtime))
            chunk += 1

    def _chunk_number(self, name: str) -> int:
        """The number of the log chunk ``name`` (a cell's or the job's)."""
        parsed = protocol.parse_host_object(name) if self.cell is None else protocol.parse_cell_log_chunk(name)
        return parsed[2]
