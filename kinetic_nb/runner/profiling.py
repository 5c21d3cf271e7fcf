"""A profiled cell on one host: the framework's own profiler around the cell, its trace stored for the notebook.

``%%kinetic --profile`` (and ``%kinetic profile`` for a session's next cell)
puts ``profile: True`` in the cell's payload. Each host then, after the
cell's barrier:

- starts its framework's profiler: ``jax.profiler.start_trace`` for JAX,
  ``torch.profiler.profile`` for torch (CPU, and CUDA where torch sees it);
  the framework is the cell's, else one the process has imported; with none,
  only kinetic_nb's own spans are recorded;
- runs the cell inside an annotation (``kinetic cell N``), noting this host's
  clock as it enters it, and the time it passed the barrier;
- stops the profiler whether the cell succeeded or not, and stores one record,
  ``profile/host-{rank}.json.gz`` in the cell's folder, sealed under the cell's
  key: those times, the framework's trace (Chrome-trace JSON) and, when
  there is no trace, why.

The notebook (``client.profile``) merges the hosts' records into one trace,
each host's events placed by its own clock relative to its own barrier exit:
hosts' clocks differ, but every host leaves the barrier at nearly the same
moment. Host-safe: the frameworks are imported only when a cell uses them.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["CellProfiler", "annotation_name", "profiler_framework"]

#: What the cell's span is called in the framework's trace (the merge finds it there).
ANNOTATION = "kinetic cell {seq}"


def annotation_name(seq: int) -> str:
    return ANNOTATION.format(seq=seq)


def profiler_framework(framework: str) -> str | None:
    """Whose profiler runs: the cell's framework, else one this process has already imported, else None."""
    if framework in ("jax", "torch"):
        return framework
    return next((name for name in ("jax", "torch") if name in sys.modules), None)


class CellProfiler:
    """One host's profile of one cell: ``start``, then the cell inside ``span``, then ``record``."""

    def __init__(self, framework: str, seq: int, rank: int, barrier_at: float):
        self.framework = profiler_framework(framework)
        self.seq, self.rank = seq, rank
        #: This host's clock (``time.time``) as it passed the cell's barrier, entered the annotation and left it.
        self.barrier_at = barrier_at
        self.marker_at: float | None = None
        self.ended_at: float | None = None
        self.problem = "" if self.framework else "no framework profiler: the cell uses neither JAX nor torch"
        self._logdir: str | None = None
        self._torch_profile: Any = None

    def start(self) -> None:
        """Start the framework's profiler; a profiler that will not start is said in the record, never raised."""
        try:
            if self.framework == "jax":
                import jax

                self._logdir = tempfile.mkdtemp(prefix="kinetic-profile-")
                jax.profiler.start_trace(self._logdir)
            elif self.framework == "torch":
                import torch
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                self._torch_profile = profile(activities=activities)
                self._torch_profile.__enter__()
        except Exception as error:  # noqa: BLE001 - a profile that did not start must not fail the cell
            self.problem = f"the {self.framework} profiler did not start: {type(error).__name__}: {error}"
            self.framework = None
            self._cleanup()

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        """The cell, inside the framework's annotation, its start and end on this host's clock."""
        annotation: Any = contextlib.nullcontext()
        if self.framework == "jax":
            import jax

            annotation = jax.profiler.TraceAnnotation(annotation_name(self.seq))
        elif self.framework == "torch":
            import torch

            annotation = torch.profiler.record_function(annotation_name(self.seq))
        self.marker_at = time.time()
        try:
            with annotation:
                yield
        finally:
            self.ended_at = time.time()

    def record(self) -> bytes:
        """Stop the profiler and return the host's record, gzipped JSON (its trace, or why there is none)."""
        trace = None
        try:
            trace = self._stop()
        except Exception as error:  # noqa: BLE001 - the cell's outcome stands; the record says what went wrong
            self.problem = f"the {self.framework} profiler failed: {type(error).__name__}: {error}"
        finally:
            self._cleanup()
        ended = self.ended_at or time.time()
        record = {"rank": self.rank, "seq": self.seq, "framework": self.framework or "", "problem": self.problem,
                  "barrier_at": self.barrier_at, "marker_at": self.marker_at or ended, "ended_at": ended,
                  "annotation": annotation_name(self.seq), "trace": trace}
        return gzip.compress(json.dumps(record).encode(), compresslevel=5)

    def _stop(self) -> dict | None:
        if self.framework == "jax":
            import jax

            jax.profiler.stop_trace()
            found = sorted(glob.glob(os.path.join(self._logdir, "plugins", "profile", "*", "*.trace.json.gz")))
            if not found:
                self.problem = "the jax profiler wrote no trace"
                return None
            with gzip.open(found[-1], "rt", encoding="utf-8") as file:
                return json.load(file)
        if self.framework == "torch":
            profile, self._torch_profile = self._torch_profile, None
            profile.__exit__(None, None, None)
            with tempfile.TemporaryDirectory(prefix="kinetic-profile-") as folder:
                path = os.path.join(folder, "trace.json")
                profile.export_chrome_trace(path)
                with open(path, encoding="utf-8") as file:
                    return json.load(file)
        return None

    def _cleanup(self) -> None:
        if self._logdir is not None:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None
