"""Every exception kinetic_nb raises, in one place.

Host-safe: imports only the standard library.

::

    KineticError
     ├── UnknownAcceleratorError   (also ValueError)   a name not in the registry
     ├── CaptureError                                   the cell cannot be shipped
     │    ├── CellSyntaxError      (also SyntaxError)   names the cell line
     │    ├── UnpicklableValueError (also TypeError)    names the variable, type, reason
     │    └── UnboundOutputError   (also NameError)     an -o name the cell can never bind
     ├── StorageError                                   a job object could not be used
     │    ├── ObjectNotFoundError  (also FileNotFoundError)
     │    └── ObjectExistsError    (also FileExistsError) a single-writer object exists
     ├── IntegrityError                                 a stored record failed verification: not this job's
     │    └── UnsignedJobError                          a job from before signing, read only on request
     ├── PlanError                                      a host rejected the plan
     ├── HostStoppedError                               stopped because another host failed
     ├── HostExitError                                  the cell on a host raised SystemExit(n), n != 0
     ├── ResultSerializationError                       the leader's value could not be pickled
     ├── RemoteHostError                                a remote exception that could not travel as itself
     ├── JobFailedError                                 a failed job with no readable payload
     ├── UnreadableResultError                          the leader's payload exists but cannot be unpickled here
     ├── JobCancelledError                              the job was cancelled
     └── KineticTimeoutError   (also TimeoutError)      the job ran past its timeout

    KineticWarning (UserWarning)                        a record was skipped or a host misbehaved

A remote exception is re-raised as its own type; only when it cannot be
unpickled does it arrive as :class:`RemoteHostError`.
"""

from __future__ import annotations


class KineticError(Exception):
    """Base class of every kinetic_nb error."""


class UnknownAcceleratorError(KineticError, ValueError):
    """An accelerator name that is not in the registry."""


class CaptureError(KineticError):
    """The cell, or a value it reads from the notebook, cannot be shipped to the hosts."""


class CellSyntaxError(CaptureError, SyntaxError):
    """The cell does not parse; ``lineno`` is the cell's own line number."""

    def __str__(self) -> str:
        return str(self.msg)  # the message already names the line; SyntaxError would repeat it


class UnpicklableValueError(CaptureError, TypeError):
    """A notebook value the cell reads cannot be pickled."""


class StorageError(KineticError):
    """A job object could not be read, written or listed.

    Where a storage knows it, the error also says what it was asked (:meth:`asked`), so that the notebook can say
    it in a user's words: the operation (``"write"``, ``"read"``, ``"list"``...), the object's ``name`` under the
    storage's root ``where``, and ``reason``, the cause in one line. The message itself names the object, for logs.
    """

    op = ""
    name = ""
    where = ""
    reason = ""

    def asked(self, op: str, name: str, where: str, reason: str) -> StorageError:
        """This error, saying what was asked of the storage at ``where`` and why it could not be done."""
        self.op, self.name, self.where, self.reason = op, name, where, reason
        return self


class UnboundOutputError(CaptureError, NameError):
    """An ``-o/--out`` name that the cell never binds and the notebook does not send (checked before any host starts)."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist."""


class ObjectExistsError(StorageError, FileExistsError):
    """A single-writer object was written a second time."""


class ObjectTooLargeError(StorageError):
    """An object is larger than its reader allows (``Storage.read_bounded``): it was not read."""


class IntegrityError(KineticError):
    """A stored record failed verification (or carries no signature): this job's hosts did not write it.

    Nothing is unpickled from such a record.
    """


class UnsignedJobError(IntegrityError):
    """A job stored before records were signed: read only when the caller opts in."""


class ProtocolVersionError(KineticError):
    """A job or session was stored by a kinetic_nb that speaks another job protocol than this one."""


class PlanError(KineticError):
    """A host rejected the job plan or its payload (version, hash, host index)."""


class AcceleratorNotSeenError(KineticError, RuntimeError):
    """A host's framework does not see the accelerator its plan names (a GPU host where torch sees no CUDA):
    the cell fails rather than run quietly on the CPU."""


class CoordinatorPortTakenError(KineticError, ConnectionError):
    """The port chosen for the framework's coordinator on host 0 was taken by another process before it was bound."""


class SshHostError(KineticError, ConnectionError):
    """An ssh host that cannot be reached, refuses the key or shows another host key: named, with the fix."""


class HostStoppedError(KineticError):
    """This host was stopped because another host failed first.

    It is a consequence, never a root cause: the client ranks it after any
    host's own failure.
    """


class HostExitError(KineticError):
    """The cell on a host raised ``SystemExit`` with a code other than 0 or None; ``code`` is that code.

    Raised in its place, with the cell's traceback: a ``SystemExit`` would end
    a script that waits for the job, and IPython shows it without its traceback.
    """

    code: object = None


class ResultSerializationError(KineticError):
    """The leader's value could not be pickled; the message carries its repr."""


class RemoteHostError(KineticError):
    """A remote exception that could not be shipped or rebuilt as its own type."""


class JobFailedError(KineticError):
    """The job failed and no host left a readable failure payload."""


class UnreadableResultError(KineticError):
    """The leader recorded its outcome, but this process cannot unpickle it (a class or module only the hosts have)."""


class JobCancelledError(KineticError):
    """The job was cancelled before it produced an outcome."""


class CellInterrupted(KeyboardInterrupt, KineticError):
    """The notebook interrupted a session's cell: a ``KeyboardInterrupt``, shown as its one line and the
    session's fate, never as kinetic_nb's own frames."""


class ChannelClosed(KineticError, ConnectionError):
    """A session's direct channel went away (or refused a frame): whoever used it goes back to storage."""


class KineticTimeoutError(KineticError, TimeoutError):
    """The job did not finish within its timeout."""


class KineticWarning(UserWarning):
    """A host record was skipped or a host misbehaved after success."""


class PostMortemError(KineticError):
    """``%kinetic pm``: the host has no failure to look into, or the expression raised there (its type and
    message, as the host gave them)."""
