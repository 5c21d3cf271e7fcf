"""What ``%kinetic start`` parses, and whether a ``%%kinetic`` cell fits the session it would run on.

The magic stays thin: it parses here, calls :mod:`kinetic_nb.client.sessions`, and
turns a mismatch into one ``UsageError`` line naming the session.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser

from kinetic_nb.client import backend_options, sessions
from kinetic_nb.client.plan import backend_slice, check_shape, choose_procs_per_host, resolve_slice
from kinetic_nb.client.sessions import Session
from kinetic_nb.notebook.display import live_view
from kinetic_nb.runner.redact import SecretValue
from kinetic_nb.state import JobSnapshot

#: The backend a cell runs on when neither ``-b`` nor ``%config KineticMagics.backend`` says.
BACKEND_ENV = "KINETIC_BACKEND"
#: The flags that choose a slice, the same for ``%%kinetic`` and ``%kinetic start``: (names, argparse options).
SLICE_FLAGS = (
    (("-n", "--hosts"), dict(type=int, default=None, help="Number of hosts (default: the accelerator's, or 1).")),
    (("-a", "--accelerator"), dict(default=None, help="Accelerator name, e.g. tpu-v5e-16 or gpu-h100x8 (simulated "
                                                       "on CPU locally).")),
    (("-b", "--backend"), dict(default=None, choices=list(backend_options.names()), help="Where the hosts run: " +
                               "; ".join(f"{backend.name}: {backend.summary}" for backend in backend_options.backends())
                               + f". Default: %%config KineticMagics.backend, then ${BACKEND_ENV}, then local.")),
    (("-e", "--env"), dict(action="append", default=[], metavar="KEY=VALUE", type=SecretValue,
                           help="Set an environment variable on every host (repeatable).")),
    (("--procs-per-host",), dict(type=int, default=None, metavar="N",
                                 help="Processes on each host, each with its own rank (default: one per GPU for "
                                      "torch on GPU hosts, else one).")),
)


def choose_backend_name(given: str | None, configured: str | None) -> str:
    """The backend a cell runs on: ``-b``, else the notebook's ``%config KineticMagics.backend``, else
    ``$KINETIC_BACKEND``, else local. A cell on local by default while a backend's own variable is set (its
    hosts named, ``KINETIC_SSH_HOSTS``) says so, once, on stdout: it is probably not where the user meant."""
    name = given or configured or os.environ.get(BACKEND_ENV) or "local"
    if name not in backend_options.names():
        where = "-b" if given else "%config KineticMagics.backend" if configured else f"${BACKEND_ENV}"
        raise UsageError(f"{where} names no backend: {name!r}; one of {', '.join(backend_options.names())}")
    if name == "local" and not (given or configured or os.environ.get(BACKEND_ENV)):
        for backend in backend_options.backends():
            named = [variable for variable in backend.named_by if os.environ.get(variable)]
            if named:
                print(f"kinetic_nb: this cell runs here (-b local); ${named[0]} names hosts of -b {backend.name}: "
                      f"add -b {backend.name}, or make it the default with %config KineticMagics.backend = "
                      f"{backend.name!r} (or ${BACKEND_ENV}={backend.name})")
                break
    return name


def add_backend_flags(parser: MagicArgumentParser, backends: list[Any]) -> MagicArgumentParser:
    """Each of ``backends``' own flags, its name in their help."""
    shared = backend_options.shared_flags()
    added: set[str] = set()
    for backend in backends:
        for flag in backend.flags:
            if flag.flag not in added:  # a flag several backends take is added once
                names = shared.get(flag.flag, [backend.name])
                parser.add_argument(flag.flag, **flag.argparse_options(f" (-b {', -b '.join(names)})"))
                added.add(flag.flag)
    return parser


def session_start_parser(make_parser: Callable[..., MagicArgumentParser]) -> MagicArgumentParser:
    """``%kinetic start``: the flags that choose a slice, each backend's own, and ``--idle-timeout``."""
    return add_backend_flags(make_parser(
        "%kinetic start",
        *SLICE_FLAGS,
        (("--framework",), dict(default="auto", choices=["auto", "jax", "torch", "none"],
                                help="Initialize it once at start; auto: when the first cell imports one.")),
        (("--grace", ), dict(type=float, default=None, metavar="S",
                             help="After a failed or interrupted cell, the hosts get S seconds to be back.")),
        (("--idle-timeout",), dict(type=float, default=sessions.DEFAULT_IDLE_TIMEOUT_S, metavar="S",
                                   help="Stop the session after S seconds with no cell (0: never).")),
    ), backend_options.backends())


