"""``FakeBackend``: a backend whose hosts are scripted, for tests of everything above the backend.

As httpx ships a mock transport, this ships a backend that starts no process:
``launch`` writes, for each host, the records a real host and its agent would
leave (``status.json``, ``exit.json``, the result payloads, a log chunk), as
its :class:`HostScript` says. The client, the poller, the outcome rules and
the display then run for real on those records::

    fake = FakeBackend({0: HostScript.succeed(42), 1: HostScript.fail(ValueError("bad shard"))})
    handle = kinetic_nb.submit("...", hosts=2, backend=fake)
    handle.result()   # raises host 1's ValueError, as a real job would

With no script, each host "runs" the cell in this process (no framework, no
environment of its own), so ``"41 + 1"`` gives 42 and a raising cell fails on
the leader. A host scripted with :meth:`HostScript.run` stays running until
the job is cancelled. It is registered as ``fake`` only by :func:`register_fake`.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from collections.abc import Mapping
from typing import Any

import cloudpickle

from kinetic_nb.backends.base import Backend, BackendFlag, JobSecrets, PlatformView, register
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import load_sealed, write_sealed
from kinetic_nb.runner.execute import exception_type_name, run_cell
from kinetic_nb.runner.protocol import ExitSummary, HostState, HostStatus, JobPlan, Phase, ResultPayload
from kinetic_nb.runner.records import store_exit, write_record
from kinetic_nb.storage import ObjectInfo, Storage

__all__ = ["FakeBackend", "HostScript", "register_fake"]


@dataclasses.dataclass(frozen=True)
class HostScript:
    """What one scripted host does: ``succeed``, ``fail``, ``die`` or ``run`` (until cancelled)."""

    action: str
    value: Any = None
    error: BaseException | None = None
    phase: str = Phase.EXECUTE.value
    signal: str = "SIGKILL"
    output: str = ""

    @classmethod
    def succeed(cls, value: Any = None, *, output: str = "") -> HostScript:
        return cls("succeed", value=value, output=output)

    @classmethod
    def fail(cls, error: BaseException, *, phase: str = Phase.EXECUTE.value, output: str = "") -> HostScript:
        return cls("fail", error=error, phase=phase, output=output)

    @classmethod
    def die(cls, signal: str = "SIGKILL", *, output: str = "") -> HostScript:
        """The host's process is killed before it reports anything."""
        return cls("die", signal=signal, output=output)

    @classmethod
    def run(cls, *, output: str = "") -> HostScript:
        return cls("run", output=output)


