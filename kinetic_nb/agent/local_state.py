"""A local agent's own record, kept beside its log outside the job's storage.

The local backend reads it to tell a dead agent from a busy one, and to find
the storage error that kept the agent from recording its hosts: both must be
readable when the job's own directory is full or unwritable.
"""

from __future__ import annotations

import dataclasses
import json
import os


@dataclasses.dataclass(frozen=True)
class AgentState:
    """What a local agent says of itself: who it is, and what went wrong."""

    pid: int
    started_at: float
    #: When the process started, by the kernel's clock (``processes.process_start``): a reused pid is not it.
    process_start: int | None = None
    #: The first storage error it met, as one line ("ENOSPC: No space left on device (hosts/1/...)").
    storage_error: str = ""
    #: It finished supervising (every host ended); a dead agent that never said so died.
    finished: bool = False

    def write(self, path: str) -> None:
        """Replace the record at ``path`` atomically (a reader sees the old one or the new one)."""
        temp = f"{path}.tmp-{os.getpid()}"
        with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as file:
            json.dump(dataclasses.asdict(self), file)
        os.replace(temp, path)

    @classmethod
    def read(cls, path: str) -> AgentState | None:
        try:
            with open(path) as file:
                record = json.load(file)
        except (OSError, ValueError):
            return None
        known = {field.name for field in dataclasses.fields(cls)}
        try:
            return cls(**{key: value for key, value in record.items() if key in known})
        except TypeError:
            return None
