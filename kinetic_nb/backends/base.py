"""The interface a backend implements: everything the client, the poller and the catalog call."""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from kinetic_nb.runner import protocol
from kinetic_nb.runner.channel_link import Address
from kinetic_nb.runner.job_keys import KEY_ENV
from kinetic_nb.runner.protocol import CancelRequest, ExitSummary, JobPlan
from kinetic_nb.runner.records import write_record
from kinetic_nb.runner.redact import SecretValue
from kinetic_nb.storage import ObjectInfo, Storage


@dataclasses.dataclass(frozen=True)
class PlatformView:
    """What only the platform sees of a job's hosts, at one poll.

    Attributes
    ----------
    exits : dict of int to ExitSummary
        Ends of hosts that have no ``exit.json`` from their agent: a pod
        evicted or OOMKilled as a whole, a node lost, an agent that died.
    waiting : dict of int to str
        Why a host that has not started is waiting (a pod's scheduler reason).
    problem : str
        A job-wide problem in one line (the agent died, a storage error), or "".
    """

    exits: Mapping[int, ExitSummary] = dataclasses.field(default_factory=dict)
    waiting: Mapping[int, str] = dataclasses.field(default_factory=dict)
    problem: str = ""


@dataclasses.dataclass(frozen=True, repr=False)
class JobSecrets:
    """What reaches a job's hosts only outside storage: the job's key and the ``-e`` values.

    A backend hands them over out of band (a process's environment, a
    Kubernetes Secret), never through storage, a manifest's literal values, a
    Ray ``runtime_env`` or anything a dashboard shows. The ``-e`` values are
    held as :class:`~kinetic_nb.runner.redact.SecretValue` (whatever they were
    given as), so no traceback prints them.
    """

    key: bytes
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", {name: SecretValue(value) for name, value in self.env.items()})

    def environment(self) -> dict[str, str]:
        """The variables that carry them: :data:`KEY_ENV` (hex) and each ``-e`` name, every value masked in a repr."""
        return {**self.env, KEY_ENV: SecretValue(self.key.hex())}

    def __repr__(self) -> str:
        return f"JobSecrets(key=<{len(self.key)} bytes>, env=<{', '.join(sorted(self.env))}>)"


@dataclasses.dataclass(frozen=True)
class BackendFlag:
    """A flag a backend adds to ``%%kinetic``: ``--namespace NS`` sets its option ``namespace``.

    A flag declared a ``setting`` is also a ``%config KineticMagics.<option>``
    value, passed to ``from_options`` as that option's default (``config``).
    """

    flag: str
    option: str
    help: str
    metavar: str | None = None
    type: Any = str
    #: A switch (``--ray-pack``) takes no value: given, its option is True.
    switch: bool = False
    #: Also a ``%config KineticMagics.<option>`` setting: a notebook's default for the flag.
    setting: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def argparse_options(self, help_suffix: str = "") -> dict[str, Any]:
        """Keyword arguments for ``add_argument(self.flag, ...)``; an absent flag is None."""
        if self.switch:
            return {"dest": self.dest, "default": None, "action": "store_true", "help": self.help + help_suffix}
        return {"dest": self.dest, "default": None, "type": self.type, "metavar": self.metavar,
                "help": self.help + help_suffix}


