"""The ``ray`` backend: a job's hosts are actors on an existing Ray cluster, one host per node.

``launch`` creates the job's placement group (one bundle per host,
``STRICT_SPREAD``; ``SPREAD`` and a hundredth of a CPU per host with
``--ray-pack``) and one actor per bundle
(:class:`~kinetic_nb.agent.ray_host.RayHost`); host 0's actor picks the
coordinator's port on its node once placed, and every actor then starts the
same host agent as every other backend, with the job's key handed over in
that call (never in a ``runtime_env``). Nothing here waits for placement: a
group that cannot be placed yet shows as the hosts' pending reason, and past
``pending_timeout_s`` fails them with it.

This backend adds what only Ray sees: an actor that died or a node that was
lost becomes that host's ``exit.json`` ("actor died: ...", "node lost: ..."),
and a host whose storage is a path its node does not share fails with one
line. ``cleanup`` stops what still runs through the agents and removes the
placement group and the actors.

Needs the ``ray`` extra, imported only when the backend first talks to a
cluster (``--ray-address``, else ``RAY_ADDRESS``, else ``auto``: the cluster
``ray start`` left on this machine). It never starts a cluster of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from kinetic_nb.accelerators import resolve_accelerator
from kinetic_nb.agent.ray_host import ACTOR_CONCURRENCY, RayHost
from kinetic_nb.backends.base import Backend, BackendFlag, JobSecrets, PlatformView, register
from kinetic_nb.backends.forward import CarriedConnection, answers
from kinetic_nb.backends.ray.placement import SHARED, SPREAD, host_bundles, pending_reason, too_few_nodes, tpu_version
from kinetic_nb.errors import KineticError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.protocol import ExitSummary, JobPlan
from kinetic_nb.runner.records import store_exit
from kinetic_nb.storage import ObjectInfo, Storage

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_PENDING_TIMEOUT_S", "RAY_NAMESPACE", "RayBackend", "connect"]

#: The Ray namespace of every job's actors and placement group, so any kernel finds them by name.
RAY_NAMESPACE = "kinetic_nb"
#: A placement group not placed after this long fails its hosts with the reason (as GKE's pending pods do):
#: long enough for an autoscaler to add nodes, short enough not to leave a typo waiting.
DEFAULT_PENDING_TIMEOUT_S = 600.0
#: How long an explicit cluster address may take to accept a connection before it is called unreachable.
PROBE_TIMEOUT_S = 3.0
#: Ray is asked about a job at most this often: the client polls storage several times a second.
LOOK_INTERVAL_S = 1.0
#: After a cleanup's stop, the agents get this long to record their hosts before the group is removed.
STOP_WAIT_S = 5.0
#: The plan's coordinator stands for the one host 0 picks once placed (each host gets that one in
#: ``KINETIC_COORDINATOR_ADDRESS``); a port is named only because an address has one.
PLACEHOLDER_COORDINATOR = "ray-host-0:8476"
#: A notebook off the cluster's network reaches a session's hub through host 0's actor: how long opening the
#: pipe may take, and how long each call for what the hub sent waits for some.
PIPE_OPEN_S = 30.0
PIPE_WAIT_S = 5.0


def connect(address: str) -> Any:
    """The ``ray`` module, connected to the cluster at ``address`` (already connected: as it is).

    Raises
    ------
    KineticError
        One line: the ``ray`` extra is missing, or no cluster answers at ``address``.
    """
    try:
        import ray
    except ImportError as error:
        raise KineticError("the ray backend needs Ray: pip install 'ray[default]>=2.40'") from error
    if ray.is_initialized():
        return ray
    no_cluster = (f"no Ray cluster at {address}: start one with `ray start --head`, or point "
                  "--ray-address or RAY_ADDRESS at yours")
    if not _answers(address):  # Ray itself would retry for minutes, then exit the kernel's process
        raise KineticError(no_cluster)
    try:
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                 configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError, SystemExit) as error:
        raise KineticError(no_cluster) from error
    return ray


def _answers(address: str) -> bool:
    """Whether anything listens at a ``[ray://]HOST:PORT`` address (``auto`` and other forms: Ray decides).

    Ray replaces a loopback host with this machine's address, so either answering is enough.
    """
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return True
    hosts = [host]
    if host in ("127.0.0.1", "localhost"):
        with contextlib.suppress(Exception):
            from ray.util import get_node_ip_address

            hosts.append(get_node_ip_address())
    for candidate in hosts:
        try:
            socket.create_connection((candidate, int(port)), timeout=PROBE_TIMEOUT_S).close()
            return True
        except OSError:
            continue
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


@dataclasses.dataclass
class _Job:
    """What this backend holds of one launched job."""

    storage: Storage
    group: Any
    bundles: list[dict[str, float]]
    strategy: str
    actors: list[Any]
    starts: list[Any]
    launched_at: float
    #: Bundle index -> host index, once the host's agent started.
    started: dict[int, int] = dataclasses.field(default_factory=dict)
    #: Bundle index -> each host's one call that answers when its agent ends (``RayHost.agent_exit``).
    ends: dict[int, Any] = dataclasses.field(default_factory=dict)
    nodes: dict[int, str] = dataclasses.field(default_factory=dict)
    placed: bool = False
    looked_at: float = 0.0
    view: PlatformView = dataclasses.field(default_factory=PlatformView)


@register
class RayBackend(Backend):
    """Runs a job's hosts as actors in one placement group on an existing Ray cluster.

    Parameters
    ----------
    address : str, optional
        The cluster (``HOST:PORT``, ``ray://...`` or ``auto``); default
        ``RAY_ADDRESS``, else ``auto``.
    pack : bool
        Let hosts share nodes (``SPREAD``, a hundredth of a CPU each) instead of one host per node.
    pending_timeout_s : float
        A placement group not placed after this long fails its hosts.
    """

    name = "ray"
    summary = "actors on an existing Ray cluster, one host per node (docs/ray.md)"
    ships_workdir = True
    flags = (
        BackendFlag("--ray-address", "address",
                    "The Ray cluster, HOST:PORT (default $RAY_ADDRESS, then auto: the one `ray start` runs here).",
                    metavar="ADDRESS"),
        BackendFlag("--ray-pack", "pack", "Let hosts share Ray nodes when the cluster has fewer nodes than hosts.",
                    switch=True),
    )

    def __init__(self, address: str | None = None, *, pack: bool = False,
                 pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S):
        self.address = address or os.environ.get("RAY_ADDRESS") or "auto"
        self.pack = bool(pack)
        self.pending_timeout_s = float(pending_timeout_s)
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_options(cls, *, address: str | None = None, pack: bool | None = None,
                     pending_timeout_s: float | None = None, config: Mapping[str, Any] | None = None,
                     **options: Any) -> RayBackend:
        if options:
            raise ValueError(f"the ray backend takes address, pack and pending_timeout_s, got "
                             f"{', '.join(sorted(options))}")
        return cls(address, pack=bool(pack),
                   pending_timeout_s=DEFAULT_PENDING_TIMEOUT_S if pending_timeout_s is None else pending_timeout_s)

    def options(self) -> dict[str, object]:
        stored: dict[str, object] = {"address": self.address}
        if self.pack:
            stored["pack"] = True
        if self.pending_timeout_s != DEFAULT_PENDING_TIMEOUT_S:
            stored["pending_timeout_s"] = self.pending_timeout_s
        return stored

    @property
    def ray(self) -> Any:
        return connect(self.address)

    @property
    def strategy(self) -> str:
        return SHARED if self.pack else SPREAD

    # -- the Backend interface -----------------------------------------------------

    def channel_route(self, plan: JobPlan, announced: tuple[str, int]) -> tuple[str, int] | None:
        """The hub listens on host 0's node, at that node's address: dialled there where this notebook is on the
        cluster's network (on a node, or on this machine's test cluster), else carried by calls to host 0's
        actor, which the notebook reaches wherever it reaches Ray (through Ray Client, say). None when host 0's
        actor is gone."""
        if answers(announced):
            return announced
        job = self._job(plan)
        actors = job.actors[:1] if job is not None else self._named_actors(plan.job_id, hosts=1)
        if not actors:
            return None
        try:
            number = self.ray.get(actors[0].pipe_open.remote(f"{announced[0]}:{announced[1]}"), timeout=PIPE_OPEN_S)
        except Exception as error:
            raise KineticError(f"no pipe to the session's hub through host 0's actor ({_actor_death(error)})") from error
        return CarriedConnection(_ActorPipe(self.ray, actors[0], number), "ray-pipe").address

    def coordinator_address(self, job_id: str) -> str:
        """A placeholder: host 0's actor picks the real port on its node once placed."""
        return PLACEHOLDER_COORDINATOR

    def preflight(self, plan: JobPlan) -> None:
        """Connect (one line when there is no cluster) and refuse more hosts than nodes without ``--ray-pack``."""
        ray = self.ray
        if not self.pack:
            problem = too_few_nodes(plan.hosts, ray.nodes(), self.address)
            if problem:
                raise ValueError(problem)

    def launch(self, storage: Storage, plan: JobPlan, secrets: JobSecrets) -> None:
        """Create the placement group and one actor per host, and queue each host's start; returns at once."""
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        accelerator = resolve_accelerator(plan.accelerator)
        bundles = host_bundles(accelerator, plan.hosts, shared=self.pack)
        group = self._placement_group(ray, plan, accelerator, bundles)
        actor_class = ray.remote(RayHost)
        actors, starts = [], []
        plan_json = plan.to_json()
        environment = secrets.environment()
        coordinator = channel = None
        for index, bundle in enumerate(bundles):
            actor = actor_class.options(
                name=actor_name(plan.job_id, index), namespace=RAY_NAMESPACE, lifetime="detached",
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                resources={name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU")},
                max_restarts=0, max_concurrency=ACTOR_CONCURRENCY,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                     placement_group_bundle_index=index),
            ).remote()
            if coordinator is None:  # host 0's node, once placed: every start waits for it
                coordinator = actor.reserve_coordinator.remote()
                if plan.session and storage.local_path() is None:  # its hub too (``runner.channel``)
                    channel = actor.reserve_coordinator.remote()
            actors.append(actor)
            starts.append(actor.start.remote(storage.uri, plan_json, index, coordinator, environment,
                                             "" if channel is None else channel))
        ends = {bundle: actor.agent_exit.remote() for bundle, actor in enumerate(actors)}
        with self._lock:
            self._jobs[plan.job_id] = _Job(storage, group, bundles, self.strategy, actors, starts, time.time(),
                                           ends=ends)

    def cancel(self, storage: Storage, plan: JobPlan, reason: str, key: bytes | None) -> None:
        """Record ``cancel.json`` (the agents stop their hosts); hosts never started are recorded as stopped."""
        super().cancel(storage, plan, reason, key)
        job = self._job(plan)
        if job is None:
            return
        ready, _ = self.ray.wait(job.starts, num_returns=len(job.starts), timeout=0)
        if len(ready) < len(job.starts):  # someone's agent never started: nobody else records it
            for index in range(plan.hosts):
                if index not in job.started.values():
                    for rank in plan.ranks_of(index):
                        store_exit(storage, key, ExitSummary(rank, None, stopped=True, ended_at=time.time(),
                                                             reason="cancelled before its actor started"))
            self._remove(plan.job_id)

    def observe(self, storage: Storage, plan: JobPlan, listing: list[ObjectInfo],
                recorded: Mapping[int, ExitSummary], key: bytes | None) -> PlatformView:
        """Pending placement, and the ends of hosts whose actor, node or agent died without a record."""
        if len(recorded) >= plan.world_size:
            return PlatformView()
        job = self._job(plan, storage)
        if job is None:
            return PlatformView()
        now = time.monotonic()
        if now - job.looked_at >= LOOK_INTERVAL_S:
            job.looked_at = now
            try:
                job.view = self._look(job, plan, key)
            except Exception as error:  # noqa: BLE001 - polling must survive a flaky cluster
                logger.warning("could not ask Ray about %s: %s", plan.job_id, _first_line(error))
        exits = {index: summary for index, summary in job.view.exits.items() if index not in recorded}
        return dataclasses.replace(job.view, exits=exits)

    def cleanup(self, plan: JobPlan) -> None:
        """Stop what still runs through the agents, then remove the placement group and its actors; never raises."""
        try:
            job = self._job(plan)
            if job is None:
                self._remove(plan.job_id)
                return
            for actor in job.actors:
                actor.stop.remote()
            threading.Thread(target=self._remove_after_stop, args=(plan.job_id,), daemon=True,
                             name=f"kinetic-ray-cleanup-{plan.job_id}").start()
        except Exception as error:  # noqa: BLE001 - cleanup never raises
            logger.warning("could not clean up %s on Ray: %s", plan.job_id, _first_line(error))

    # -- placement and removal ---------------------------------------------------------

    def _placement_group(self, ray: Any, plan: JobPlan, accelerator: Any, bundles: list[dict[str, float]]) -> Any:
        version = tpu_version(accelerator)
        if version is not None and plan.hosts > 1:
            try:  # Ray's own TPU slice placement: one job's hosts on one slice
                from ray.util.tpu import slice_placement_group
            except ImportError:
                slice_placement_group = None
            if slice_placement_group is not None:
                return slice_placement_group(accelerator.topology, version, name=group_name(plan.job_id),
                                             lifetime="detached", strategy=self.strategy).placement_group
        from ray.util.placement_group import placement_group

        return placement_group(bundles, strategy=self.strategy, name=group_name(plan.job_id), lifetime="detached")

    def _remove_after_stop(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is not None:
            deadline = time.monotonic() + STOP_WAIT_S
            while time.monotonic() < deadline and not self._every_host_recorded(job):
                time.sleep(0.1)
        import ray

        if not ray.is_initialized():  # the program shut Ray down meanwhile: the last actor to end removes the group
            return
        try:
            self._remove(job_id)
        except Exception as error:  # noqa: BLE001 - a background thread: say it, and leave it to the actors
            logger.warning("could not remove the placement group of %s: %s", job_id, _first_line(error))

    def _every_host_recorded(self, job: _Job) -> bool:
        try:
            return all(job.storage.exists(protocol.host_exit(index)) for index in range(len(job.actors)))
        except Exception:  # noqa: BLE001 - then the group goes now
            return True

    def _remove(self, job_id: str) -> None:
        """Remove the job's placement group (its actors go with it) and any actor left outside it."""
        ray = self.ray
        with self._lock:
            job = self._jobs.pop(job_id, None)
        try:
            group = job.group if job is not None else ray.util.get_placement_group(group_name(job_id))
            ray.util.remove_placement_group(group)
        except Exception as error:  # noqa: BLE001 - gone already, or never created
            logger.debug("no placement group to remove for %s: %s", job_id, _first_line(error))
        for actor in job.actors if job is not None else self._named_actors(job_id, hosts=None):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001, S110 - dead already
                pass

    # -- what Ray sees -----------------------------------------------------------------

    def _job(self, plan: JobPlan, storage: Storage | None = None) -> _Job | None:
        """This backend's record of the job; for a job launched by another kernel, one rebuilt from Ray's names."""
        with self._lock:
            job = self._jobs.get(plan.job_id)
        if job is not None or storage is None:
            return job
        actors = self._named_actors(plan.job_id, hosts=plan.hosts)
        if not actors:
            return None
        try:
            group = self.ray.util.get_placement_group(group_name(plan.job_id))
        except ValueError:
            group = None
        job = _Job(storage, group, [], self.strategy, actors, [], time.time(), placed=True,
                   started={index: index for index in range(len(actors))},
                   ends={index: actor.agent_exit.remote() for index, actor in enumerate(actors)})
        with self._lock:
            return self._jobs.setdefault(plan.job_id, job)

    def _named_actors(self, job_id: str, hosts: int | None) -> list[Any]:
        found, index = [], 0
        while hosts is None or index < hosts:
            try:
                found.append(self.ray.get_actor(actor_name(job_id, index), namespace=RAY_NAMESPACE))
            except ValueError:
                if hosts is None:
                    break
                return []
            index += 1
        return found

    def _look(self, job: _Job, plan: JobPlan, key: bytes | None) -> PlatformView:
        ray, storage = self.ray, job.storage
        exits: dict[int, ExitSummary] = dict(job.view.exits)
        waiting: dict[int, str] = {}
        pending = [bundle for bundle in range(len(job.starts)) if bundle not in job.started]
        for bundle, started in self._answered(ray, {bundle: job.starts[bundle] for bundle in pending}).items():
            if isinstance(started, BaseException):  # the actor's own failure is the host's end
                _host_ended(exits, storage, key, plan, self._death(ray, job, bundle, started))
                job.started[bundle] = bundle
                continue
            job.started[bundle] = started["index"]
            job.nodes[started["index"]] = started["node_id"]
            job.placed = True
        if not job.placed and job.group is not None:
            reason = self._placement_waits(ray, job)
            if reason:
                if time.time() - job.launched_at > self.pending_timeout_s:
                    for index in range(plan.world_size):
                        exits[index] = store_exit(storage, key, ExitSummary(
                            index, None, ended_at=time.time(),
                            reason=f"not placed within {self.pending_timeout_s:g} s: {reason}"))
                    self._remove(plan.job_id)
                else:
                    waiting = dict.fromkeys(range(plan.world_size), reason)
        watched = {bundle: job.ends[bundle] for bundle, index in job.started.items()
                   if bundle in job.ends and plan.ranks_of(index)[0] not in exits}
        for bundle, answer in self._answered(ray, watched).items():
            index = job.started[bundle]
            del job.ends[bundle]
            if isinstance(answer, ray.exceptions.ActorUnavailableError):
                job.ends[bundle] = job.actors[bundle].agent_exit.remote()  # a blip, or a node not yet declared lost
            elif isinstance(answer, BaseException):  # the actor died: its host with it, unless it recorded its end
                if not all(storage.exists(protocol.host_exit(rank)) for rank in plan.ranks_of(index)):
                    _host_ended(exits, storage, key, plan, self._death(ray, job, index, answer))
            elif answer[0] is not None:
                code, tail = answer
                _host_ended(exits, storage, key, plan, ExitSummary(
                    index, None, ended_at=time.time(), stderr_tail=tuple(tail),
                    reason=f"the host's agent exited with code {code} without recording it"),
                    unless_recorded=True)
        return PlatformView(exits=exits, waiting=waiting)

    @staticmethod
    def _answered(ray: Any, calls: dict[int, Any]) -> dict[int, Any]:
        """Of ``calls`` (by bundle), those answered now, each with its value or the error it raised: one
        ``ray.wait`` and one ``ray.get`` for all of them (one ``ray.get`` each only where one of them failed)."""
        if not calls:
            return {}
        ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=0)
        if not ready:
            return {}
        answered = set(ready)
        done = {bundle: call for bundle, call in calls.items() if call in answered}
        try:
            return dict(zip(done, ray.get(list(done.values())), strict=True))
        except Exception:  # noqa: BLE001 - one failed: each one's own answer
            answers: dict[int, Any] = {}
            for bundle, call in done.items():
                try:
                    answers[bundle] = ray.get(call)
                except Exception as error:  # noqa: BLE001 - the actor's own failure, or its death
                    answers[bundle] = error
            return answers

    def _placement_waits(self, ray: Any, job: _Job) -> str:
        """Why the group is not placed yet, or "" once it is."""
        table = ray.util.placement_group_table(job.group)
        if table.get("state") == "CREATED":
            job.placed = True
            return ""
        return pending_reason(table, job.bundles, job.strategy, ray.nodes())

    def _death(self, ray: Any, job: _Job, index: int, error: BaseException) -> ExitSummary:
        """A host's end as Ray tells it: its node lost, its actor died, or the actor's own error."""
        node = job.nodes.get(index) or _node_of(error)
        alive = {entry["NodeID"]: entry.get("Alive") for entry in ray.nodes()}
        if node and alive.get(node) is False:
            reason = f"node lost: Ray node {node[:8]} died"
        elif isinstance(error, ray.exceptions.RayActorError):
            reason = f"actor died: {_actor_death(error)}"
        else:
            reason = _first_line(getattr(error, "cause", None) or error)
        return ExitSummary(index, None, ended_at=time.time(), reason=reason)



def _host_ended(exits: dict[int, ExitSummary], storage: Storage, key: bytes | None, plan: JobPlan,
                summary: ExitSummary, *, unless_recorded: bool = False) -> None:
    """Host ``summary.host_index``'s end as each of its processes' (``unless_recorded``: those that recorded
    none of their own), stored and kept in ``exits`` by rank."""
    for rank in plan.ranks_of(summary.host_index):
        if unless_recorded and storage.exists(protocol.host_exit(rank)):
            continue
        exits[rank] = store_exit(storage, key, dataclasses.replace(summary, host_index=rank))


def actor_name(job_id: str, index: int) -> str:
    return f"{job_id}-host-{index}"


def group_name(job_id: str) -> str:
    return f"{job_id}-hosts"


def _node_of(error: BaseException) -> str:
    """The node id an ActorDiedError names, when it names one."""
    context = getattr(error, "_actor_death_cause", None) or getattr(error, "actor_death_cause", None)
    node = getattr(getattr(context, "node_death_info", None), "node_id", b"") if context is not None else b""
    return node.hex() if isinstance(node, bytes) else str(node or "")


def _actor_death(error: BaseException) -> str:
    """The one line of an ActorDiedError that says why (killed by ray.kill, its process exited, ...)."""
    text = str(error)
    for marker in ("The actor died because", "The actor is dead because", "The actor died unexpectedly"):
        if marker in text:
            return text[text.index(marker):].splitlines()[0].strip()
    return _first_line(error)


class _ActorPipe:
    """Host 0's actor's connection to the session's hub (``RayHost.pipe_*``), as a stream: a receive is a call
    that waits up to PIPE_WAIT_S for what the hub sent; Ray's errors (the actor died) end the stream."""

    def __init__(self, ray: Any, actor: Any, number: int):
        self._ray, self._actor, self._number = ray, actor, number

    def recv(self, size: int) -> bytes:
        while True:
            try:
                data = self._ray.get(self._actor.pipe_receive.remote(self._number, PIPE_WAIT_S))
            except Exception as error:
                raise ConnectionError(_actor_death(error)) from error
            if data is None:
                return b""
            if data:
                return data

    def sendall(self, data: bytes) -> None:
        try:
            sent = self._ray.get(self._actor.pipe_send.remote(self._number, data))
        except Exception as error:
            raise ConnectionError(_actor_death(error)) from error
        if not sent:
            raise ConnectionError("the hub closed the pipe")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._actor.pipe_close.remote(self._number)