class FakeBackend(Backend):
    """Scripted hosts, and a record of what the client asked of the backend.

    Attributes
    ----------
    launched, cancelled, cleaned : list of str
        The job ids ``launch``, ``cancel`` and ``cleanup`` were called with.
    platform_exits, waiting : dict
        What ``observe`` reports as only the platform would see it (set them in a test).
    """

    name = "fake"
    summary = "scripted hosts for tests (kinetic_nb.backends.testing)"
    flags = (BackendFlag("--fake-scenario", "scenario", "A name the test gives its scripted hosts.",
                         metavar="NAME"),)

    def __init__(self, script: Mapping[int, HostScript] | None = None, *, scenario: str | None = None):
        self.script = dict(script or {})
        self.scenario = scenario
        self.launched: list[str] = []
        self.cancelled: list[str] = []
        self.cleaned: list[str] = []
        self.platform_exits: dict[int, ExitSummary] = {}
        self.waiting: dict[int, str] = {}
        self.problem = ""
        self._key = b""

    @classmethod
    def from_options(cls, *, scenario: str | None = None, **options: Any) -> FakeBackend:
        if options:
            raise ValueError(f"the fake backend takes only scenario, got {', '.join(sorted(options))}")
        return cls(scenario=scenario)

    def options(self) -> dict[str, object]:
        return {"scenario": self.scenario} if self.scenario else {}

    def coordinator_address(self, job_id: str) -> str:
        return "127.0.0.1:1"

    def launch(self, storage: Storage, plan: JobPlan, secrets: JobSecrets) -> None:
        self.launched.append(plan.job_id)
        self._key = secrets.key
        script = self.script or self._play_the_cell(storage)
        for index in range(plan.world_size):
            self._play(storage, plan, index, script.get(index))

    def cancel(self, storage: Storage, plan: JobPlan, reason: str, key: bytes | None) -> None:
        super().cancel(storage, plan, reason, key)
        self.cancelled.append(plan.job_id)
        for index in range(plan.world_size):  # what every agent would do: stop the hosts still running
            store_exit(storage, key, ExitSummary(index, None, "SIGTERM", stopped=True, ended_at=time.time()))

    def observe(self, storage: Storage, plan: JobPlan, listing: list[ObjectInfo],
                recorded: Mapping[int, ExitSummary], key: bytes | None) -> PlatformView:
        exits = {index: summary for index, summary in self.platform_exits.items() if index not in recorded}
        return PlatformView(exits=exits, waiting=dict(self.waiting), problem=self.problem)

    def cleanup(self, plan: JobPlan) -> None:
        self.cleaned.append(plan.job_id)

    # -- playing the hosts -------------------------------------------------------------

    def _play_the_cell(self, storage: Storage) -> dict[int, HostScript]:
        cell = load_sealed(storage, protocol.PAYLOAD, self._key)
        namespace = {"__name__": "__main__", **{name: cloudpickle.loads(data)
                                                for name, data in cell[protocol.CELL_NAMESPACE].items()}}
        try:
            value = run_cell(cell[protocol.CELL_SOURCE], cell[protocol.CELL_FILENAME], namespace)
        except Exception as error:  # noqa: BLE001 - the cell's own failure is the leader's
            return {protocol.LEADER_INDEX: HostScript.fail(error)}
        return {protocol.LEADER_INDEX: HostScript.succeed(value)}

    def _play(self, storage: Storage, plan: JobPlan, index: int, script: HostScript | None) -> None:
        """Leave host ``index``'s records as its script says (a host with no script succeeds)."""
        script = script or HostScript.succeed()
        now = time.time()
        state = {"succeed": HostState.SUCCEEDED, "fail": HostState.FAILED, "run": HostState.RUNNING,
                 "die": HostState.RUNNING}[script.action]
        message = traceback_text = ""
        if script.error is not None:
            message = f"{exception_type_name(script.error)}: {script.error}"
            traceback_text = "".join(traceback.format_exception(script.error))
        status = HostStatus(index, state.value, script.phase if script.action == "fail" else Phase.EXECUTE.value,
                            now, now, os.getpid(), "fake-host", message=message, traceback=traceback_text,
                            history=[[Phase.STARTUP.value, now], [Phase.EXECUTE.value, now]])
        write_record(storage, self._key, protocol.host_status(index), status.to_json())
        storage.write_bytes(protocol.host_heartbeat(index), b"")
        if script.output:
            write_record(storage, self._key, protocol.host_log_chunk(index, 0),
                         protocol.encode_log_chunk([(protocol.STDOUT, script.output)]))
        if script.action == "run":
            return
        if script.action == "succeed" and index == protocol.LEADER_INDEX:
            payload = ResultPayload(success=True, host_index=index, phase=Phase.EXECUTE.value, result=script.value)
            write_sealed(storage, protocol.RESULT, self._key, cloudpickle.dumps(payload.to_dict()))
        elif script.action == "fail":
            payload = ResultPayload(success=False, host_index=index, phase=script.phase,
                                    exception=cloudpickle.dumps(script.error),
                                    exception_type=exception_type_name(script.error),
                                    exception_message=str(script.error), traceback=traceback_text)
            write_sealed(storage, protocol.result_object(index), self._key, cloudpickle.dumps(payload.to_dict()))
        exit_code = {"succeed": 0, "fail": 1, "die": None}[script.action]
        summary = ExitSummary(index, exit_code, script.signal if script.action == "die" else None,
                              recorded_success=script.action == "succeed", ended_at=now)
        write_record(storage, self._key, protocol.host_exit(index), summary.to_json())


def register_fake() -> type[FakeBackend]:
    """Make ``-b fake`` / ``backend="fake"`` available (tests only; never registered by default)."""
    return register(FakeBackend)
