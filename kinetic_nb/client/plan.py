"""Build the one immutable plan every host receives, and the cell's payload.

``JobPlan`` itself is wire protocol and lives in ``runner.protocol``; this
module decides its contents from what the user asked for.
"""

from __future__ import annotations

import datetime
import math
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import cloudpickle

from kinetic_nb.accelerators import Accelerator, cloud_tpu_accelerator, resolve_accelerator
from kinetic_nb.backends.host_environment import package_version
from kinetic_nb.errors import ProtocolVersionError, UnknownAcceleratorError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.cell import remember_source
from kinetic_nb.runner.protocol import Framework, JobPlan
from kinetic_nb.runner.versions import installed_versions
from kinetic_nb.shipping import capture
from kinetic_nb.shipping.bindings import check_out_names

__all__ = ["CellPayload", "JobPlan", "choose_framework", "make_plan", "new_job_id", "prepare_cell", "resolve_slice"]

#: Packages whose presence in a cell means it wants jax.distributed.
JAX_PACKAGES = frozenset({"jax", "jaxlib", "flax", "optax", "orbax", "equinox", "keras_hub"})
#: Packages whose presence in a cell means it wants torch.distributed.
TORCH_PACKAGES = frozenset({"torch", "torchvision", "torchaudio", "lightning", "pytorch_lightning"})

#: How long a host waits at the start barrier for the others once they could all
#: have started: long enough to pull an image and import a framework on a busy
#: node. A backend whose hosts may start further apart (pods Pending while nodes
#: are added) adds its start window (``Backend.start_window_s``).
DEFAULT_BARRIER_TIMEOUT_S = 300.0
#: JAX declares a silent peer dead after this long (its default is 100 s).
DEFAULT_HEARTBEAT_TIMEOUT_S = 30
#: JAX's shutdown barrier waits this long for peers (its default is 300 s).
DEFAULT_SHUTDOWN_TIMEOUT_S = 10
#: After a host fails, the others get this long to report their own failures
#: before they are stopped.
DEFAULT_GRACE_S = 10.0


def new_job_id(prefix: str = "kn") -> str:
    """A job id (``kn-...``; a session's ``ks-...``) that sorts by time and is unique enough to share a bucket."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return f"{prefix}-{stamp}-{secrets.token_hex(3)}"


#: How ``check_shape`` names each value: as the Python API's parameter, or as the magic's flag.
_SHAPE_NAMES = {"hosts": ("hosts", "-n/--hosts"), "timeout": ("timeout", "--timeout"), "grace": ("grace", "--grace"),
                "idle_timeout": ("idle_timeout", "--idle-timeout"),
                "procs_per_host": ("procs_per_host", "--procs-per-host")}


def check_shape(*, hosts: int | None = None, timeout: float | None = None, grace: float | None = None,
                idle_timeout: float | None = None, procs_per_host: int | None = None, flags: bool = False) -> None:
    """The one check of a cell's or a session's numbers (None: not given), for ``submit``, ``start``, a
    session cell and the magics: one ``ValueError`` line naming the parameter, or with ``flags`` the flag
    (the magic turns it into a ``UsageError``)."""
    def name(value: str) -> str:
        return _SHAPE_NAMES[value][1 if flags else 0]

    if hosts is not None and not hosts >= 1:
        raise ValueError(f"{name('hosts')} must be at least 1, got {hosts}")
    if procs_per_host is not None and not procs_per_host >= 1:
        raise ValueError(f"{name('procs_per_host')} must be at least 1, got {procs_per_host}")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"{name('timeout')} must be a positive number of seconds, got {timeout:g}")
    if grace is not None and not (math.isfinite(grace) and grace >= 0):
        raise ValueError(f"{name('grace')} must be a number of seconds, 0 or more, got {grace:g}")
    if idle_timeout is not None and not (math.isfinite(idle_timeout) and idle_timeout >= 0):
        raise ValueError(f"{name('idle_timeout')} must be 0 (never) or a positive number of seconds, "
                         f"got {idle_timeout:g}")


def resolve_slice(hosts: int | None, accelerator: str | None) -> tuple[Accelerator, int]:
    """The accelerator and host count from ``-n`` and ``-a``: a TPU slice has its own number of hosts (``-n``
    must agree); a GPU name is a host's shape (``gpu-h100x8``: 8 GPUs), of which ``-n`` hosts make the slice."""
    check_shape(hosts=hosts)
    acc = resolve_accelerator(accelerator or "cpu")
    if accelerator is None or acc.kind in ("cpu", "gpu"):
        return acc, hosts or acc.hosts
    if hosts is not None and hosts != acc.hosts:
        raise ValueError(f"{hosts} hosts do not match {acc.name}, which has {acc.hosts} hosts")
    return acc, acc.hosts


