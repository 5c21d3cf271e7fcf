"""Where a job's hosts run: ``local`` processes, or ``kubernetes`` pods.

Light on purpose: a backend's heavy client is imported only when it is used.
"""

from __future__ import annotations

from typing import Any

from kinetic_nb.backends.base import Backend

BACKENDS = ("local", "kubernetes")


def get_backend(name: str, **options: Any) -> Backend:
    """The backend called ``name``; ``options`` configure it (kubernetes: see ``KubernetesSettings.resolve``)."""
    if name == "local":
        if options:
            raise ValueError(f"the local backend takes no options, got {', '.join(sorted(options))}")
        from kinetic_nb.backends.local import LocalBackend

        return LocalBackend()
    if name == "kubernetes":
        from kinetic_nb.backends.kubernetes import KubernetesBackend, KubernetesSettings

        return KubernetesBackend(KubernetesSettings.resolve(**options))
    raise ValueError(f"unknown backend {name!r}; choose from: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "get_backend"]
