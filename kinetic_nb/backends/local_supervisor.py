"""The local backend's per-job supervisor: ``python -m kinetic_nb.backends.local_supervisor --job URI``.

A small detached process (its own session) that owns a job's host processes,
so a notebook kernel that restarts or dies does not take them along. It

- forks the N hosts, each in its own process group, with the environment
  torch and JAX expect (forking from this lean process is much cheaper than
  starting N interpreters);
- pumps each host's stdout and stderr into ``hosts/{i}/log/`` chunks;
- records how each host ended in ``hosts/{i}/exit.json``;
- after a host fails, gives the others ``grace_s`` to report, then stops them
  (SIGTERM, then SIGKILL: JAX traps SIGTERM), and stops all of them when
  ``cancel.json`` appears;
- exits when the last host is gone.

Host-safe: the standard library, the runner and storage only.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import os
import selectors
import shutil
import signal
import sys
import tempfile
import time
import traceback

from kinetic_nb.errors import ObjectNotFoundError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.execute import run_host  # imported once here, not in every forked host
from kinetic_nb.runner.logs import LogChunkWriter
from kinetic_nb.runner.protocol import ExitSummary, HostState, HostStatus, JobPlan
from kinetic_nb.storage import Storage, open_storage

#: Between SIGTERM and SIGKILL when stopping a host: time to flush and exit
#: for a host that honours SIGTERM (JAX traps it, so its hosts need the SIGKILL).
TERM_TO_KILL_S = 0.5
#: How often the supervisor looks for a cancel request.
CANCEL_POLL_S = 0.25
#: How long to keep reading a finished host's pipe for its last output.
DRAIN_S = 0.5
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def host_environment(plan: JobPlan, host_index: int, job_uri: str, output_dir: str, base: dict[str, str]) -> dict[str, str]:
    """The environment of local host ``host_index``: kinetic's, torch's and JAX's variables."""
    env = dict(base)
    xla_flags = env.get("XLA_FLAGS", "")
    env.update(
        KINETIC_JOB_ID=plan.job_id,
        KINETIC_JOB_URI=job_uri,
        KINETIC_HOST_INDEX=str(host_index),
        KINETIC_NUM_HOSTS=str(plan.hosts),
        KINETIC_OUTPUT_DIR=output_dir,
        RANK=str(host_index),
        WORLD_SIZE=str(plan.hosts),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=plan.coordinator_host,
        MASTER_PORT=str(plan.coordinator_port),
        JAX_COORDINATOR_ADDRESS=plan.coordinator_address,
        JAX_NUM_PROCESSES=str(plan.hosts),
        JAX_PROCESS_ID=str(host_index),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{xla_flags} --xla_force_host_platform_device_count={plan.devices_per_host}".strip(),
        PYTHONUNBUFFERED="1",
    )
    env.update(plan.env)
    return env


def _prctl(option: int, value: int) -> None:
    """Linux process controls; elsewhere a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (AttributeError, OSError):
        pass


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process if the supervisor dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _adopt_orphans() -> None:
    """Become the parent of whatever the hosts start and then abandon, even in a
    new session, so nothing outlives the job."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _end_adopted_orphans() -> None:
    """SIGKILL and reap every remaining child: descendants the hosts left behind."""
    me = str(os.getpid())
    try:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except FileNotFoundError:
        pids = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parent = stat.read().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if parent == me:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    while True:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            return


@dataclasses.dataclass
class _Host:
    index: int
    pid: int
    pipe: int | None
    log: LogChunkWriter
    #: Readable when the process ends (Linux 5.3+), so its end wakes the loop at once.
    pidfd: int | None = None
    stop_sent_at: float | None = None
    killed: bool = False
    wait_status: int | None = None

    @property
    def alive(self) -> bool:
        return self.wait_status is None


