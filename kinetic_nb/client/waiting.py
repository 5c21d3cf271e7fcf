"""The client's one wait loop: look at a job, a cell or a starting session until it is ready, backing off.

A one-shot job's handle, a session cell's handle and a session's start all
wait through :func:`wait_for`, with one set of poll constants: short first
(a trivial cell's round trip is what a warm session is for; there the hosts
also wake the notebook through a socket), growing to a longest pause that
spares storage and the CPU the hosts need.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from kinetic_nb.state import SNAPSHOT_INTERVAL_S

#: What a look returns: a job's snapshot, or another record waited on (a host's answer, the hosts' profiles).
Seen = TypeVar("Seen")

__all__ = ["FIRST_POLL_S", "MAX_POLL_PER_HOST_S", "MAX_POLL_S", "POLL_GROWTH", "WOKEN_FIRST_POLL_S", "wait_for"]

#: The first pause, its growth from one look to the next, and the longest pause (a look is a listing and the
#: reads of what changed: a request each on a bucket, and CPU the hosts may need while they start).
FIRST_POLL_S = 0.002
POLL_GROWTH = 1.25
MAX_POLL_S = 0.25
#: ... and longer on a large slice: a look that reads every host's records costs a little per host, and a large
#: slice takes longer to start and to run a cell, so a fixed pace would cost the square of the hosts (0.5 s at
#: 1,024 hosts). Where the hosts wake the notebook, a look comes sooner.
MAX_POLL_PER_HOST_S = 0.0005
#: The first pause where the hosts wake the notebook through a socket whenever it has something to read (each
#: host's end of a cell, its output stored): a look between is a look at nothing, and CPU the hosts need.
WOKEN_FIRST_POLL_S = 0.05


def wait_for(look: Callable[[], Seen], ready: Callable[[Seen], bool], *,
             on_snapshot: Callable[[Seen], None] | None = None,
             between: Callable[[Seen], None] | None = None,
             sleep: Callable[[float], None] = time.sleep, max_pause: float = MAX_POLL_S,
             first_pause: float = FIRST_POLL_S, hosts: int = 0, sleep_first: bool = False) -> Seen:
    """Look until ``ready(snapshot)``, and return that snapshot (the caller shows it: it may add to it first).

    ``on_snapshot`` sees the others at most every ``SNAPSHOT_INTERVAL_S``;
    ``between`` runs after each look that is not ready (a deadline's check,
    which may raise); ``sleep`` pauses (a wakeup socket's, where hosts can
    wake the notebook); ``max_pause`` caps the pause (a record on a bucket
    needs no faster look than its writer's), raised to ``MAX_POLL_PER_HOST_S``
    per host of a slice of ``hosts``; ``first_pause`` is the first (longer
    where ``sleep`` is woken by what it waits for); ``sleep_first``: pause
    before the first look too (what it waits for wakes it, and cannot be
    ready at once: a cell just submitted).
    """
    max_pause = max(max_pause, hosts * MAX_POLL_PER_HOST_S)
    pause, shown_at = min(first_pause, max_pause), 0.0
    if sleep_first:
        sleep(pause)
    while True:
        snapshot = look()
        if ready(snapshot):
            return snapshot
        now = time.monotonic()
        if on_snapshot is not None and now - shown_at >= SNAPSHOT_INTERVAL_S:
            on_snapshot(snapshot)
            shown_at = now
        if between is not None:
            between(snapshot)
        sleep(pause)
        pause = min(pause * POLL_GROWTH, max_pause)
