"""``submit``: store a cell's plan and payload, launch its hosts, and hand back its ``CellHandle``."""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kinetic_nb.accelerators import Accelerator, local_notice
from kinetic_nb.backends import Backend, JobSecrets, get_backend
from kinetic_nb.client.cell_handle import CellHandle
from kinetic_nb.client.echo import show_output
from kinetic_nb.client.host_group import HostGroup
from kinetic_nb.client.keys import create_key
from kinetic_nb.client.plan import (
    backend_slice,
    check_shape,
    choose_framework,
    choose_procs_per_host,
    make_plan,
    new_job_id,
    prepare_cell,
)
from kinetic_nb.errors import (
    KineticWarning,
)
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import write_sealed
from kinetic_nb.runner.job_keys import JOB, SESSION
from kinetic_nb.runner.redact import SecretValue
from kinetic_nb.runner.workdir import store_workdir
from kinetic_nb.shipping.workdir import pack_folder
from kinetic_nb.storage import LocalStorage, Storage, default_root, open_storage
from kinetic_nb.storage.defaults import STORAGE_ENV

logger = logging.getLogger(__name__)

__all__ = ["CellHandle", "last_job", "submit"]


def choose_backend(backend: str | Backend, options: Mapping[str, Any] | None) -> Backend:
    """The backend a job or session runs on: one given as it is, or one built by name from ``options``."""
    if isinstance(backend, Backend):
        if options:
            raise ValueError("backend_options configure a backend given by name, not a Backend instance")
        return backend
    return get_backend(backend, **dict(options or {}))


def launch_hosts(group_id: str, kind: str, root: Storage, backend: Backend, acc: Accelerator, hosts: int, *,
                 framework: str, env: Mapping[str, str], quiet: bool, payload: bytes | None = None,
                 echo: Callable[[str, str], None] | None = None, detached: bool = False, keep: bool = False,
                 procs_per_host: int | None = None, cell: str = "", **plan_options: Any) -> HostGroup:
    """The one launch path of a group of hosts, a one-shot job's (``kind`` JOB, its cell's ``payload``) or a
    session's (SESSION): the plan, the backend's preflight, the key, the sealed plan and handle record, then the
    hosts. Nothing is stored before the preflight passed; the key exists before anything of the group is."""
    plan = make_plan(job_id=group_id, acc=acc, hosts=hosts, framework=framework,
                     coordinator_address=backend.coordinator_address(group_id),
                     simulated=backend.simulates(acc), env_names=sorted(env),
                     start_window=backend.start_window_s(), session=kind == SESSION,
                     procs_per_host=choose_procs_per_host(acc, framework, procs_per_host), **plan_options)
    backend.preflight(plan)
    folder = (pack_folder(os.getcwd(), leave_out=[path for path in [root.local_path()] if path])
              if backend.ships_workdir else None)  # too large: one line, nothing stored
    if folder is not None:
        plan = dataclasses.replace(plan, workdir=protocol.WORKDIR)
    if acc.simulated_locally and plan.simulated and not quiet:
        print(local_notice(acc, plan.procs_per_host, hosts))  # notices are stdout: no error box for news
    for notice in [] if quiet else backend.launch_notices(plan):
        print(f"kinetic_nb: {notice}")
    warn_if_shared(root)
    storage = root.child(group_id)
    key = create_key(group_id, kind)  # kept by this user only, before anything of the group is stored
    if payload is not None:
        write_sealed(storage, protocol.PAYLOAD, key, payload, exclusive=True)
    if folder is not None:
        store_workdir(storage, protocol.WORKDIR, key, folder.data)  # encrypted, then sealed
        if not quiet:
            print(f"kinetic_nb: {folder.notice(os.getcwd())}")
    write_sealed(storage, protocol.PLAN, key, plan.to_json(), exclusive=True)
    group = HostGroup(storage, plan, backend, key=key, echo=echo, detached=detached, keep=keep)
    # The job's listing names its cell as the notebook does (In[4]).
    group.write_record(**({"kind": "session"} if kind == SESSION else {}), **({"cell": cell} if cell else {}))
    backend.launch(storage, plan, JobSecrets(key=key, env=dict(env)))
    return group


def storage_root(backend: Backend) -> str:
    """Where a job goes when ``--storage`` names nothing: ``$KINETIC_STORAGE``, else the backend's own
    (a ``kinetic up`` cluster's jobs bucket), else the per-user directory."""
    return os.environ.get(STORAGE_ENV) or backend.default_storage() or default_root()


def warn_if_shared(root: Storage) -> None:
    """One line when a local storage root is writable by others: they could plant or remove jobs there."""
    path = root.named_root if isinstance(root, LocalStorage) else root.local_path()  # not its uid-UID/ below
    try:
        mode = os.stat(path).st_mode if path else 0
    except OSError:
        return  # created below, 0700
    if mode & 0o022:
        warnings.warn(f"the storage root {root.uri} is writable by other users (mode {mode & 0o777:o}): they can "
                      "plant or remove jobs there; kinetic_nb verifies what it reads, but prefer a root only you "
                      "can write", KineticWarning, stacklevel=3)