def backend_slice(backend: Any, hosts: int | None, accelerator: str | None) -> tuple[Accelerator, int]:
    """:func:`resolve_slice`, the backend filling what ``-n`` and ``-a`` leave out: the hosts it names
    (``--ssh-hosts``), the slice it is (a TPU VM's type)."""
    own = backend.default_accelerator()
    if accelerator and own and not names_the_slice(accelerator, own):
        raise ValueError(f"-a {accelerator} does not match the slice -b {backend.name} runs on, a {own}: leave -a out")
    return resolve_slice(hosts if hosts is not None else backend.default_hosts(), own or accelerator)


def names_the_slice(accelerator: str, own: str) -> bool:
    """Whether ``-a`` names the slice a backend is (``own``, a canonical name): by our names and aliases, or, for
    a bare spelling keras-kinetic reads another way (``v4-32``), in Cloud TPU's naming, which a TPU VM's own type
    uses; a name that is neither raises as ``resolve_accelerator`` does."""
    try:
        return resolve_accelerator(accelerator).name == own
    except UnknownAcceleratorError as unknown:
        try:
            return cloud_tpu_accelerator(accelerator).name == own
        except UnknownAcceleratorError:
            raise unknown from None


def choose_procs_per_host(acc: Accelerator, framework: str, requested: int | None = None) -> int:
    """Processes on each host: ``requested`` (``--procs-per-host``), else the framework's convention.

    torch on GPU hosts runs one process per GPU (as torchrun, Accelerate's
    ``notebook_launcher`` and Lightning's ``ddp_notebook`` do); JAX runs one
    process per host that drives every local device (ask for one per GPU with
    ``--procs-per-host``); TPU hosts run one process each, which holds the
    host's chips. A session that picks its framework at its first cell
    (``auto``) runs one per host unless told.
    """
    if requested is None:
        return acc.devices_per_host if acc.kind == "gpu" and framework == Framework.TORCH.value else 1
    check_shape(procs_per_host=requested)
    if acc.kind == "tpu" and requested != 1:
        raise ValueError(f"{requested} processes per host: {acc.name} hosts run one process each (it holds every "
                         "TPU chip of its host)")
    if acc.kind == "gpu" and acc.devices_per_host % requested:
        raise ValueError(f"{requested} processes per host do not divide the {acc.devices_per_host} GPUs of a "
                         f"{acc.name} host: each process drives the same number of GPUs")
    return requested


def choose_framework(requested: str, modules: Iterable[str]) -> str:
    """``auto`` becomes jax or torch by what the cell imports, else none."""
    if requested != "auto":
        return Framework(requested).value
    modules = set(modules)
    wants_jax, wants_torch = bool(modules & JAX_PACKAGES), bool(modules & TORCH_PACKAGES)
    if wants_jax and wants_torch:
        raise ValueError("the cell imports both jax and torch: choose the framework to initialize (jax or torch)")
    if wants_jax:
        return Framework.JAX.value
    if wants_torch:
        return Framework.TORCH.value
    return Framework.NONE.value


class CellPayload:
    """The cell's source, the notebook values it reads, and the ``--out`` names, pickled once."""

    def __init__(self, data: bytes, modules: set[str], names: list[str]):
        self.data = data
        self.modules = modules
        self.names = names


