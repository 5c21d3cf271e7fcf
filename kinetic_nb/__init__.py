"""kinetic_nb: run a notebook cell on every host of a multi-host TPU/GPU slice.

``%load_ext kinetic_nb`` registers the ``%%kinetic`` cell magic; everything it
does is also plain Python: ``kinetic_nb.submit(source, hosts=4).result()``.

Imports here are lazy, so ``import kinetic_nb.runner`` on a host stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "submit": "kinetic_nb.client.launch",
    "last_job": "kinetic_nb.client.launch",
    "CellHandle": "kinetic_nb.client.cell_handle",
    "JobHandle": "kinetic_nb.client.cell_handle",
    "HostSnapshot": "kinetic_nb.state",
    "JobSnapshot": "kinetic_nb.state",
    "JobStatus": "kinetic_nb.state",
    "resolve_accelerator": "kinetic_nb.accelerators",
    "attach": "kinetic_nb.client.catalog",
    "jobs": "kinetic_nb.client.catalog",
    "gc": "kinetic_nb.client.catalog",
    "accelerator_names": "kinetic_nb.accelerators",
    "start": "kinetic_nb.client.sessions",
    "sessions": "kinetic_nb.client.sessions",
    "attach_session": "kinetic_nb.client.sessions",
    "Session": "kinetic_nb.client.sessions",
    "doctor": "kinetic_nb.backends.kubernetes.doctor",
}
__all__ = [
    "CellHandle",
    "HostSnapshot",
    "JobHandle",
    "JobSnapshot",
    "JobStatus",
    "Session",
    "__version__",
    "accelerator_names",
    "attach",
    "attach_session",
    "doctor",
    "gc",
    "jobs",
    "last_job",
    "load_ipython_extension",
    "resolve_accelerator",
    "sessions",
    "start",
    "submit",
]

if TYPE_CHECKING:
    from kinetic_nb.accelerators import accelerator_names, resolve_accelerator
    from kinetic_nb.backends.kubernetes.doctor import doctor
    from kinetic_nb.client.catalog import attach, gc, jobs
    from kinetic_nb.client.cell_handle import CellHandle, JobHandle
    from kinetic_nb.client.launch import last_job, submit
    from kinetic_nb.client.sessions import Session, attach_session, sessions, start
    from kinetic_nb.state import HostSnapshot, JobSnapshot, JobStatus


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kinetic_nb' has no attribute {name!r}")
    # The face wires the client to the display: a handle the API returns is shown by the display's views.
    importlib.import_module("kinetic_nb.notebook.display")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once; no submodule of this package bears an exported name
    return value


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext kinetic_nb``: register ``%%kinetic``, and show kinetic_nb's errors as one line.

    The magic imports ``kinetic_nb.notebook.display``, which registers the views a
    ``CellHandle`` is shown by (``kinetic_nb.views``), as the first use of the API does.
    """
    from kinetic_nb.notebook.magics import KineticMagics, show_kinetic_errors_briefly

    ipython.register_magics(KineticMagics)
    show_kinetic_errors_briefly(ipython)
