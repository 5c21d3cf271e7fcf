"""``%kinetic pm``: an expression evaluated in the frame a session's host failed in, as ``%debug`` would.

A session's host keeps its last failure (and so its frames, and the memory
they hold) until its next cell starts. Meanwhile the notebook may store
questions for it, ``cells/{seq}/post-mortem/{rank}-{n}.json`` sealed under
the session's key; the host, idle, answers each in order with the value's
text (``runner.frame_locals.describe``, longer: a NumPy array's own repr, other
arrays and tensors by their shape) or the error the expression raised, in
``{rank}-{n}-answer.json``. Other hosts are not touched. Evaluation runs under
a time limit; code that blocks in C (a collective) is beyond it. Host-safe.
"""

from __future__ import annotations

import types
from typing import Any

from kinetic_nb.runner.frame_locals import LEFT_CELL, TooSlow, describe, failing_frames, time_limit
from kinetic_nb.runner.protocol import PostMortemRequest
from kinetic_nb.runner.redact import Redactor

__all__ = ["FRAMES", "TIME_LIMIT_S", "PostMortem"]

#: How long an expression may run, and the longest text of its value.
TIME_LIMIT_S = 10.0
MAX_CHARS = 10_000
#: The frames a request may name: the innermost (``%debug``'s), or the cell's own innermost one.
FRAMES = ("raised", "cell")


def _numpy_repr(value: Any) -> str | None:
    """A NumPy array's own repr (its data is in this process's memory: printing it cannot block)."""
    cls = type(value)
    return repr(value) if cls.__module__ == "numpy" and cls.__name__ == "ndarray" else None


class PostMortem:
    """A host's last failure, kept for questions until its next cell."""

    def __init__(self, seq: int, failure: BaseException, filename: str, redactor: Redactor,
                 secrets: frozenset[bytes | str]):
        self.seq = seq
        #: The number of the next question to look for.
        self.next = 1
        self._frames = {what: frame for what, frame, _ in failing_frames(failure, filename)}
        self._redactor, self._secrets = redactor, secrets

    def frame(self, which: str) -> types.FrameType:
        if which == "cell" and LEFT_CELL in self._frames:
            return self._frames[LEFT_CELL]
        return next(iter(self._frames.values()))

    def answer(self, request: PostMortemRequest) -> dict[str, Any]:
        """``{"ok": True, "text": value}`` or ``{"ok": False, "text": "NameError: ..."}``; never raises."""
        frame = self.frame(request.frame)
        try:
            code = compile(request.expression, "<kinetic pm>", "eval")
            with time_limit(TIME_LIMIT_S):
                value = eval(code, frame.f_globals, frame.f_locals)  # noqa: S307 - the notebook's user asks
                text = _numpy_repr(value) or describe(value, self._redactor, self._secrets, limit=MAX_CHARS,
                                                      full=True)
        except TooSlow:
            return {"ok": False, "text": f"TimeoutError: the expression ran longer than {TIME_LIMIT_S:g} s"}
        except BaseException as error:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are the answer too
            message = f"{type(error).__name__}: {error}".splitlines()[0]
            return {"ok": False, "text": self._redactor.text(message)}
        text = self._redactor.text(text)
        return {"ok": True, "text": text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 3] + "..."}
