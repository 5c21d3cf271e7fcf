"""What ssh and TPU VM hosts keep in their kinetic_nb cache, pruned from the notebook by ``%kinetic gc``.

Each host bounds its own cache as jobs start there (the bootstrap, after it
made a new environment: :data:`~kinetic_nb.agent.bootstrap.KEEP_ENVIRONMENTS`
per interpreter by last use, never one a process runs, and agent logs older
than :data:`~kinetic_nb.agent.bootstrap.LOG_RETENTION_S`). ``%kinetic gc``
runs the same pruning on the hosts of the ssh and TPU VM jobs it removes,
over ssh with the user's own config as their jobs reached them, and removes
those jobs' agent logs too. A host that cannot be reached is one line in the
report, never an error: its cache is pruned by its next job, or by the next
``gc``. The installed Pythons (``pythons/``) are kept: every environment of
theirs needs them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import subprocess
from collections.abc import Iterable, Mapping, Sequence

from kinetic_nb.agent.bootstrap import KEEP_ENVIRONMENTS, LOG_RETENTION_S, PRUNE_OPTION
from kinetic_nb.backends.base import backend_class
from kinetic_nb.backends.host_environment import bootstrap_source
from kinetic_nb.backends.ssh.backend import AGENT_LOGS_DIR, SshBackend
from kinetic_nb.backends.ssh.connections import PARALLEL_OPENS, Connections, SshHost
from kinetic_nb.backends.ssh.pool import ENVIRONMENTS_DIR
from kinetic_nb.errors import SshHostError

__all__ = ["CachedHost", "prune_hosts", "prune_hosts_of_jobs"]

#: How long one host's pruning may take: deleting a few environments of about 1 GB each.
PRUNE_TIMEOUT_S = 300
#: The longest line quoted from a host that could not prune its cache, so the report stays readable.
MAX_SAID_CHARS = 300


@dataclasses.dataclass(frozen=True)
class CachedHost:
    """One host as its jobs reached it: its ssh target, config and options, and the Python that ran there."""

    target: str
    config: str | None = None
    python: str = "python3"
    options: tuple[str, ...] = ()
    host_options: tuple[str, ...] = ()


def hosts_of(backend: SshBackend) -> list[CachedHost]:
    """The hosts ``backend`` reaches (a TPU VM's workers, from the Cloud TPU API), each as it reaches them."""
    own = backend.host_options()
    return [CachedHost(target, backend.config, backend.python, tuple(backend.ssh_options()),
                       tuple(own[index]) if index < len(own) else ())
            for index, target in enumerate(backend.targets)]


def prune_hosts_of_jobs(jobs: Iterable[tuple[str, str, Mapping]]) -> list[str]:
    """Prune the caches of the hosts that the removed jobs ``(job id, backend name, backend options)`` ran on (the
    ssh-reached ones; others have no such cache), each host once; one line per host, in the order first named, and
    one per backend whose hosts could not be named (a TPU VM deleted since)."""
    by_backend: dict[tuple[str, str], list[str]] = {}
    for job_id, name, options in jobs:
        try:
            reached_by_ssh = issubclass(backend_class(name), SshBackend)
        except ValueError:  # a backend this kernel does not have
            continue
        if reached_by_ssh:
            by_backend.setdefault((name, json.dumps(dict(options), sort_keys=True)), []).append(job_id)
    hosts: dict[CachedHost, list[str]] = {}
    lines = []
    for (name, options), job_ids in by_backend.items():
        try:
            named = hosts_of(backend_class(name).from_options(**json.loads(options)))
        except Exception as error:  # noqa: BLE001 - any platform's failure: the report says it, gc goes on
            said = str(error).splitlines()[0] if str(error) else type(error).__name__
            lines.append(f"-b {name} ({_describe(json.loads(options))}): its hosts could not be named ({said}); "
                         "their caches were left as they are")
            continue
        for host in named:
            hosts.setdefault(host, []).extend(job_ids)
    return prune_hosts(hosts) + lines


def _describe(options: Mapping) -> str:
    """A backend's stored options in a few words: its TPU or its hosts."""
    return ", ".join(f"{key} {value}" for key, value in sorted(options.items()) if key in ("tpu", "zone", "ssh_hosts"))


def prune_hosts(hosts: Mapping[CachedHost, Sequence[str]], *, keep: int = KEEP_ENVIRONMENTS,
                logs_older_than: float = LOG_RETENTION_S) -> list[str]:
    """Prune each host's kinetic_nb cache, all at once: its environments beyond the ``keep`` newest that no process
    uses, its agent logs older than ``logs_older_than`` seconds, and those of the ended jobs ``hosts[host]``; one line
    each, in order, saying what was removed, or why the host was skipped (never an error)."""
    if not hosts:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(hosts), PARALLEL_OPENS)) as pool:
        return list(pool.map(lambda host: _prune_one(host, hosts[host], keep, logs_older_than), hosts))


def _prune_one(host: CachedHost, jobs: Sequence[str], keep: int, logs_older_than: float) -> str:
    connections = Connections([host.target], config=host.config, options=host.options,
                              host_options=[host.host_options])
    try:
        connections.open()
    except SshHostError as error:
        return f"{_as_reached_alone(str(error), host.target)}; skipped, its kinetic_nb cache was left as it is"
    try:
        done = connections.run(0, [host.python, "-c", bootstrap_source(), PRUNE_OPTION,
                                   "--environments", ENVIRONMENTS_DIR, "--agent-logs", AGENT_LOGS_DIR,
                                   "--keep", str(keep), "--logs-older-than", str(logs_older_than)],
                               input="".join(f"{job}\n" for job in jobs).encode(), timeout=PRUNE_TIMEOUT_S)
    except (SshHostError, OSError, subprocess.TimeoutExpired) as error:
        return f"{host.target}: skipped, its kinetic_nb cache could not be pruned ({error})"
    finally:
        connections.close()
    try:
        said = json.loads(done.stdout.decode(errors="replace").strip().splitlines()[-1])
        return pruned_line(host.target, said["environments"], said["bytes"], said["logs"])
    except (ValueError, IndexError, KeyError, TypeError):
        lines = [line.strip() for line in done.stderr.decode(errors="replace").splitlines() if line.strip()]
        why = lines[-1][:MAX_SAID_CHARS] if lines else f"exit code {done.returncode}"
        return f"{host.target}: skipped, {host.python} could not prune its kinetic_nb cache ({why})"


def _as_reached_alone(problem: str, target: str) -> str:
    """ssh's one line for a host reached alone (``host 0 (h1) cannot be reached: ...``) naming it by its target:
    its index there is no job's."""
    named = str(SshHost(0, target))
    return target + problem.removeprefix(named) if problem.startswith(named) else problem


def pruned_line(target: str, environments: int, freed: int, logs: int) -> str:
    """What one host's pruning removed, in one line."""
    return (f"{target}: removed {environments} environment{'s' if environments != 1 else ''} ({freed / 1e6:.1f} MB) "
            f"and {logs} agent log{'s' if logs != 1 else ''} from its kinetic_nb cache")
