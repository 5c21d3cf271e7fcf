"""Every thread's Python stack, on request, even while the host is blocked in C code.

The agent gives each host a file (``KINETIC_STACKS_FILE``) and, to ask for a
dump, sends the host :data:`STACKS_SIGNAL`. ``faulthandler`` answers it from
its C signal handler, without the interpreter's help, so a host stuck in a
collective, in XLA or in ``time.sleep`` still answers; a Python-level signal
handler would wait for the blocking call to return.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from typing import IO

#: The file a host's stack dumps are appended to; set by its agent.
STACKS_FILE_ENV = "KINETIC_STACKS_FILE"
#: The signal that asks a host for a dump. SIGUSR1 is free in Python, JAX and
#: torch (none installs a handler for it), and its default action would kill
#: the host, so it is registered before any user code runs.
STACKS_SIGNAL = signal.SIGUSR1

_dump_file: IO[str] | None = None  # kept open for the process's life: faulthandler writes to its descriptor


def enable_stack_dumps(environ: dict[str, str] | None = None) -> bool:
    """Answer :data:`STACKS_SIGNAL` with a dump of every thread into the agent's file; whether one was set up."""
    global _dump_file
    environ = os.environ if environ is None else environ
    path = environ.pop(STACKS_FILE_ENV, None)
    if not path:
        return False
    _dump_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(STACKS_SIGNAL, file=_dump_file, all_threads=True, chain=False)
    return True
