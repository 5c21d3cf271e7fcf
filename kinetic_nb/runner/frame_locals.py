"""The failing frame's variables, as short text made on the host: what a remote traceback shows beside its lines.

For a failure that passed through the cell, two frames are described: the
innermost frame of the traceback (where it was raised) and, when that frame
is not the cell's own code, the cell's innermost frame (where it left the
cell). Each local becomes ``name = text``:

- arrays and tensors (anything whose type has ``shape`` and ``dtype``) are
  described by type, shape, dtype and where they live (a JAX array's
  sharding, a tensor's device), never by their ``repr``: the ``repr`` of a
  value behind a hung collective blocks in C, where no time limit reaches;
- other values by a ``reprlib`` repr (containers shortened, their arrays
  described as above), each under a time limit (a ``__repr__`` that hangs or
  raises costs its own line only), the whole frame under another;
- modules, functions and classes are left out, and so is a cell's top level
  beyond the names the cell itself uses (its frame's locals are the whole
  namespace);
- every text is redacted (the job's key, ``-e`` values): nothing leaves the
  host that its logs would not show.

The text travels in the failure payload and the host's status, as JSON: the
client never unpickles a local. Host-safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import reprlib
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator
from typing import Any

from kinetic_nb.runner.redact import Redactor

__all__ = ["FrameLocals", "TooSlow", "describe", "failing_frames", "frame_locals", "locals_notes", "time_limit"]

#: The most names shown per frame, and the longest text of one value.
MAX_NAMES = 20
MAX_VALUE_CHARS = 160
#: How long one value's text may take, and all of a frame's together.
VALUE_TIME_LIMIT_S = 0.25
FRAME_TIME_LIMIT_S = 1.0
#: How many names the raised exception's notes keep, of the first frame described.
NOTE_NAMES = 5
#: What the two frames are called.
RAISED = "where it was raised"
LEFT_CELL = "where it left the cell"


class TooSlow(BaseException):
    """A value's text took longer than its time limit (a BaseException: a ``__repr__``'s ``except Exception``
    does not swallow it)."""


@dataclasses.dataclass(frozen=True)
class FrameLocals:
    """One frame's variables: which frame, where (``Cell line 3, in step``), ``(name, text)`` pairs, and how
    many names were left out beyond :data:`MAX_NAMES`."""

    where: str
    location: str
    names: tuple[tuple[str, str], ...]
    omitted: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"where": self.where, "location": self.location, "names": [list(pair) for pair in self.names],
                "omitted": self.omitted}

    @classmethod
    def from_dict(cls, record: Any) -> FrameLocals | None:
        """The frame a JSON record describes, or None for anything malformed (it came from storage)."""
        try:
            names = tuple((str(name), str(text)) for name, text in record["names"])
            return cls(str(record["where"]), str(record["location"]), names, int(record.get("omitted", 0)))
        except (KeyError, TypeError, ValueError):
            return None

    def text(self, limit: int | None = None) -> str:
        """``where it was raised (Cell line 3, in step): x = 3, batch = jax.Array float32[8,128] ...``"""
        shown = self.names if limit is None else self.names[:limit]
        more = len(self.names) - len(shown) + self.omitted
        pairs = ", ".join(f"{name} = {text}" for name, text in shown) or "no variables"
        return f"{self.where} ({self.location}): {pairs}" + (f", and {more} more" if more else "")


def failing_frames(error: BaseException, filename: str) -> list[tuple[str, types.FrameType, int]]:
    """``(what, frame, line)`` for the frames described: where ``error`` was raised and, when that is outside
    the cell, where it left the cell. None when the traceback never reached the cell (a barrier's failure)."""
    frames = list(traceback.walk_tb(error.__traceback__))
    in_cell = [(frame, line) for frame, line in frames if frame.f_code.co_filename == filename]
    if not in_cell:
        return []
    raised = frames[-1]
    described = [(RAISED, *raised)]
    if raised[0] is not in_cell[-1][0]:
        described.append((LEFT_CELL, *in_cell[-1]))
    return described


def _is_array(value: Any) -> bool:
    """An array or tensor: its type has ``shape`` and ``dtype`` (a NumPy scalar, printed as itself, is not)."""
    cls = type(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):
        return False
    return hasattr(cls, "shape") and hasattr(cls, "dtype") and not isinstance(value, type)


def _type_name(value: Any) -> str:
    cls = type(value)
    module = cls.__module__.split(".")[0]
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _array_text(value: Any) -> str:
    """``jax.Array float32[8,128] NamedSharding(...)``: read from attributes, never from the value's data."""
    try:
        shape = "[" + ",".join(str(int(size)) for size in value.shape) + "]"
    except Exception:  # noqa: BLE001 - a tracer's unknown shape, a lazy tensor
        shape = "[?]"
    dtype = getattr(value.dtype, "name", None) or str(value.dtype)
    cls = type(value)
    name = "jax.Array" if cls.__module__.startswith(("jax", "jaxlib")) else _type_name(value)
    where = ""
    for attribute in ("sharding", "device"):
        place = getattr(value, attribute, None)
        if place is not None and not callable(place):
            where = f" {place}"
            break
    return f"{name} {dtype}{shape}{where}"


class _ShortRepr(reprlib.Repr):
    """reprlib's shortened repr, its arrays described instead of printed; ``scale`` times the usual limits."""

    def __init__(self, scale: int = 1) -> None:
        super().__init__()  # Python 3.11's takes no limits: they are set here
        self.maxlevel, self.maxstring, self.maxlong = 2 * scale, 60 * scale, 40 * scale
        self.maxother = MAX_VALUE_CHARS * scale
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = self.maxset = self.maxfrozenset = 6 * scale
        self.maxdeque = 6 * scale

    def repr1(self, x: Any, level: int) -> str:
        if _is_array(x):
            return _array_text(x)
        return super().repr1(x, level)

    def repr_instance(self, x: Any, level: int) -> str:
        text = repr(x)  # reprlib's own swallows errors into "<... instance at ...>": ours says what happened
        return text if len(text) <= self.maxother else text[: self.maxother - 3] + "..."


_SHORT = _ShortRepr()
#: For a value asked for by name (``%kinetic pm``): more of it, on several lines.
_LONG = _ShortRepr(scale=20)


def describe(value: Any, redactor: Redactor, secrets: frozenset[bytes | str] = frozenset(), *,
             limit: int = MAX_VALUE_CHARS, full: bool = False) -> str:
    """A value's short text (``full``: a longer one, its lines kept): arrays by their shape, others by a
    shortened repr; secrets masked; never raises. The caller sets the time limit (:func:`time_limit`)."""
    try:
        if isinstance(value, (str, bytes)) and value in secrets:
            return "'***'"
        text = _array_text(value) if _is_array(value) else (_LONG if full else _SHORT).repr(value)
    except TooSlow:
        raise
    except Exception as error:  # noqa: BLE001 - a __repr__ may raise anything
        text = f"<repr failed: {type(error).__name__}: {str(error)[:80]}>"
    text = redactor.text(text if full else text.replace("\n", " "))
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TooSlow` in the block after ``seconds`` (a SIGALRM timer: main thread only; elsewhere the
    block runs unlimited). Python code that loops or sleeps is stopped; C code that blocks is not."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def too_slow(signum: int, frame: Any) -> None:
        raise TooSlow

    previous = signal.signal(signal.SIGALRM, too_slow)
    started = time.monotonic()
    pending, interval = signal.setitimer(signal.ITIMER_REAL, seconds)  # a timer the cell set is put back after
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending:
            signal.setitimer(signal.ITIMER_REAL, max(0.001, pending - (time.monotonic() - started)), interval)


def _shown(name: str, value: Any, cell_names: frozenset[str] | None) -> bool:
    if name.startswith("_") or isinstance(value, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                                                  type, types.MethodType)):
        return False
    return cell_names is None or name in cell_names


def _code_names(code: types.CodeType) -> set[str]:
    """Every name the cell's code (and the functions and classes it defines) reads or binds."""
    names = set(code.co_names) | set(code.co_varnames)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _code_names(constant)
    return names


def _location(frame: types.FrameType, line: int, filename: str) -> str:
    code = frame.f_code
    place = "Cell" if code.co_filename == filename else code.co_filename
    return f"{place} line {line}" + ("" if code.co_name == "<module>" else f", in {code.co_name}")


def frame_locals(error: BaseException, filename: str, redactor: Redactor,
                 secrets: frozenset[bytes | str] = frozenset()) -> list[FrameLocals]:
    """The failing frames' variables (see the module's note); [] when the failure never reached the cell."""
    described = []
    for what, frame, line in failing_frames(error, filename):
        top_level = frame.f_code.co_name == "<module>"
        cell_names = frozenset(_code_names(frame.f_code)) if top_level else None
        items = [(name, value) for name, value in frame.f_locals.items() if _shown(name, value, cell_names)]
        pairs: list[tuple[str, str]] = []
        deadline = time.monotonic() + FRAME_TIME_LIMIT_S
        for name, value in items[:MAX_NAMES]:
            left = deadline - time.monotonic()
            if left <= 0:
                pairs.append((name, "<not described: the frame's time limit was spent>"))
                continue
            try:
                with time_limit(min(VALUE_TIME_LIMIT_S, left)):
                    text = describe(value, redactor, secrets)
            except TooSlow:
                text = f"<repr took longer than {VALUE_TIME_LIMIT_S:g} s>"
            pairs.append((redactor.text(name), text))
        described.append(FrameLocals(what, _location(frame, line, filename), tuple(pairs),
                                     max(0, len(items) - MAX_NAMES)))
    return described


def locals_notes(frames: list[FrameLocals], host: str) -> list[str]:
    """The notes a raised exception keeps: the first few variables of the first frame that has any."""
    shown = [frame for frame in frames if frame.names]
    return [f"Variables on {host} {shown[0].text(NOTE_NAMES)}"] if shown else []
