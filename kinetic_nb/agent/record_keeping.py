"""An agent's own records: stored sealed, control records verified before it acts, its storage errors said.

Every record the agent writes is sealed with the job's key; every control
record is verified before the agent acts on it (a forged one is logged, never
acted on). A record that cannot be stored never stops the agent: the hosts are
still supervised, the first error is kept for the exit records (and the local
backend's own record of the agent), and the agent's log says each error, at
most once a minute with a count of the rest. Host-safe.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable

from kinetic_nb.errors import IntegrityError, ObjectExistsError, ObjectNotFoundError, StorageError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.records import read_host_status, read_record, write_record
from kinetic_nb.storage import Storage

#: An agent's storage errors are said on its log at most once per this many seconds (with a count of the rest).
STORAGE_ERROR_LINE_S = 60.0


def describe_storage_error(name: str, error: BaseException) -> str:
    """``"ENOSPC: No space left on device (hosts/1/log/000003.json)"``: a storage error as one line.

    The operating system's error is named even when a storage raised it as the
    cause of its own ``StorageError``.
    """
    cause: BaseException | None = error
    while cause is not None and not (isinstance(cause, OSError) and cause.errno is not None):
        cause = cause.__cause__
    if cause is not None:
        code = errno.errorcode.get(cause.errno, str(cause.errno))
        return f"{code}: {cause.strerror} ({name})"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} ({name})"


class RecordKeeping:
    """The records' side of an agent (``agent.supervisor.Agent``): the attributes below are the agent's."""

    storage: Storage
    key: bytes
    #: The first storage error, as the hosts' exit records name it.
    storage_error: str
    on_storage_error: Callable[[str], None] | None
    #: Where hosts on a bucket write their outputs, published to ``outputs/`` when the last one ends.
    scratch_outputs: str | None
    _next_storage_error_line: float
    _unsaid_storage_errors: int
    #: Held while a storage error is said or counted: the agent's loop, its heartbeat thread and its hub's threads
    #: may each meet the same outage at once, and only one of them says it.
    _storage_error_lock: threading.Lock

    def write_record(self, name: str, data: bytes, *, exclusive: bool = False) -> bool:
        """Store a record, sealed; False when it exists already (``exclusive``) or could not be stored."""
        try:
            write_record(self.storage, self.key, name, data, exclusive=exclusive)
            return True
        except ObjectExistsError:
            return False
        except Exception as error:  # noqa: BLE001 - the hosts must still be supervised; the error is recorded
            self._storage_failed(name, error)
            return False

    def verified(self, name: str) -> bool:
        """Whether the control record ``name`` was written by this job (a forged one is logged, never acted on)."""
        try:
            read_record(self.storage, self.key, name)
            return True
        except ObjectNotFoundError:
            return False
        except IntegrityError as error:
            print(f"kinetic agent: ignored: {error}", file=sys.stderr, flush=True)
            return False
        except Exception as error:  # noqa: BLE001 - the hosts must still be supervised
            self._storage_failed(name, error)
            return False

    def _storage_failed(self, name: str, error: BaseException) -> None:
        """Say a storage error on this agent's stderr (its log), at most once per ``STORAGE_ERROR_LINE_S`` with a
        count of those not said: a bucket that stops answering fails every request, hundreds a minute."""
        text = describe_storage_error(name, error)
        with self._storage_error_lock:
            now = time.monotonic()
            if now >= self._next_storage_error_line:
                unsaid = f" (and {self._unsaid_storage_errors} more since the last said)" \
                    if self._unsaid_storage_errors else ""
                print(f"kinetic agent: storage error: {text}{unsaid}", file=sys.stderr, flush=True)
                self._next_storage_error_line, self._unsaid_storage_errors = now + STORAGE_ERROR_LINE_S, 0
            else:
                self._unsaid_storage_errors += 1
            first = not self.storage_error
            if first:
                self.storage_error = text
        if first and self.on_storage_error is not None:
            self.on_storage_error(text)

    def _publish_outputs(self) -> None:
        """Upload the hosts' scratch outputs to the job's outputs/ (non-local storage only), then remove them."""
        if self.scratch_outputs is None:
            return
        try:
            for directory, _, files in os.walk(self.scratch_outputs):
                for file_name in files:
                    path = os.path.join(directory, file_name)
                    relative = os.path.relpath(path, self.scratch_outputs).replace(os.sep, "/")
                    name = f"{protocol.OUTPUTS_DIR}/{relative}"
                    try:
                        self.storage.write_file(name, path)
                    except Exception as error:  # noqa: BLE001 - the other files still go
                        self._storage_failed(name, error)
        finally:
            shutil.rmtree(self.scratch_outputs, ignore_errors=True)
            self.scratch_outputs = None

    def _recorded_state(self, index: int) -> str | None:
        """The state host ``index`` last recorded in its (verified) status, or None."""
        try:
            status = read_host_status(self.storage, self.key, index)
        except (OSError, StorageError):  # unreadable, or a storage that does not answer: not known
            return None
        return status.state if status is not None else None
