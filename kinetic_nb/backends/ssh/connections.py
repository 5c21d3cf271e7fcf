"""One OpenSSH connection per host for the life of a job or session, opened in parallel.

The hosts are reached with the user's own OpenSSH setup: their ``~/.ssh/config``
(or ``--ssh-config FILE``), agent and keys (gcloud's ``google_compute_engine``
key included), known hosts and ``ProxyJump`` lines, exactly as ``ssh HOST``
would. That is why this drives the ``ssh`` program rather than a library such
as asyncssh, which reads none of the config's ``Match``/``Include``/``ProxyJump``
the way OpenSSH does: a host that ``ssh HOST true`` reaches, kinetic_nb reaches.
Each host's connection is an OpenSSH control master (``ControlMaster``,
``ControlPersist``) in a private directory: every command after the first rides
on it, with no new handshake, and a 64-host start is 64 handshakes at once, not
in a row.

A host that cannot be reached, whose key is refused or whose host key changed
fails before any host runs, with one line naming the host and what to do.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Sequence

from kinetic_nb.errors import SshHostError

__all__ = ["SSH_TIMEOUT_S", "Connections", "SshHost", "describe_ssh_failure"]

#: Seconds ``ssh`` may take to connect to one host (``ConnectTimeout``): an address that drops packets fails
#: in this long, not in the kernel's minutes.
SSH_TIMEOUT_S = 15
#: How long a control master outlives its last use when nobody closes it (a notebook killed mid-job):
#: long enough for a session's pauses between cells, short enough to leave nothing behind for long.
CONTROL_PERSIST_S = 600
#: Connections opened at once.
PARALLEL_OPENS = 32
#: ssh's own exit status when the connection itself failed (any other is the remote command's).
SSH_FAILED = 255


@dataclasses.dataclass(frozen=True)
class SshHost:
    """One host as the user names it (``user@name`` or a ``Host`` alias of their ssh config), and its index."""

    index: int
    target: str

    def __str__(self) -> str:
        return f"host {self.index} ({self.target})"


def describe_ssh_failure(host: SshHost, stderr: str) -> str:
    """What ssh's own complaint means, in one line naming the host and the fix; ssh's last line otherwise."""
    text = stderr.replace("\r", "")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith(("@", "Warning:"))]
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in text or "Host key verification failed" in text:
        if "HAS CHANGED" in text:
            return (f"{host}: its host key changed since it was last seen (a rebuilt machine, or someone in between): "
                    f"check it, then remove the old one with `ssh-keygen -R {_name_of(host.target)}`")
        return (f"{host}: its host key is not known and cannot be asked about here (BatchMode): connect once with "
                f"`ssh {host.target} true` to check and accept it")
    if "Permission denied" in text:
        return (f"{host}: the key was refused ({lines[-1] if lines else 'Permission denied'}): check that "
                f"`ssh {host.target} true` works without a password (ssh-add the key, or name it in your ssh config)")
    for marker, why in (("Could not resolve hostname", "its name does not resolve"),
                        ("Connection refused", "nothing listens for ssh there (connection refused)"),
                        ("Connection timed out", "it did not answer (connection timed out)"),
                        ("No route to host", "no route to it"),
                        ("Network is unreachable", "its network is unreachable"),
                        ("Connection closed", "it closed the connection")):
        if marker in text:
            return f"{host} cannot be reached: {why}"
    return f"{host}: ssh failed: {lines[-1] if lines else 'no message'}"


def _name_of(target: str) -> str:
    return target.rsplit("@", 1)[-1]


#: A notebook's control-master directory: ``{tempdir}/kinetic-ssh-{pid}-{random}``.
DIRECTORY_PREFIX = "kinetic-ssh-"


def remove_stale_directories() -> list[str]:
    """Remove the control-master directories this user's notebooks left when they were killed (their pid is gone;
    their masters end by themselves after ``ControlPersist``); return those removed."""
    removed = []
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name.removeprefix(DIRECTORY_PREFIX).split("-", 1)[0]
            if not name.startswith(DIRECTORY_PREFIX) or not pid.isdigit():
                continue
            path = os.path.join(root, name)
            try:
                if os.lstat(path).st_uid != os.getuid() or _alive(int(pid)):
                    continue
            except OSError:
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class Connections:
    """A control master per host, in a 0700 directory of this process's own, until :meth:`close`.

    ``config``: an ssh config file to use instead of ``~/.ssh/config`` (``ssh -F``). ``options``: more
    ``-o`` options for every connection; ``host_options``: for each host, its own (a TPU VM worker's
    ``HostKeyAlias``).
    """

    def __init__(self, targets: Sequence[str], *, config: str | None = None, options: Sequence[str] = (),
                 host_options: Sequence[Sequence[str]] = ()):
        if not targets:
            raise ValueError("no ssh hosts given: name them, host 0 first (--ssh-hosts h0,h1,...)")
        self.hosts = [SshHost(index, target) for index, target in enumerate(targets)]
        self.config = config
        self.options = list(options)
        self.host_options = [list(each) for each in host_options]
        remove_stale_directories()
        # 0700: the masters' sockets are ours alone; named by this process, so a notebook killed before it closed
        # them is told apart from a live one by the next notebook.
        self._directory = tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{os.getpid()}-")
        self._open: set[int] = set()

    def _base(self, host: SshHost) -> list[str]:
        command = ["ssh"]
        if self.config:
            command += ["-F", self.config]
        command += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TIMEOUT_S}",
                    "-o", f"ControlPath={os.path.join(self._directory, f'{host.index}')}"]
        for option in [*self.options, *(self.host_options[host.index] if host.index < len(self.host_options) else ())]:
            command += ["-o", option]
        return command

    def open(self) -> None:
        """Connect to every host at once; ``SshHostError`` naming every host that failed (the lowest first), with
        the connections that did open closed again."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(self.hosts), PARALLEL_OPENS)) as pool:
            failures = [problem for problem in pool.map(self._open_one, self.hosts) if problem]
        if failures:
            self.close()
            more = f" (and {len(failures) - 1} more: {'; '.join(failures[1:])})" if len(failures) > 1 else ""
            raise SshHostError(failures[0] + more)

    def _open_one(self, host: SshHost) -> str:
        command = [*self._base(host), "-o", "ControlMaster=yes", "-o", f"ControlPersist={CONTROL_PERSIST_S}",
                   "-f", "-N", host.target]
        try:
            done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=SSH_TIMEOUT_S + 15)
        except subprocess.TimeoutExpired:
            return f"{host} cannot be reached: no answer within {SSH_TIMEOUT_S + 15} s"
        if done.returncode != 0:
            return describe_ssh_failure(host, done.stderr)
        self._open.add(host.index)
        return ""

    def command(self, index: int, remote: str) -> list[str]:
        """The ``ssh`` command line that runs the shell command ``remote`` on host ``index`` over its connection."""
        host = self.hosts[index]
        return [*self._base(host), host.target, remote]

    def run(self, index: int, command: Sequence[str] | str, *, input: bytes | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        """Run ``command`` (a list is quoted for the remote shell) on host ``index`` over its connection; its
        standard input is ``input`` (the way secrets travel: never a command line); ``SshHostError`` when the
        connection itself failed."""
        host = self.hosts[index]
        remote = command if isinstance(command, str) else shlex.join(command)
        done = subprocess.run(self.command(index, remote), input=input or b"", capture_output=True, timeout=timeout)
        if done.returncode == SSH_FAILED and index not in self._open:
            raise SshHostError(describe_ssh_failure(host, done.stderr.decode(errors="replace")))
        return done

    def run_all(self, command: Sequence[str] | str, *, input: bytes | None = None,
                timeout: float | None = None) -> list[subprocess.CompletedProcess]:
        """``command`` on every host at once, in host order."""
        return self.run_each(lambda index: command, input=input, timeout=timeout)

    def run_each(self, command_for: Callable[[int], Sequence[str] | str], *, input: bytes | None = None,
                 input_for: Callable[[int], bytes | None] | None = None, timeout: float | None = None,
                 only: Sequence[int] | None = None) -> list[subprocess.CompletedProcess]:
        """``command_for(index)`` on each host (or each of ``only``) at once, in host order, its standard input
        ``input`` (or ``input_for(index)``)."""
        def one(host: SshHost) -> subprocess.CompletedProcess:
            given = input_for(host.index) if input_for is not None else input
            return self.run(host.index, command_for(host.index), input=given, timeout=timeout)

        hosts = self.hosts if only is None else [self.hosts[index] for index in only]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(hosts), PARALLEL_OPENS))) as pool:
            return list(pool.map(one, hosts))

    def forward(self, index: int, remote: tuple[str, int]) -> tuple[str, int]:
        """A loopback port of this machine that reaches ``remote`` (an address as host ``index`` sees it: an
        internal one, say) through host ``index``'s connection, as ``ssh -L`` does (``ssh -O forward``: no new
        login); it lasts as long as the connection. ``SshHostError`` in one line when ssh refuses it."""
        host = self.hosts[index]
        with socket.socket() as probe:  # a port free here now (ssh binds it a moment later)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        target = f"[{remote[0]}]" if ":" in remote[0] else remote[0]
        done = subprocess.run([*self._base(host), "-O", "forward", "-L", f"127.0.0.1:{port}:{target}:{remote[1]}",
                               host.target], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=SSH_TIMEOUT_S)
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"ssh exited with {done.returncode}"])[-1]
            raise SshHostError(f"{host}: ssh could not forward a local port to {remote[0]}:{remote[1]} over its "
                               f"connection: {why}")
        return "127.0.0.1", port

    def master_alive(self, index: int) -> bool:
        """Whether host ``index``'s control master still runs (``ssh -O check``)."""
        host = self.hosts[index]
        return subprocess.run([*self._base(host), "-O", "check", host.target], capture_output=True).returncode == 0

    def close(self) -> None:
        """End every control master (``ssh -O exit``) and remove their directory."""
        for index in sorted(self._open):
            host = self.hosts[index]
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run([*self._base(host), "-O", "exit", host.target], capture_output=True, timeout=10)
        self._open.clear()
        shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> Connections:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
