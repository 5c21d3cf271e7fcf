"""``Session.post_mortem``: ask one host of a session about its last failure (``runner.post_mortem``).

The question is a record sealed under the session's key; only the host asked
looks for it, and only while it keeps a failure (until its next cell). The
answer is text the host made, read once it verifies: nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING

from kinetic_nb.client.waiting import wait_for
from kinetic_nb.errors import IntegrityError, ObjectExistsError, ObjectNotFoundError, PostMortemError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.post_mortem import FRAMES, TIME_LIMIT_S
from kinetic_nb.runner.protocol import HostState, PostMortemRequest, process_name
from kinetic_nb.runner.records import read_record
from kinetic_nb.runner.wakeup import wake, wakeup_path

if TYPE_CHECKING:
    from kinetic_nb.client.sessions import Session

__all__ = ["ask"]

#: How long the notebook waits for the host's answer beyond the expression's own time limit.
ANSWER_WAIT_S = 20.0
#: How often it looks for the answer (the host looks for a question about once a second on a bucket).
ANSWER_LOOK_S = 0.1


def ask(session: Session, rank: int, expression: str, *, frame: str = "raised",
        timeout: float = TIME_LIMIT_S + ANSWER_WAIT_S) -> str:
    """The text of ``expression``'s value in the frame ``rank`` last failed in (see ``Session.post_mortem``)."""
    plan = session.plan
    name = process_name(rank, plan.procs_per_host) if isinstance(rank, int) and 0 <= rank < plan.world_size else ""
    if not name:
        raise ValueError(f"session {session.session_id} has ranks 0-{plan.world_size - 1}, not {rank!r}")
    if frame not in FRAMES:
        raise ValueError(f"frame must be one of {', '.join(FRAMES)}, not {frame!r}")
    if not expression.strip():
        raise ValueError("%kinetic pm needs an expression to evaluate, e.g. %kinetic pm 1 batch.shape")
    status = session.host_status(rank)
    if status is None or status.state != HostState.IDLE.value or not status.cell_failed:
        where = "has not run a cell" if status is None or not status.cell else \
            f"is {status.state} on cell {status.cell}" if status.state != HostState.IDLE.value else \
            f"did not fail in its last cell ({status.cell})"
        raise PostMortemError(f"{name} of session {session.session_id} {where}: it keeps no failing frame")
    if not status.frame_locals:
        raise PostMortemError(f"{name} failed outside the cell's code in cell {status.cell} ({status.message}): "
                              "it keeps no frame of the cell")
    seq, number = status.cell, 1
    request = PostMortemRequest(expression=expression, frame=frame).to_json()
    while True:  # the next free number: questions from two kernels are answered in turn
        try:
            session.share(protocol.post_mortem_request(seq, rank, number), request, exclusive=True)
            break
        except ObjectExistsError:
            number += 1
    if session.storage.local_path() is not None:
        wake(wakeup_path(session.session_id, rank))
    answer_name = protocol.post_mortem_answer(seq, rank, number)
    deadline = time.monotonic() + timeout

    def look() -> dict | None:
        with contextlib.suppress(ObjectNotFoundError, IntegrityError):
            return json.loads(read_record(session.records, session.group.key, answer_name))
        return None

    def in_time(_: dict | None) -> None:
        if time.monotonic() > deadline:
            raise PostMortemError(f"{name} did not answer within {timeout:g} s (its next cell may have started, "
                                  "which lets its last failure go)")

    answer = wait_for(look, lambda found: found is not None, between=in_time, sleep=session.sleep,
                      max_pause=ANSWER_LOOK_S)
    text = str(answer.get("text", ""))
    if not answer.get("ok"):
        raise PostMortemError(f"on {name}, in cell {seq}'s failing frame: {text}")
    return text
