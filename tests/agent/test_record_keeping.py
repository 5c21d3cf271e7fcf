"""An agent's storage errors: said once a minute at most, however many of its threads meet the outage at once."""

from __future__ import annotations

import contextlib
import io
import threading
import time
import types

from kinetic_nb.agent import record_keeping
from kinetic_nb.agent.record_keeping import RecordKeeping
from kinetic_nb.errors import StorageError


class SlowStderr(io.StringIO):
    """The agent's stderr is a pipe: a write lets the other threads run before the line is down."""

    def write(self, text: str) -> int:
        time.sleep(0.01)
        return super().write(text)


class Keeper(RecordKeeping):
    def __init__(self):
        self.storage_error = ""
        self.told: list[str] = []
        self.on_storage_error = self.told.append
        self._next_storage_error_line = 0.0
        self._unsaid_storage_errors = 0
        self._storage_error_lock = threading.Lock()


def test_threads_that_meet_one_outage_together_say_it_once(monkeypatch):
    # The agent's loop, its heartbeat thread and its hub's threads each gave up on a request at the same moment of
    # an outage: two lines where the rule is one a minute (seen in a full run's test_storage_outage).
    keeper, said = Keeper(), SlowStderr()
    monotonic = time.monotonic
    gate = threading.Barrier(8)

    def in_step() -> float:  # every thread reads the clock before any of them has said anything
        with contextlib.suppress(threading.BrokenBarrierError):
            gate.wait(timeout=0.5)
        return monotonic()

    monkeypatch.setattr(record_keeping, "time", types.SimpleNamespace(monotonic=in_step))
    monkeypatch.setattr(record_keeping, "sys", types.SimpleNamespace(stderr=said))
    threads = [threading.Thread(target=keeper._storage_failed,
                                args=(f"cells/000001/log/0/{index:06d}.json", StorageError("still failing")))
               for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert said.getvalue().count("kinetic agent: storage error: ") == 1, said.getvalue()
    assert keeper._unsaid_storage_errors == 7 and len(keeper.told) == 1