def prepare_cell(source: str, user_ns: Mapping[str, Any], *, filename: str, out: Iterable[str] = (),
                 held: Iterable[str] = (),
                 extra: Mapping[str, Any] | Callable[[set[str]], Mapping[str, Any]] | None = None) -> CellPayload:
    """Check and pickle the cell before any host starts, once.

    ``held`` are names the hosts already hold (a session's): they are taken
    from the hosts and never shipped from the notebook. ``extra`` adds keys to
    the payload, or makes them from the modules the cell uses (a session
    cell's framework, chosen by what it imports).

    Raises ``CellSyntaxError`` naming the cell line, ``UnboundOutputError``
    for an ``out`` name the cell can never bind, or ``UnpicklableValueError``
    naming the variable, its type and the reason.
    """
    out = list(out)
    remember_source(source, filename)  # a quiet host's stacks show the cell's line in the notebook too
    tree = capture.parse_cell(source, filename)
    held = set(held)
    names = [name for name in capture.names_read_from_notebook(tree, user_ns) if name not in held]
    check_out_names(tree, out, [*names, *held])  # a name the hosts hold can be copied back as it is
    namespace = capture.pickle_namespace(names, user_ns)
    modules = capture.imported_modules(tree) | capture.module_roots(user_ns[name] for name in names)
    data = cloudpickle.dumps(
        {
            protocol.CELL_SOURCE: source,
            protocol.CELL_FILENAME: filename,
            protocol.CELL_NAMESPACE: namespace,
            protocol.CELL_OUT_NAMES: out,
            **dict((extra(modules) if callable(extra) else extra) or {}),
        }
    )
    return CellPayload(data, modules, names)


def make_plan(
    *,
    job_id: str,
    acc: Accelerator,
    hosts: int,
    framework: str,
    coordinator_address: str,
    simulated: bool,
    timeout: float | None = None,
    env_names: Iterable[str] = (),
    grace: float | None = None,
    session: bool = False,
    idle_timeout: float | None = None,
    start_window: float = 0.0,
    procs_per_host: int = 1,
) -> JobPlan:
    """The plan for one job or session.

    ``start_window`` is how far apart the backend may start the hosts (the
    kubernetes backend's pending limit): the start barrier, and the
    framework's own initialization timeout with it, wait that much longer, so
    they never give up on a host the backend still waits for.
    """
    return JobPlan(
        job_id=job_id,
        hosts=hosts,
        procs_per_host=procs_per_host,
        accelerator=acc.name,
        devices_per_host=acc.devices_per_host,
        framework=framework,
        coordinator_address=coordinator_address,
        barrier_timeout_s=DEFAULT_BARRIER_TIMEOUT_S + start_window,
        heartbeat_timeout_s=DEFAULT_HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_s=DEFAULT_SHUTDOWN_TIMEOUT_S,
        timeout_s=timeout,
        simulated=simulated,
        env_names=tuple(env_names),
        session=session,
        idle_timeout_s=idle_timeout,
        grace_s=DEFAULT_GRACE_S if grace is None else grace,
        created_at=time.time(),
        client_versions={**installed_versions(), "kinetic_nb": package_version()},
    )


def check_protocol(plan: JobPlan, what: str) -> None:
    """One line naming both versions when ``plan`` (of ``what``: "job kn-..." or "session ks-...") was stored by
    a kinetic_nb that speaks another job protocol: reading on would misread its records, or wait for ever."""
    if plan.protocol_version == protocol.PROTOCOL_VERSION:
        return
    theirs = plan.client_versions.get("kinetic_nb")
    raise ProtocolVersionError(
        f"{what} was stored by kinetic_nb {theirs or '(a version that did not record itself)'}, which speaks job "
        f"protocol {plan.protocol_version}; this notebook's kinetic_nb {package_version()} speaks "
        f"{protocol.PROTOCOL_VERSION}: open it from a notebook with that kinetic_nb")