class Backend(abc.ABC):
    """Starts a job's hosts, stops them, and says what the platform alone sees of them.

    A backend registers itself (:func:`kinetic_nb.backends.register`) and
    declares the flags it adds to the magic; ``from_options`` builds it from
    those options (and from what ``options()`` stored in ``handle.json``).
    """

    name: ClassVar[str]
    #: One line for the magic's ``-b`` help.
    summary: ClassVar[str] = ""
    #: The flags this backend adds to ``%%kinetic``, listed under its name in ``%%kinetic?``.
    flags: ClassVar[tuple[BackendFlag, ...]] = ()
    #: The accelerator is simulated with CPU devices on this backend (the local one).
    simulates_accelerators: ClassVar[bool] = False
    #: The hosts do not see this machine's disk (a pod, a Ray node): the notebook's folder travels with the job.
    ships_workdir: ClassVar[bool] = False
    #: The hosts run on this machine under one agent (the local one): on a local disk they and the notebook wake
    #: each other through sockets (``runner.wakeup``); anywhere else each side looks at storage at its own pace.
    hosts_beside_the_notebook: ClassVar[bool] = False
    #: Environment variables whose being set says the user means this backend's hosts (``KINETIC_SSH_HOSTS``): a
    #: cell that runs elsewhere because no ``-b`` chose it says so.
    named_by: ClassVar[tuple[str, ...]] = ()

    def default_hosts(self) -> int | None:
        """How many hosts a cell gets when ``-n`` does not say (None: the accelerator's): a backend whose hosts
        are named (``--ssh-hosts``) has that many."""
        return None

    def default_accelerator(self) -> str | None:
        """The accelerator a cell gets when ``-a`` does not say (None: cpu): a backend whose hosts are a known
        slice (a Cloud TPU VM's) names it."""
        return None

    def simulates(self, acc: Any) -> bool:
        """Whether this backend stands CPU devices in for the accelerator ``acc``'s chips (the plan's
        ``simulated``: JAX on CPU, torch on gloo)."""
        return self.simulates_accelerators

    @classmethod
    def from_options(cls, **options: Any) -> Backend:
        """The backend configured by ``options`` (its flags' options, ``config`` defaults, stored options)."""
        if options:
            raise ValueError(f"the {cls.name} backend takes no options, got {', '.join(sorted(options))}")
        return cls()

    def preflight(self, plan: JobPlan) -> None:  # noqa: B027 - a hook: most backends accept every plan
        """Refuse, with one line (``ValueError``), a plan this backend cannot run; nothing is stored yet."""

    def default_storage(self) -> str | None:
        """Where a job goes when neither ``--storage`` nor ``$KINETIC_STORAGE`` says (None: the per-user
        directory): a bucket the platform's own setup made for its jobs."""
        return None

    def launch_notices(self, plan: JobPlan) -> list[str]:
        """Lines a launch prints (unless quiet) for what was chosen that the user may not know was: which
        cluster (a kubeconfig context), what the hosts install; none where there is nothing to say."""
        return []

    def start_window_s(self) -> float:
        """How far apart this backend may start a job's hosts, in seconds (0: together).

        The plan's start barrier and the framework's initialization timeout
        wait this much longer, so neither expires while the backend still
        waits for a host (a pod Pending while its node is added).
        """
        return 0.0

    @abc.abstractmethod
    def coordinator_address(self, job_id: str) -> str:
        """The ``host:port`` the hosts' distributed framework meets at."""

    @abc.abstractmethod
    def launch(self, storage: Storage, plan: JobPlan, secrets: JobSecrets) -> None:
        """Start every host of ``plan``; plan.json and payload.pkl are already stored (signed).

        ``secrets`` reach the hosts' agents out of band, never through storage.
        """

    def cancel(self, storage: Storage, plan: JobPlan, reason: str, key: bytes | None) -> None:
        """Ask every host's agent to stop its hosts (``control/cancel.json``, sealed under the job's ``key``)."""
        write_record(storage, key, protocol.CANCEL, CancelRequest(reason=reason, at=time.time()).to_json())

    @abc.abstractmethod
    def observe(self, storage: Storage, plan: JobPlan, listing: list[ObjectInfo],
                recorded: Mapping[int, ExitSummary], key: bytes | None) -> PlatformView:
        """What the platform sees of the hosts; ``recorded`` are the exit records already read from storage.

        What a backend stores or reads of the job's records goes through
        ``runner.records`` under the job's ``key`` (None: a job from before
        signing, which the user chose to trust)."""

    def cleanup(self, plan: JobPlan) -> None:  # noqa: B027 - a hook: a local job leaves nothing to remove
        """Remove what the platform still holds for the job once its outcome is recorded; never raises."""

    def release(self, plan: JobPlan) -> None:  # noqa: B027 - a hook: most backends keep nothing open to hosts
        """Let go now of what this machine keeps open to the hosts of ``plan``, whose hosts have ended (a
        session's ``stop``): connections kept warm for later jobs, which would otherwise close only when idle.
        Never opens anything to close it; never raises."""

    def agent_gone(self, job_id: str) -> bool | None:
        """Whether the job's agent on this machine has ended; None where the platform runs it (a pod, an actor)."""
        return None

    def channel_route(self, plan: JobPlan, announced: Address) -> Address | None:
        """Where this notebook reaches a session's hub that listens at ``announced`` (``runner.channel``: an
        address, or a Unix socket's path on this machine), or None where this backend has no route to it yet
        (its cells then travel through storage)."""
        return None

    def forget(self, job_id: str) -> None:  # noqa: B027 - a hook: most backends keep nothing on this machine
        """Remove what this machine keeps of a job outside its storage, when the job is collected (``gc``)."""

    def options(self) -> dict[str, object]:
        """The settings that recreate this backend from any kernel (stored in ``handle.json``)."""
        return {}

    #: Whether :meth:`doctor` checks something for this backend (``%kinetic doctor -b NAME``).
    has_doctor: ClassVar[bool] = False

    @classmethod
    def doctor(cls, accelerator: str | None, storage: str | None, options: Mapping[str, Any]) -> Any:
        """Whether this notebook is ready to run cells here: a report whose ``table()`` is printed."""
        raise ValueError(f"the {cls.name} backend has no doctor")

    def job_key(self, job_id: str) -> bytes | None:
        """The job's key as the platform keeps it (a cluster's Secret), for a reattach from another machine.

        Called only with this backend's own settings (never ones read from
        storage, which could point at someone else's Secret).
        """
        return None



_REGISTRY: dict[str, type[Backend]] = {}


def register(backend: type[Backend]) -> type[Backend]:
    """Make ``backend`` available by its ``name`` (a class decorator)."""
    _REGISTRY[backend.name] = backend
    return backend


def backend_names() -> tuple[str, ...]:
    """The registered backends' names, in registration order."""
    return tuple(_REGISTRY)


def backend_class(name: str) -> type[Backend]:
    """The backend class called ``name``; a one-line ``ValueError`` naming the choices otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose from: {', '.join(_REGISTRY)}") from None
