"""``python -m kinetic_nb.agent --job URI [--all-hosts | --watch]``: a job's host agent."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time

import cloudpickle

from kinetic_nb.agent import processes
from kinetic_nb.agent.local_state import AgentState
from kinetic_nb.agent.supervisor import Agent
from kinetic_nb.agent.watch import wait_for_job_end
from kinetic_nb.errors import IntegrityError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.channel import CHANNEL_ENV, parse_address
from kinetic_nb.runner.envelope import read_sealed, write_sealed
from kinetic_nb.runner.environment_install import installed_environment
from kinetic_nb.runner.execute import exception_type_name
from kinetic_nb.runner.frameworks import on_real_gpus
from kinetic_nb.runner.gpus import host_devices, visible_gpus
from kinetic_nb.runner.host_variables import host_environment, process_environment, resolve_host_index
from kinetic_nb.runner.job_keys import KEY_FILE_ENV, JobKey, key_from_file, key_from_text
from kinetic_nb.runner.protocol import JobPlan, Phase, ResultPayload
from kinetic_nb.runner.redact import host_secrets
from kinetic_nb.runner.wakeup import WOKEN_HOSTS_ENV
from kinetic_nb.storage import open_storage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kinetic_nb.agent", description=__doc__)
    parser.add_argument("--job", required=True, help="the job's storage URI (file://... or gs://...)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--all-hosts", action="store_true",
                      help="run every host of the job here (the local backend), with its environment")
    mode.add_argument("--watch", action="store_true", help="only wait until the job has ended")
    parser.add_argument("--log", help="this agent's own output; removed at the end if empty")
    parser.add_argument("--state", help="where to keep this agent's own record (local backend)")
    parser.add_argument("--parent", type=int, metavar="PID",
                        help="end with this process (a Ray actor that started this agent): SIGKILL when it dies")
    parser.add_argument("--key-stdin", action="store_true",
                        help="read the job's key (hex, one line) from standard input, never from the environment, "
                             "so neither this agent's environment nor its hosts' holds it")
    parser.add_argument("--env-stdin", action="store_true",
                        help="after the key, read one JSON line of environment variables from standard input (an "
                             "ssh host's: the -e values never travel on a command line)")
    parser.add_argument("--detach", action="store_true",
                        help="leave the launching process's tree once this agent's record is written, so "
                             "whatever ends that process and its children (a kernel's shutdown) spares the job")
    args = parser.parse_args(argv)
    if args.parent is not None:
        processes.die_with_parent(args.parent)  # armed before anything else: nothing outlives the actor
    # A launcher's blocked signals (a Ray worker blocks SIGINT) are inherited across exec: unblocked here,
    # every host can be interrupted and stopped as on any backend.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    try:
        key = _read_key(args.key_stdin)
        if args.env_stdin:
            os.environ.update(_read_environment())
    except IntegrityError as error:
        print(f"kinetic agent: {error}; refusing a job it cannot verify", file=sys.stderr)
        return 2
    if key is None:
        print(f"kinetic agent: no job key on standard input (--key-stdin) or in a file named by {KEY_FILE_ENV}; "
              "refusing a job it cannot verify", file=sys.stderr)
        return 2
    storage = open_storage(args.job)
    if args.watch:
        return wait_for_job_end(storage, key)
    ready = _detach() if args.detach else None
    state = AgentState(pid=os.getpid(), started_at=time.time(), process_start=processes.process_start(os.getpid()))

    def keep_state(**changes) -> None:
        nonlocal state
        state = dataclasses.replace(state, **changes)
        if args.state:
            state.write(args.state)

    keep_state()  # before anything can fail: the client then sees this agent end at once, not at a start timeout
    if ready is not None:  # the launcher may go: this agent's record names it
        os.write(ready, b"1")
        os.close(ready)
    try:
        plan = JobPlan.from_json(read_sealed(storage, protocol.PLAN, key))
    except IntegrityError as error:  # a rewritten plan: no host starts, and the client hears why
        print(f"kinetic agent: refusing the job: {error}", file=sys.stderr)
        refuse(storage, key, error)
        keep_state(finished=True)
        return 2
    if args.all_hosts:
        problem = processes.host_count_problem(plan.world_size, plan.framework)
        if problem:
            print(f"kinetic agent: {problem}", file=sys.stderr)
            return 2
        processes.raise_open_file_limit()
        ranks = list(range(plan.world_size))
        base = dict(os.environ)
        # This machine's GPUs, shared out: each host of the slice sees its own (counted without CUDA).
        gpus = visible_gpus(base) if on_real_gpus(plan) else None

        def environment(rank: int, output_dir: str) -> dict[str, str]:
            env = host_environment(plan, rank, storage.uri, output_dir, base)
            env[WOKEN_HOSTS_ENV] = "1"  # beside the notebook, which wakes them (``runner.wakeup``)
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = host_devices(gpus, plan.host_of(rank), plan.devices_per_host)
            return env
    else:  # a pod or VM: this host's index and the job's variables come from the platform; each process's rank here
        ranks = list(plan.ranks_of(resolve_host_index(os.environ) or protocol.LEADER_INDEX))

        def environment(rank: int, output_dir: str) -> dict[str, str]:
            return process_environment(plan, rank, output_dir, os.environ)
    processes.adopt_orphans()
    agent = Agent(storage, plan, ranks, environment, key=key,
                  on_storage_error=lambda text: keep_state(storage_error=text),
                  redactor=host_secrets(key.hex(), plan.env_names))
    signal.signal(signal.SIGTERM, agent.stop_on_signal)  # a pod's deletion: record the hosts as stopped
    if plan.session and storage.local_path() is None:  # a session on a bucket: its cells skip the bucket
        hub = parse_address(os.environ.get(CHANNEL_ENV, ""))  # where a backend placed the hub (host 0's node)
        if args.all_hosts:
            agent.open_hub()
        elif hub is not None and protocol.LEADER_INDEX in ranks:
            agent.open_hub(hub, agents=plan.hosts - 1)
        elif hub is not None:
            agent.join_hub(hub)
    agent.start_hosts()
    install = None if args.all_hosts else installed_environment()
    if install is not None:  # what pip said while this pod installed its environment: first in the host's log
        for host in agent.hosts.values():
            host.log.feed(install.log_text().encode(), protocol.STDERR)
    agent.run()
    keep_state(finished=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if args.log and os.path.exists(args.log) and os.path.getsize(args.log) == 0:
        os.unlink(args.log)  # nothing went wrong: nothing to keep
    return 0


def _read_key(from_stdin: bool) -> JobKey | None:
    """The job's key: from standard input (the local backend's pipe, Ray's), or from the file that
    :data:`KEY_FILE_ENV` names (a pod's, the job's Secret mounted), never from the environment; either way
    the hosts forked from here get it in memory only, and the file's name is not passed on to them."""
    if from_stdin:
        os.environ.pop(KEY_FILE_ENV, None)
        return key_from_text(sys.stdin.readline(), where="standard input")
    return key_from_file(os.environ)


