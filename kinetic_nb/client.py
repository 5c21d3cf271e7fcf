"""``submit`` and ``JobHandle``: the plain Python API the magic is a thin layer over."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kinetic_nb.accelerators import local_notice
from kinetic_nb.backends import Backend, get_backend
from kinetic_nb.errors import KineticTimeoutError, ObjectNotFoundError
from kinetic_nb.plan import choose_framework, make_plan, new_job_id, prepare_cell, resolve_slice
from kinetic_nb.results import JobStatus, job_status, resolve_outcome
from kinetic_nb.runner import protocol
from kinetic_nb.runner.logs import last_lines, read_log
from kinetic_nb.runner.protocol import ExitSummary, HostState, HostStatus, JobPlan
from kinetic_nb.storage import ObjectInfo, Storage, default_root, open_storage

__all__ = ["HostInfo", "JobHandle", "JobStatus", "last_job", "submit"]

#: First and longest pause between two polls of a running job: short at
#: first so a quick cell returns quickly, longer later to spare storage.
FIRST_POLL_S = 0.005
POLL_GROWTH = 1.25
MAX_POLL_S = 0.25
#: After a cancel, how long to wait for the hosts to be gone.
CANCEL_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """One host as ``JobHandle.hosts()`` reports it."""

    index: int
    state: str
    phase: str
    message: str = ""
    exit: ExitSummary | None = None

    @property
    def is_leader(self) -> bool:
        return self.index == protocol.LEADER_INDEX

    @property
    def exit_summary(self) -> str:
        return self.exit.describe() if self.exit else ""


class JobHandle:
    """A submitted job: wait for it, read its hosts and logs, get its outcome, cancel it."""

    def __init__(self, storage: Storage, plan: JobPlan, backend: Backend, *, echo: Callable[[str], None] | None = None):
        self.storage = storage
        self.plan = plan
        self.backend = backend
        self.echo = echo
        self.outputs: dict[str, Any] = {}
        self._submitted_at = time.monotonic()
        self._echoed: set[str] = set()
        self._exits: dict[int, ExitSummary] = {}
        self._listing: list[ObjectInfo] = []
        self._status = JobStatus.PENDING
        self._payload: dict[str, Any] | None = None

    @property
    def job_id(self) -> str:
        return self.plan.job_id

    @property
    def uri(self) -> str:
        return self.storage.uri

    def __repr__(self) -> str:
        return f"<JobHandle {self.job_id} {self.plan.hosts} hosts {self.status()}>"

    def summary(self) -> str:
        """A plain-text table: the job's state and each host's state, phase and exit."""
        status = self.status()
        rows = [f"job {self.job_id} · {self.backend.name} · {self.plan.accelerator} · {self.plan.hosts} hosts · {status}"]
        rows.append(f"{'host':>4}  {'role':<6}  {'state':<9}  {'phase':<20}  exit")
        for host in self.hosts():
            role = "leader" if host.is_leader else ""
            rows.append(f"{host.index:>4}  {role:<6}  {host.state:<9}  {host.phase:<20}  {host.exit_summary}")
        return "\n".join(rows)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self) if cycle else self.summary())

    # -- reading the job's state -------------------------------------------------

    def _poll(self) -> JobStatus:
        """One listing of the job's objects; read only what is new."""
        if self._status.done:
            return self._status
        self._listing = self.storage.list()
        names = {info.name for info in self._listing}
        ended = [info for info in self._listing if info.name.endswith("/exit.json") and
                 (parsed := protocol.parse_host_object(info.name)) and parsed[0] not in self._exits]
        if ended:
            self._exits.update(self.backend.exit_summaries(self.storage, self.plan, ended))
        self._echo_leader_output()
        started = any(name.startswith(protocol.HOSTS_DIR + "/") for name in names)
        self._status = job_status(self.plan, self._exits, started=started, cancelled=protocol.CANCEL in names)
        return self._status

    def _echo_leader_output(self) -> None:
        if self.echo is None:
            return
        prefix = protocol.host_log_prefix(protocol.LEADER_INDEX)
        for info in self._listing:
            if info.name.startswith(prefix) and info.name not in self._echoed:
                self._echoed.add(info.name)
                self.echo(self.storage.read_bytes(info.name).decode(errors="replace"))

    def status(self) -> JobStatus:
        """PENDING, RUNNING, SUCCEEDED, FAILED or CANCELLED."""
        return self._poll()

    def hosts(self) -> list[HostInfo]:
        """Every host's state, phase and (once it ended) exit summary."""
        self._poll()
        infos = []
        for index in range(self.plan.hosts):
            try:
                status = HostStatus.from_json(self.storage.read_bytes(protocol.host_status(index)))
            except ObjectNotFoundError:
                status = None
            summary = self._exits.get(index)
            state = status.state if status else HostState.PENDING.value
            if summary is not None and summary.stopped:
                state = HostState.STOPPED.value
            elif summary is not None and summary.failed:
                state = HostState.FAILED.value
            infos.append(HostInfo(index, state, status.phase if status else protocol.Phase.STARTUP.value,
                                  status.message if status else "", summary))
        return infos

    def logs(self, host: int = protocol.LEADER_INDEX) -> str:
        """Host ``host``'s stdout and stderr so far."""
        if not 0 <= host < self.plan.hosts:
            raise ValueError(f"host {host} is out of range for a {self.plan.hosts}-host job")
        return read_log(self.storage, host)

    def describe_host(self, index: int) -> str:
        """Exit summary, phase and last log lines of one host, as a verb phrase."""
        summary = self._exits.get(index)
        try:
            phase = HostStatus.from_json(self.storage.read_bytes(protocol.host_status(index))).phase
        except ObjectNotFoundError:
            phase = None
        text = summary.describe() if summary else "has not ended"
        if summary is not None and summary.recorded_success:
            text += " after recording success"
        elif phase:
            text += f" in phase {phase}"
        lines = last_lines(read_log(self.storage, index), 5)
        if lines and not (summary and summary.recorded_success):
            text += "; last log lines:\n" + "\n".join(f"    {line}" for line in lines)
        return text

    # -- waiting and the outcome -----------------------------------------------------

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Wait until every host has ended; return the job's state.

        ``timeout`` bounds this wait only (the job goes on); the plan's own
        timeout stops the job and raises ``KineticTimeoutError``. An
        interrupt cancels the job and re-raises ``KeyboardInterrupt``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = FIRST_POLL_S
        try:
            while not self._poll().done:
                now = time.monotonic()
                if self.plan.timeout_s is not None and now - self._submitted_at > self.plan.timeout_s:
                    self._stop_for_timeout()
                if deadline is not None and now > deadline:
                    raise KineticTimeoutError(f"job {self.job_id} has not finished after {timeout:g} s; it goes on")
                time.sleep(pause)
                pause = min(pause * POLL_GROWTH, MAX_POLL_S)
        except KeyboardInterrupt as interrupt:
            self.cancel("interrupted")
            interrupt.add_note(f"kinetic_nb: cancelled job {self.job_id} and stopped its {self.plan.hosts} hosts")
            raise
        return self._status

    def _stop_for_timeout(self) -> None:
        where = [f"host {h.index}: {h.state}, phase {h.phase}" + (f", last line: {line[-1]}" if (line := last_lines(
            read_log(self.storage, h.index), 1)) else "") for h in self.hosts()]
        self.cancel("timeout")
        raise KineticTimeoutError(
            f"job {self.job_id} ran past its timeout of {self.plan.timeout_s:g} s and was stopped; " + "; ".join(where)
        )

    def result(self, timeout: float | None = None) -> Any:
        """The leader's value, or the right host's own exception (see ``results``)."""
        if self._payload is None:
            status = self.wait(timeout)
            self._payload = resolve_outcome(
                self.storage, self.plan, status, self._exits, lambda: self._listing, self.describe_host
            )
            self.outputs = dict(self._payload.get(protocol.OUTPUTS) or {})
        return self._payload.get(protocol.RESULT_VALUE)

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop every host; returns once they are gone (or after a bounded wait)."""
        if self._poll().done:
            return
        self.backend.cancel(self.storage, self.plan, reason)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while not self._poll().done and time.monotonic() < deadline:
            time.sleep(0.05)

    # -- reattaching ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "uri": self.uri, "backend": self.backend.name, "hosts": self.plan.hosts,
                "accelerator": self.plan.accelerator, "submitted_at": time.time()}

    @classmethod
    def from_uri(cls, uri: str, backend: str = "local") -> JobHandle:
        storage = open_storage(uri)
        return cls(storage, JobPlan.from_json(storage.read_bytes(protocol.PLAN)), get_backend(backend))


_last_handle: JobHandle | None = None


def last_job() -> JobHandle | None:
    """The most recent job submitted from this process (what the last ``%%kinetic`` ran)."""
    return _last_handle


def _print_to_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def submit(
    source: str,
    *,
    hosts: int | None = None,
    accelerator: str | None = None,
    backend: str = "local",
    framework: str = "auto",
    namespace: Mapping[str, Any] | None = None,
    out: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    storage: str | None = None,
    cell_name: str = "kinetic cell",
    echo: bool | Callable[[str], None] = False,
    quiet: bool = False,
) -> JobHandle:
    """Run ``source`` on every host of a slice; return at once with a ``JobHandle``.

    Parameters
    ----------
    source : str
        The cell's code. Its last expression, on the leader, is the value.
    hosts : int, optional
        Number of hosts (default: the accelerator's, or 1).
    accelerator : str, optional
        A name such as ``tpu-v5e-16`` or ``gpu-h100x8`` (simulated on CPU locally).
    backend : str
        ``local``.
    framework : {"auto", "jax", "torch", "none"}
        What to initialize before the cell; ``auto`` decides by the cell's imports.
    namespace : mapping, optional
        Where the cell's free names are looked up (the notebook's namespace).
    out : iterable of str
        Leader variables to bring back in ``JobHandle.outputs``.
    env : mapping, optional
        Extra environment variables for every host.
    timeout : float, optional
        Seconds before the job is stopped and ``KineticTimeoutError`` raised.
    storage : str, optional
        Storage root URI (default: a per-user directory, or ``$KINETIC_STORAGE``).
    echo : bool or callable
        Print (or pass to the callable) the leader's output while waiting.
    quiet : bool
        Do not print the notice that an accelerator is simulated.
    """
    namespace = {} if namespace is None else namespace
    out = list(out)
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout:g}")
    chosen_backend = get_backend(backend)
    acc, host_count = resolve_slice(hosts, accelerator)
    payload = prepare_cell(source, namespace, filename=f"<{cell_name}>", out=out)
    job_id = new_job_id()
    plan = make_plan(
        job_id=job_id,
        acc=acc,
        hosts=host_count,
        framework=choose_framework(framework, payload.modules),
        coordinator_address=chosen_backend.coordinator_address(job_id),
        payload=payload,
        simulated=chosen_backend.name == "local",
        timeout=timeout,
        env=env,
    )
    if acc.simulated_locally and chosen_backend.name == "local" and not quiet:
        print(local_notice(acc), file=sys.stderr)
    job_storage = open_storage(storage or default_root()).child(job_id)
    job_storage.write_bytes(protocol.PAYLOAD, payload.data, exclusive=True)
    job_storage.write_bytes(protocol.PLAN, plan.to_json(), exclusive=True)
    printer = _print_to_stdout if echo is True else (echo or None)
    handle = JobHandle(job_storage, plan, chosen_backend, echo=printer)
    job_storage.write_bytes(protocol.HANDLE, json.dumps(handle.to_dict()).encode())
    chosen_backend.launch(job_storage, plan)
    global _last_handle
    _last_handle = handle
    return handle