class Supervisor:
    def __init__(self, storage: Storage, plan: JobPlan):
        self.storage = storage
        self.plan = plan
        self.hosts: dict[int, _Host] = {}
        self.selector = selectors.DefaultSelector()
        self.first_failure_at: float | None = None
        self.cancelled = False
        self._next_cancel_check = 0.0
        self.scratch_outputs: str | None = None

    def start_hosts(self) -> None:
        # Hosts write their files to a local directory: the job's own outputs/
        # on file://, else a scratch directory published to outputs/ at the end.
        output_dir = self.storage.local_path(protocol.OUTPUTS_DIR)
        if output_dir is None:
            output_dir = self.scratch_outputs = tempfile.mkdtemp(prefix=f"kinetic-{self.plan.job_id}-outputs-")
        os.makedirs(output_dir, exist_ok=True)
        base = dict(os.environ)
        sys.stdout.flush()
        sys.stderr.flush()
        for index in range(self.plan.hosts):
            env = host_environment(self.plan, index, self.storage.uri, output_dir, base)
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # the host
                self._become_host(index, env, write_end)
            os.close(write_end)
            os.set_blocking(read_end, False)
            self.selector.register(read_end, selectors.EVENT_READ, index)
            host = self.hosts[index] = _Host(index, pid, read_end, LogChunkWriter(self.storage, index))
            try:
                host.pidfd = os.pidfd_open(pid)
                self.selector.register(host.pidfd, selectors.EVENT_READ, index)
            except (AttributeError, OSError):
                pass  # no pidfds here: the loop's timeout bounds how late an end is seen

    def _become_host(self, index: int, env: dict[str, str], write_end: int) -> None:
        code = protocol.EXIT_FAILED
        try:
            os.setpgid(0, 0)
            _die_with_parent()
            for other in self.hosts.values():
                os.close(other.pipe)
                if other.pidfd is not None:
                    os.close(other.pidfd)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            os.close(write_end)
            os.close(devnull)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = ["python -m kinetic_nb.runner", "--job", self.storage.uri]
            code = run_host(self.storage.uri)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)

    def run(self) -> None:
        while any(host.alive for host in self.hosts.values()):
            self._pump(timeout=0.1)
            self._reap()
            self._check_cancel()
            self._stop_survivors_if_due()
        self.selector.close()
        _end_adopted_orphans()

    def _pump(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            host = self.hosts[key.data]
            if key.fd == host.pipe:
                self._read(host)
        for host in self.hosts.values():
            if host.log.due():
                host.log.flush()

    def _read(self, host: _Host) -> bool:
        """Read what the host's pipe holds; False once it is closed."""
        try:
            data = os.read(host.pipe, 1 << 16)
        except BlockingIOError:
            return True
        except OSError as error:
            if error.errno != errno.EIO:
                raise
            data = b""
        if data:
            host.log.feed(data)
            return True
        self.selector.unregister(host.pipe)
        os.close(host.pipe)
        host.pipe = None
        return False

    def _reap(self) -> None:
        for host in self.hosts.values():
            if not host.alive:
                continue
            pid, wait_status = os.waitpid(host.pid, os.WNOHANG)
            if pid == 0:
                continue
            host.wait_status = wait_status
            if host.pidfd is not None:
                self.selector.unregister(host.pidfd)
                os.close(host.pidfd)
                host.pidfd = None
            self._kill_group(host, signal.SIGKILL)  # whatever the host left behind
            self._drain(host)
            self._record_exit(host)

    def _drain(self, host: _Host) -> None:
        deadline = time.monotonic() + DRAIN_S
        while host.pipe is not None and time.monotonic() < deadline:
            if self._read(host):
                time.sleep(0.005)
        if host.pipe is not None:
            self.selector.unregister(host.pipe)
            os.close(host.pipe)
            host.pipe = None
        host.log.flush(final=True)

    def _record_exit(self, host: _Host) -> None:
        code = os.waitstatus_to_exitcode(host.wait_status)
        summary = ExitSummary(
            host_index=host.index,
            exit_code=code if code >= 0 else None,
            signal=signal.Signals(-code).name if code < 0 else None,
            recorded_success=self._recorded_success(host.index),
            stopped=host.stop_sent_at is not None,
            ended_at=time.time(),
        )
        if not any(other.alive for other in self.hosts.values()):
            self._publish_outputs()  # before the last exit record: the client is done once it lands
        try:
            self.storage.write_bytes(protocol.host_exit(host.index), summary.to_json())
        except Exception:  # the job must still be supervised; the client will see the host as lost
            traceback.print_exc()
        if summary.failed and self.first_failure_at is None:
            self.first_failure_at = time.monotonic()

    def _publish_outputs(self) -> None:
        """Upload the hosts' scratch outputs to the job's outputs/ (non-local storage only), then remove them."""
        if self.scratch_outputs is None:
            return
        try:
            for directory, _, files in os.walk(self.scratch_outputs):
                for file_name in files:
                    path = os.path.join(directory, file_name)
                    relative = os.path.relpath(path, self.scratch_outputs).replace(os.sep, "/")
                    self.storage.write_file(f"{protocol.OUTPUTS_DIR}/{relative}", path)
        except Exception:
            traceback.print_exc()
        finally:
            shutil.rmtree(self.scratch_outputs, ignore_errors=True)
            self.scratch_outputs = None

    def _recorded_success(self, index: int) -> bool:
        try:
            status = HostStatus.from_json(self.storage.read_bytes(protocol.host_status(index)))
        except (ObjectNotFoundError, ValueError, TypeError):
            return False
        return status.state == HostState.SUCCEEDED.value

    def _check_cancel(self) -> None:
        now = time.monotonic()
        if self.cancelled or now < self._next_cancel_check:
            return
        self._next_cancel_check = now + CANCEL_POLL_S
        if self.storage.exists(protocol.CANCEL):
            self.cancelled = True
            self._stop_all()

    def _stop_survivors_if_due(self) -> None:
        if self.first_failure_at is not None and time.monotonic() - self.first_failure_at >= self.plan.grace_s:
            self._stop_all()
        now = time.monotonic()
        for host in self.hosts.values():
            if host.alive and host.stop_sent_at is not None and not host.killed and now - host.stop_sent_at >= TERM_TO_KILL_S:
                host.killed = True
                self._kill_group(host, signal.SIGKILL)

    def _stop_all(self) -> None:
        for host in self.hosts.values():
            if host.alive and host.stop_sent_at is None:
                host.stop_sent_at = time.monotonic()
                self._kill_group(host, signal.SIGTERM)

    @staticmethod
    def _kill_group(host: _Host, signum: int) -> None:
        try:
            os.killpg(host.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kinetic_nb.backends.local_supervisor")
    parser.add_argument("--job", required=True, help="the job's storage URI")
    parser.add_argument("--log", help="where this supervisor's own output goes; removed at the end if empty")
    args = parser.parse_args(argv)
    storage = open_storage(args.job)
    plan = JobPlan.from_json(storage.read_bytes(protocol.PLAN))
    _adopt_orphans()
    supervisor = Supervisor(storage, plan)
    supervisor.start_hosts()
    supervisor.run()
    sys.stdout.flush()
    sys.stderr.flush()
    if args.log and os.path.exists(args.log) and os.path.getsize(args.log) == 0:
        os.unlink(args.log)  # nothing went wrong: nothing to keep
    return 0


if __name__ == "__main__":
    sys.exit(main())