def _read_environment() -> dict[str, str]:
    """One JSON line of variables from standard input, after the key; then standard input is closed (an ssh
    session's channel: a detached agent must not hold it)."""
    line = sys.stdin.readline()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        variables = json.loads(line)
    except ValueError:
        raise IntegrityError("no environment line on standard input after the key (--env-stdin)") from None
    if not isinstance(variables, dict) or not all(isinstance(value, str) for value in variables.values()):
        raise IntegrityError("the environment line on standard input is not an object of strings (--env-stdin)")
    return variables


def refuse(storage, key: bytes, error: BaseException) -> None:
    """Record, signed, that the job was refused before any host started: the leader's failure in plan check."""
    payload = ResultPayload(success=False, host_index=protocol.LEADER_INDEX, phase=Phase.PLAN_CHECK.value,
                            exception=cloudpickle.dumps(error), exception_type=exception_type_name(error),
                            exception_message=str(error))
    try:
        write_sealed(storage, protocol.RESULT, key, cloudpickle.dumps(payload.to_dict()), exclusive=True)
    except Exception as failure:  # noqa: BLE001 - the client still sees the agent end, with this line
        print(f"kinetic agent: could not record the refusal: {failure}", file=sys.stderr)


def _detach() -> int:
    """Fork; the parent exits once the child says it is ready (0) or dies first (1). Returns the child's pipe end."""
    ready_read, ready_write = os.pipe()
    if os.fork() > 0:
        os.close(ready_write)
        said = os.read(ready_read, 1)
        os._exit(0 if said else 1)
    os.close(ready_read)
    os.setsid()
    return ready_write


if __name__ == "__main__":
    sys.exit(main())
