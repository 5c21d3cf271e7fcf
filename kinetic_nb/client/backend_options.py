"""What the notebook face knows of the backends: each one's name, summary, flags and ``%config`` settings.

The magics name no backend. They list what every registered backend declares
(its flags, under its name in ``%%kinetic?``; the flags it declares settings,
as ``%config KineticMagics.<option>``) and turn what a user gave into the
chosen backend's options with :func:`chosen_options`, which ``submit`` and
``start`` take as ``backend_options``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kinetic_nb.backends import Backend, BackendFlag, backend_class, backend_names

__all__ = ["BackendFlag", "backends", "chosen_options", "doctor", "doctor_backends", "names", "settings"]


def names() -> tuple[str, ...]:
    """The registered backends' names, in registration order (``local`` first)."""
    return backend_names()


def backends() -> list[type[Backend]]:
    """The registered backends, in registration order: each has ``name``, ``summary`` and ``flags``."""
    return [backend_class(name) for name in backend_names()]


def settings() -> list[tuple[str, BackendFlag]]:
    """``(backend name, flag)`` for each flag a backend declares a ``%config`` setting too."""
    return [(backend.name, flag) for backend in backends() for flag in backend.flags if flag.setting]


def shared_flags() -> dict[str, list[str]]:
    """Each flag string that more than one backend declares (``--requirements``: kubernetes, ssh, tpu-vm), and
    those backends' names in registration order: the magics add such a flag once, and each of them takes it."""
    declared: dict[str, list[str]] = {}
    for backend in backends():
        for flag in backend.flags:
            declared.setdefault(flag.flag, []).append(backend.name)
    return {flag: names for flag, names in declared.items() if len(names) > 1}


def chosen_options(backend: str, given: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The options of backend ``backend`` from the flags ``given`` (by ``dest``; None: not given) and
    the notebook's ``config`` settings (by option; None: not set).

    Raises
    ------
    ValueError
        One line, for a flag of another backend than the chosen one, or an unknown backend.
    """
    chosen = backend_class(backend)
    options: dict[str, Any] = {flag.option: given[flag.dest] for flag in chosen.flags
                               if given.get(flag.dest) is not None}
    ours = {flag.dest for flag in chosen.flags}
    for other in backends():
        for flag in other.flags:
            if given.get(flag.dest) is not None and flag.dest not in ours:
                takers = shared_flags().get(flag.flag, [other.name])
                raise ValueError(f"{flag.flag} is for -b {', -b '.join(takers)}, and this cell runs on "
                                 f"-b {chosen.name}")
    defaults = {flag.option: config.get(flag.option) for flag in chosen.flags if flag.setting}
    if any(value is not None for value in defaults.values()):
        options["config"] = defaults
    return options


def build(backend: str, options: Mapping[str, Any]) -> Backend:
    """The backend ``backend``, configured by ``options`` (its flags' values): built once by the magic, which
    asks it how many hosts it names (``-b ssh``) before the panel is drawn."""
    return backend_class(backend).from_options(**dict(options))


def doctor_backends() -> list[type[Backend]]:
    """The backends ``%kinetic doctor`` can check (each declares ``has_doctor``, or is reached over ssh)."""
    return [backend for backend in backends() if backend.has_doctor or _reached_over_ssh(backend)]


def doctor(backend: str, accelerator: str | None, storage: str | None, options: Mapping[str, Any]) -> Any:
    """Backend ``backend``'s readiness report for ``accelerator`` and ``storage`` (``ValueError`` if it has none)."""
    chosen = backend_class(backend)
    if not chosen.has_doctor and _reached_over_ssh(chosen):
        from kinetic_nb.backends.ssh.doctor import doctor_for

        return doctor_for(chosen, accelerator, storage, options)
    return chosen.doctor(accelerator, storage, options)


def _reached_over_ssh(backend: type[Backend]) -> bool:
    """``-b ssh`` and ``-b tpu-vm``, whose doctor (``backends/ssh/doctor.py``) their classes do not declare yet."""
    from kinetic_nb.backends.ssh.backend import SshBackend

    return issubclass(backend, SshBackend)
