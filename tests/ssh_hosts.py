"""Real OpenSSH servers for the ssh backend's tests: one ``sshd`` per test host, each on its own loopback address.

Every run generates its own host keys and client key in a 0700 directory under
the user's home (sshd's ``StrictModes`` refuses keys under a world-writable
directory such as ``/tmp``), and writes an ssh config naming the hosts
``h0``, ``h1``, ... so that the tests never touch the user's ``~/.ssh``. Each
``sshd`` runs in the foreground in its own process group, logging to a file of
its own (``accepted(i)`` counts the logins it took), and is stopped with its
group. ``scripts/ensure_sshd.sh`` installs Debian's ``openssh-server``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

#: The first test host's loopback address; host i listens on 127.0.0.(FIRST_OCTET + i).
FIRST_OCTET = 20
#: An address where nothing listens for ssh: "cannot be reached".
NOBODY = "127.0.0.250"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def _free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def _keygen(path: pathlib.Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)
    return (path.with_suffix(".pub") if path.suffix else pathlib.Path(f"{path}.pub")).read_text().strip()



def _others_can_run(path: str) -> bool:
    """Whether a user other than its owner can run ``path``: every folder above it open to others (a home of
    mode 0700 holding a pyenv Python is not)."""
    folder = os.path.dirname(os.path.realpath(path))
    while True:
        if not os.stat(folder).st_mode & 0o001:
            return False
        if folder == os.path.dirname(folder):
            return os.access(path, os.X_OK) and bool(os.stat(os.path.realpath(path)).st_mode & 0o001)
        folder = os.path.dirname(folder)


def shared_interpreter() -> str:
    """A Python of the test's version that the hosts' users can run: the test's own base interpreter, else the
    system's of the same version (its packages, added by a ``.pth``, are built for that version)."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for candidate in (os.path.join(sys.base_prefix, "bin", version), shutil.which(version, path="/usr/bin:/bin")):
        if candidate and os.path.exists(candidate) and _others_can_run(candidate):
            return candidate
    raise RuntimeError(f"no {version} that other users can run: the test's own is under a folder closed to them, "
                       f"and /usr/bin has none")

