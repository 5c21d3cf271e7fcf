"""Where a job's hosts run: ``local`` processes (and ``kubernetes`` later).

Light on purpose: a backend's heavy client is imported only when it is used.
"""

from __future__ import annotations

from kinetic_nb.backends.base import Backend

BACKENDS = ("local",)


def get_backend(name: str) -> Backend:
    """The backend called ``name``."""
    if name == "local":
        from kinetic_nb.backends.local import LocalBackend

        return LocalBackend()
    raise ValueError(f"unknown backend {name!r}; choose from: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "get_backend"]
