"""Where a job's hosts run: a registry of backends (``local`` processes, ``kubernetes`` pods, ``ray`` actors, ...).

A backend registers itself with :func:`register`; the magic lists every
registered backend's flags, grouped by backend, and ``get_backend`` builds one
by name. Light on purpose: a backend's heavy client is imported only when it
first talks to its platform.
"""

from __future__ import annotations

from typing import Any

from kinetic_nb.backends.base import (
    Backend,
    BackendFlag,
    JobSecrets,
    PlatformView,
    backend_class,
    backend_names,
    register,
)


def get_backend(name: str, **options: Any) -> Backend:
    """The backend called ``name``, configured by ``options`` (see each backend's ``from_options``)."""
    return backend_class(name).from_options(**options)


# The built-in backends register themselves on import.
from kinetic_nb.backends import local as _local  # noqa: E402, F401
from kinetic_nb.backends.kubernetes import backend as _kubernetes  # noqa: E402, F401
from kinetic_nb.backends.ray import backend as _ray  # noqa: E402, F401
from kinetic_nb.backends.ssh import backend as _ssh  # noqa: E402, F401
from kinetic_nb.backends.ssh import tpu_vm as _tpu_vm  # noqa: E402, F401

BACKENDS = backend_names()

__all__ = ["BACKENDS", "Backend", "BackendFlag", "JobSecrets", "PlatformView", "backend_class", "backend_names", "get_backend",
           "register"]