class SshTestHosts:
    """``count`` running sshd's, their client config (``config``) and targets (``targets``: h0, h1, ...).

    ``environment``: variables every login on the hosts gets (the client's ``SetEnv``, the servers'
    ``AcceptEnv``): the test interpreter's packages on ``PYTHONPATH``, as a machine with jax and torch
    installed has them, and a cache directory of the run's own (``XDG_CACHE_HOME``: each host its own folder
    in it, as separate machines have).

    ``users``: each host logs in a user of its own, made for the run (root only: ``useradd``), with a home of
    its own under a fresh folder and a virtual environment there, ``~/venv`` (``--ssh-python venv/bin/python``),
    made with ``--system-site-packages`` over the test interpreter's packages (a ``.pth`` naming them), as a
    machine with jax and torch installed in a venv has them; its cache is its home's. A list names each host's
    user instead, one a host: every host may share one (``["alice_example_com"] * 2``: the same account on every
    worker, as OS Login makes it), made once with one home, each host's cache a folder of its own in it
    (``~/.cache/hostN``, as separate machines have). Either way a host's bare address (``Host 127.0.0.20``) then
    names no user: a TPU VM's worker is logged in as the user the backend names, else as this machine's.
    """

    def __init__(self, count: int, environment: dict[str, str] | None = None, *,
                 users: bool | Sequence[str] = False):
        if not isinstance(users, bool) and len(users) != count:
            raise ValueError(f"users names each host's user: {count} names, got {len(users)}")
        self.count = count
        self.environment = dict(environment or {})
        self.own_users = bool(users)
        #: Each host's user's home (``users`` only), and the users made for the run, each once.
        self.homes: list[pathlib.Path] = []
        self._made_users: list[str] = []
        cache = pathlib.Path.home() / ".cache"
        cache.mkdir(mode=0o700, exist_ok=True)
        self.directory = pathlib.Path(tempfile.mkdtemp(prefix="kinetic-sshd-", dir=cache))
        self.user = os.environ.get("USER") or __import__("pwd").getpwuid(os.getuid()).pw_name
        self.addresses = [f"127.0.0.{FIRST_OCTET + index}" for index in range(count)]
        self.ports = [_free_port(address) for address in self.addresses]
        self.processes: list[subprocess.Popen] = []
        self.config = str(self.directory / "ssh_config")
        #: The key every host accepts, and one none does.
        self.client_key = str(self.directory / "client_key")
        self.other_key = str(self.directory / "other_key")
        self.targets = [f"h{index}" for index in range(count)]
        #: The user each host logs in (this one's, unless ``users``).
        self.users = list(users) if not isinstance(users, bool) else \
            [f"kn{os.getpid()}h{index}" if users else self.user for index in range(count)]

    def start(self) -> SshTestHosts:
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        client_key = self.directory / "client_key"
        (self.directory / "authorized_keys").write_text(_keygen(client_key) + "\n")
        (self.directory / "authorized_keys").chmod(0o600)
        if self.own_users:
            self._make_users()
        _keygen(self.directory / "other_key")  # a key no host accepts
        known = []
        for index, (address, port) in enumerate(zip(self.addresses, self.ports, strict=True)):
            host_dir = self.directory / f"host{index}"
            host_dir.mkdir(mode=0o700)
            public = _keygen(host_dir / "ssh_host_ed25519_key")
            known.append(f"[{address}]:{port} {' '.join(public.split()[:2])}")
            config = host_dir / "sshd_config"
            config.write_text("\n".join([
                f"ListenAddress {address}:{port}",
                f"HostKey {host_dir / 'ssh_host_ed25519_key'}",
                f"PidFile {host_dir / 'sshd.pid'}",
                f"AuthorizedKeysFile {'.ssh/authorized_keys' if self.own_users else self.directory / 'authorized_keys'}",
                "StrictModes yes",
                "UsePAM no",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PubkeyAuthentication yes",
                "PermitRootLogin prohibit-password",
                f"AllowUsers {self.users[index]}",
                *([f"AcceptEnv {' '.join(self.environment)}"] if self.environment else []),
                "LogLevel VERBOSE",
                "",
            ]))
            log = open(host_dir / "sshd.log", "wb")  # noqa: SIM115 - the server's for its life
            self.processes.append(subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=log,
                                                   stdin=subprocess.DEVNULL, start_new_session=True))
            log.close()
        (self.directory / "known_hosts").write_text("\n".join(known) + "\n")
        self._write_client_config(client_key)
        for address, port in zip(self.addresses, self.ports, strict=True):
            self._wait_listening(address, port)
        return self

    def _make_users(self) -> None:
        """Each host's user, made once however many hosts share it, with a home of its own (``StrictModes``: the
        user's, not writable by others) holding the client's key and a ``.pth`` that puts the test interpreter's
        packages on its user site. Hosts that all share one home get each a cache of their own in it."""
        import sysconfig

        homes = pathlib.Path(tempfile.mkdtemp(prefix="kinetic-ssh-homes-"))
        homes.chmod(0o755)
        packages = sysconfig.get_paths()["purelib"]
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        self.homes = [homes / user for user in self.users]
        if len(self.users) > 1 and len(set(self.users)) == 1:
            self.environment.setdefault("XDG_CACHE_HOME", str(homes / self.users[0] / ".cache"))
        for user in dict.fromkeys(self.users):
            home = homes / user
            subprocess.run(["useradd", "--home-dir", str(home), "--create-home", "--shell", "/bin/sh",
                            "--user-group", "--password", "*", user], check=True)  # "*": no password, not locked
            self._made_users.append(user)
            (home / ".ssh").mkdir(mode=0o700)
            shutil.copy(self.directory / "authorized_keys", home / ".ssh" / "authorized_keys")
            subprocess.run([shared_interpreter(), "-m", "venv", "--system-site-packages",
                            "--without-pip", str(home / "venv")], check=True)
            (home / "venv" / "lib" / version / "site-packages" / "kinetic-test-packages.pth").write_text(packages + "\n")
            subprocess.run(["chown", "-R", f"{user}:{user}", str(home)], check=True)

    def _remove_users(self) -> None:
        for user in self._made_users:
            subprocess.run(["userdel", user], capture_output=True)
        if self.homes:
            shutil.rmtree(self.homes[0].parent, ignore_errors=True)
        self.homes, self._made_users = [], []

    def _environment(self, index: int) -> dict[str, str]:
        """What host ``index``'s logins get: the cache a folder of the host's own, as separate machines have."""
        return {name: f"{value}/host{index}" if name == "XDG_CACHE_HOME" else value
                for name, value in self.environment.items()}

    def _write_client_config(self, client_key: pathlib.Path) -> None:
        def block_lines(index: int, user: str) -> list[str]:
            environment = self._environment(index)
            return [f"  User {user}", f"  IdentityFile {client_key}", "  IdentitiesOnly yes",
                    f"  UserKnownHostsFile {self.directory / 'known_hosts'}", "  GlobalKnownHostsFile /dev/null",
                    "  StrictHostKeyChecking yes", "  LogLevel ERROR",
                    *([f"  SetEnv {' '.join(f'{name}={value}' for name, value in environment.items())}"]
                      if environment else [])]

        blocks = []
        for index, (address, port) in enumerate(zip(self.addresses, self.ports, strict=True)):
            blocks += [f"Host h{index}", f"  HostName {address}", f"  Port {port}",
                       *block_lines(index, self.users[index])]
        common = block_lines(0, self.users[0])  # the failure tests' hosts: host 0's user and environment
        # What the failure tests reach: a host with another key, and an address where nothing listens.
        blocks += ["Host wrong-key", f"  HostName {self.addresses[0]}", f"  Port {self.ports[0]}",
                   *[line if "IdentityFile" not in line else f"  IdentityFile {self.directory / 'other_key'}"
                     for line in common]]
        blocks += ["Host nobody", f"  HostName {NOBODY}", f"  Port {_free_port(NOBODY)}", *common]
        # The hosts by their bare addresses, as a TPU VM's workers are reached: the key and the known hosts are
        # the ones the backend names (gcloud's), not these, and so is a user of the hosts' own (OS Login's).
        backends_own = ("IdentityFile", "UserKnownHostsFile", "StrictHostKeyChecking",
                        *(("User",) if self.own_users else ()))
        for index, (address, port) in enumerate(zip(self.addresses, self.ports, strict=True)):
            blocks += [f"Host {address}", f"  Port {port}",
                       *[line for line in block_lines(index, self.users[index])
                         if not line.strip().startswith(backends_own)]]
        pathlib.Path(self.config).write_text("\n".join(blocks) + "\n")

    def forget_host_key(self, index: int) -> None:
        """Give host ``index`` a new host key, as a rebuilt machine has: the client's known one no longer matches."""
        key = self.directory / f"host{index}" / "ssh_host_ed25519_key"
        key.unlink()
        pathlib.Path(f"{key}.pub").unlink()
        _keygen(key)
        self._restart(index)

    def _restart(self, index: int) -> None:
        self._stop(index)
        host_dir = self.directory / f"host{index}"
        log = open(host_dir / "sshd.log", "ab")  # noqa: SIM115
        self.processes[index] = subprocess.Popen([SSHD, "-D", "-e", "-f", str(host_dir / "sshd_config")],
                                                 stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                                 start_new_session=True)
        log.close()
        self._wait_listening(self.addresses[index], self.ports[index])

    @staticmethod
    def _wait_listening(address: str, port: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=1):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {address}:{port} did not start")
            time.sleep(0.05)

    def accepted(self, index: int) -> int:
        """How many logins host ``index``'s sshd has accepted."""
        return (self.directory / f"host{index}" / "sshd.log").read_text(errors="replace").count("Accepted publickey")

    def _stop(self, index: int) -> None:
        process = self.processes[index]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def stop(self) -> None:
        for index in range(len(self.processes)):
            self._stop(index)
        self._remove_users()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> SshTestHosts:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