_last_handle: CellHandle | None = None


def last_job() -> CellHandle | None:
    """The most recent job submitted from this process (what the last ``%%kinetic`` ran)."""
    return _last_handle


def print_to_stdout(text: str, stream: str = protocol.STDOUT) -> None:
    """Echo a host's output here: to this process's stream of the same name, a display record as rich output."""
    show_output(text, stream)


def submit(
    source: str,
    *,
    hosts: int | None = None,
    accelerator: str | None = None,
    backend: str | Backend = "local",
    framework: str = "auto",
    namespace: Mapping[str, Any] | None = None,
    out: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    storage: str | None = None,
    cell_name: str = "kinetic cell",
    echo: bool | Callable[[str], None] = False,
    quiet: bool = False,
    grace: float | None = None,
    detach: bool = False,
    keep: bool = False,
    backend_options: Mapping[str, Any] | None = None,
    procs_per_host: int | None = None,
    profile: bool = False,
) -> CellHandle:
    """Run ``source`` on every host of a slice; return at once with a ``CellHandle`` on its one cell.

    Parameters
    ----------
    source : str
        The cell's code. Its last expression, on the leader, is the value.
    hosts : int, optional
        Number of hosts (default: the accelerator's, or 1).
    accelerator : str, optional
        A name such as ``tpu-v5e-16`` or ``gpu-h100x8`` (simulated on CPU locally).
    backend : str or Backend
        A registered backend's name (``local``, ``kubernetes``), or a
        ``Backend`` instance (``kinetic_nb.backends.testing.FakeBackend`` in tests).
    framework : {"auto", "jax", "torch", "none"}
        What to initialize before the cell; ``auto`` decides by the cell's imports.
    namespace : mapping, optional
        Where the cell's free names are looked up (the notebook's namespace).
    out : iterable of str
        Leader variables to bring back in ``CellHandle.outputs``.
    env : mapping, optional
        Extra environment variables for every host. Their values are secrets:
        held as ``SecretValue`` (masked in every repr), redacted from the hosts'
        logs and reports in every form, never stored.
    timeout : float, optional
        Seconds before the job is stopped and ``KineticTimeoutError`` raised.
    storage : str, optional
        Storage root URI (default: a per-user directory, or ``$KINETIC_STORAGE``).
    echo : bool or callable
        Print the leader's output while waiting (stdout and stderr to their
        own streams), or call ``echo(text, stream)`` with it (``stream`` is
        ``"out"`` or ``"err"``).
    quiet : bool
        Do not print the notice that an accelerator is simulated.
    grace : float, optional
        Seconds the other hosts get to report after one fails, before they are
        stopped (default 10).
    detach : bool
        Show the live panel and keep it current in the background; an
        interrupt never cancels a detached job.
    keep : bool
        Keep all of the job's objects after a success (by default only
        ``handle.json`` and ``outputs/`` stay).
    backend_options : mapping, optional
        The backend's settings; ``kubernetes``: ``namespace``, ``image``,
        ``service_account``, ... and ``config`` (see ``KubernetesSettings.resolve``).
    procs_per_host : int, optional
        Processes on each host, each with its own rank (``RANK``,
        ``LOCAL_RANK``, ...). Default: one per GPU for torch on GPU hosts, else
        one (see ``client.plan.choose_procs_per_host``).
    profile : bool
        Run the cell under its framework's profiler on every host; ``handle.profile()`` merges the hosts'
        traces into one (``client.profile``).
    """
    namespace = {} if namespace is None else namespace
    out = list(out)
    env = {name: SecretValue(value) for name, value in (env or {}).items()}  # masked in any traceback from here on
    check_shape(hosts=hosts, timeout=timeout, grace=grace, procs_per_host=procs_per_host)
    chosen_backend = choose_backend(backend, backend_options)
    acc, host_count = backend_slice(chosen_backend, hosts, accelerator)
    payload = prepare_cell(source, namespace, filename=f"<{cell_name}>", out=out,
                           extra={protocol.CELL_PROFILE: True} if profile else None)
    # Messages and the job's listing name the cell as the notebook does (In[4]); a job from the API by its id.
    cell = cell_name.removeprefix("kinetic ") if cell_name != "kinetic cell" else ""
    group = launch_hosts(new_job_id(), JOB, open_storage(storage or storage_root(chosen_backend)), chosen_backend, acc, host_count,
                          framework=choose_framework(framework, payload.modules), env=env, quiet=quiet,
                          payload=payload.data, echo=print_to_stdout if echo is True else (echo or None),
                          detached=detach, keep=keep, timeout=timeout, grace=grace, procs_per_host=procs_per_host,
                          cell=cell)
    handle = CellHandle(group, profiled=profile, name=cell or None)
    global _last_handle
    _last_handle = handle
    if detach:
        handle.watch()
    return handle