def doctor_parser(parser_for: Any) -> Any:
    """``%kinetic doctor``: ``-a``, ``--storage``, ``-b`` among the backends that have a doctor, and their flags."""
    checked = backend_options.doctor_backends()
    return add_backend_flags(parser_for(
        "%kinetic doctor",
        (("-a", "--accelerator"), dict(default=None, help="The accelerator to check for, e.g. tpu-v5e-16.")),
        (("-b", "--backend"), dict(default=checked[0].name if checked else None,
                                   choices=[backend.name for backend in checked], help="The backend to check."))),
        checked)


def start_session(args: Any, options: Mapping[str, Any], env: Mapping[str, str]) -> Session:
    try:
        check_shape(hosts=args.hosts, grace=args.grace, idle_timeout=args.idle_timeout,
                    procs_per_host=args.procs_per_host, flags=True)
    except ValueError as error:
        raise UsageError(str(error)) from None
    try:
        backend = backend_options.build(args.backend, options)  # the hosts it names (-b ssh) when -n does not
        acc, hosts = backend_slice(backend, args.hosts, args.accelerator)
        per_host = choose_procs_per_host(acc, args.framework, args.procs_per_host)
    except ValueError as error:
        raise UsageError(str(error)) from None
    try:
        return with_start_panel(hosts * per_host, per_host, lambda show: sessions.start(
            hosts=args.hosts, accelerator=args.accelerator, backend=backend, framework=args.framework, env=env,
            storage=args.storage, idle_timeout=args.idle_timeout, grace=args.grace, on_snapshot=show,
            procs_per_host=args.procs_per_host))
    except ValueError as error:
        raise UsageError(str(error)) from None


def with_start_panel(processes: int, per_host: int, start: Callable[[Callable[[JobSnapshot], None]], Session]
                     ) -> Session:
    """``start(show)``, with the same panel as a cell's live while the hosts start (``%kinetic start`` and
    ``restart`` alike); one line once they are all up, the hosts as they ended if they did not come up."""
    view = live_view(processes, brief=True, procs_per_host=per_host)
    last: list[JobSnapshot] = []

    def show(snapshot: JobSnapshot) -> None:
        last[:] = [snapshot]
        view.update(snapshot)

    try:
        return start(show)
    finally:
        if last:
            view.close(last[0])


def check_cell_fits_session(session: Session, args: Any, backend_options: Mapping[str, Any],
                            env: Mapping[str, str]) -> None:
    """A cell's shaping flags must agree with the session's (per-cell flags such as ``--timeout``, ``-o``
    and ``--quiet`` stay the cell's); ``--once`` runs a one-shot job beside it instead."""
    plan = session.plan
    given: list[str] = []
    if args.hosts is not None or args.accelerator is not None:
        acc, hosts = resolve_slice(args.hosts, args.accelerator)
        if hosts != plan.hosts or (args.accelerator is not None and acc.name != plan.accelerator):
            given.append(" ".join(flag for flag, value in (("-n", args.hosts), ("-a", args.accelerator))
                                  if value is not None for flag in (f"{flag} {value}",)))
    if args.backend is not None and args.backend != session.group.backend.name:
        given.append(f"-b {args.backend}")
    if args.procs_per_host is not None and args.procs_per_host != plan.procs_per_host:
        given.append(f"--procs-per-host {args.procs_per_host}")
    if args.framework != "auto" and args.framework != plan.framework:
        given.append(f"--framework {args.framework}")
    if args.storage is not None and not session.storage.uri.startswith(args.storage.rstrip("/")):
        given.append(f"--storage {args.storage}")
    if env:
        given.append("-e " + " -e ".join(sorted(env)))
    if args.grace is not None and args.grace != plan.grace_s:
        given.append(f"--grace {args.grace:g}")
    if backend_options:
        given.append(", ".join(sorted(backend_options)))
    if args.detach or args.keep:
        given.append("--detach" if args.detach else "--keep")
    if given:
        raise UsageError(f"this notebook runs its cells on session {session.session_id} ({plan.hosts} hosts, "
                         f"{plan.accelerator}, framework {plan.framework}): {'; '.join(given)} does not fit it; "
                         "%%kinetic --once runs a one-shot job beside it")
