"""How fast a failure reaches the notebook, and how fast the rest of the job is gone.

For 4 and 16 local hosts, one host is SIGKILLed (``os.kill`` from the cell, so
its death time is known) while the others are either blocked in a JAX
collective (JAX then aborts them itself) or asleep and unaware (only the
supervisor's stop after the grace period ends them). Printed, each next to
its goal:

- detection: from the host's death to the cell raising (goal: under 1 s);
- teardown: from the death to the last host process gone (goal: grace + 1 s).

With no client at all (the submitting process is SIGKILLed 1 s in), a job
whose hosts sleep forever under ``--timeout T``: from submission to the last
host process gone (goal: T + grace + 2 s, enforced by the job's agent alone).

When the job's agent is SIGKILLed mid-job: from its death to the cell raising
(goal: under 15 s).

``stacks()`` on 4 and 32 sleeping local hosts: from the request to every
host's answer (goal: under 2 s).

    python benchmarks/failure_detection.py [--grace 3] [--hosts 4 16] [--timeout 4]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil

import kinetic_nb
from kinetic_nb.agent.local_state import AgentState
from kinetic_nb.agent.processes import process_start
from kinetic_nb.backends.local import agent_files
from kinetic_nb.errors import JobFailedError

CELL = """
import os, signal, time, pathlib, jax
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices('all in')
if jax.process_index() == 1:
    pathlib.Path(os.environ['DEATH_FILE']).write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
if os.environ['PEERS'] == 'asleep':
    time.sleep(600)
multihost_utils.sync_global_devices('never completes')
"""


def job_pids(job_id: str) -> list[int]:
    """The job's agent (by its own record: its pid and when it started) and every process under it: an agent
    forked by a notebook's warm agent carries that one's command line, not the job's."""
    state = AgentState.read(agent_files(job_id)[1])
    if state is None or process_start(state.pid) != state.process_start:
        return []
    try:
        agent = psutil.Process(state.pid)
        return [agent.pid, *(child.pid for child in agent.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def measure(hosts: int, grace: float, peers: str) -> tuple[float, float]:
    death_file = tempfile.mktemp(prefix="kinetic-death-")
    handle = kinetic_nb.submit(CELL, hosts=hosts, grace=grace, env={"DEATH_FILE": death_file, "PEERS": peers},
                               namespace={}, framework="jax")
    try:
        handle.result()
    except JobFailedError:
        raised_at = time.time()
    else:
        raise AssertionError("the job should have failed")
    with open(death_file) as death:
        died_at = float(death.read())
    while job_pids(handle.job_id):
        time.sleep(0.02)
    gone_at = time.time()
    os.unlink(death_file)
    return raised_at - died_at, gone_at - died_at


def measure_timeout_without_client(timeout: float, grace: float) -> float:
    """Seconds from submission to the last host gone, the submitting process killed 1 s in."""
    script = textwrap.dedent(f"""
        import time, kinetic_nb
        job = kinetic_nb.submit("import time\\ntime.sleep(600)", hosts=4, timeout={timeout}, grace={grace})
        print(job.job_id, job.plan.created_at, flush=True)
        time.sleep(600)
    """)
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    job_id, created_at = kernel.stdout.readline().split()
    time.sleep(1)
    kernel.kill()
    kernel.wait()
    while job_pids(job_id):
        time.sleep(0.02)
    return time.time() - float(created_at)


def measure_agent_death() -> float:
    """Seconds from the job's agent being SIGKILLed to the cell raising."""
    handle = kinetic_nb.submit("import time\nprint('up', flush=True)\ntime.sleep(600)", hosts=4)
    while not all(host.last_line == "up" for host in handle.hosts()):
        time.sleep(0.05)
    state = AgentState.read(agent_files(handle.job_id)[1])
    os.kill(state.pid, signal.SIGKILL)
    killed_at = time.time()
    try:
        handle.result()
    except JobFailedError:
        return time.time() - killed_at
    raise AssertionError("the job should have failed")


def measure_stacks(hosts: int) -> float:
    """Seconds for ``stacks()`` to bring every sleeping host's answer."""
    handle = kinetic_nb.submit("import time\nprint('up', flush=True)\ntime.sleep(600)", hosts=hosts)
    while not all(host.last_line == "up" for host in handle.hosts()):
        time.sleep(0.05)
    started = time.monotonic()
    stacks = handle.stacks()
    took = time.monotonic() - started
    assert all("no answer" not in text for text in stacks.values()), json.dumps(stacks)[:500]
    handle.cancel()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grace", type=float, default=3.0)
    parser.add_argument("--hosts", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--timeout", type=float, default=4.0)
    args = parser.parse_args()
    storage = tempfile.TemporaryDirectory(prefix="kinetic-bench-")  # removed as the benchmark ends
    os.environ.setdefault("KINETIC_STORAGE", storage.name)
    print(f"grace = {args.grace:g} s")
    print(f"{'peers':<10}  {'hosts':>5}  {'detect s':>8}  {'goal':>5}  {'ratio':>6}  {'gone s':>7}  {'goal':>5}  "
          f"{'ratio':>6}")
    for peers in ("blocked", "asleep"):
        for hosts in args.hosts:
            detect, gone = measure(hosts, args.grace, peers)
            goal_gone = args.grace + 1
            print(f"{peers:<10}  {hosts:>5}  {detect:8.2f}  {1.0:5.1f}  {detect / 1.0:6.2f}  {gone:7.2f}  "
                  f"{goal_gone:5.1f}  {gone / goal_gone:6.2f}")
    print()
    stopped = measure_timeout_without_client(args.timeout, args.grace)
    goal = args.timeout + args.grace + 2
    print(f"no client, --timeout {args.timeout:g}: last host gone {stopped:.2f} s after submission; "
          f"goal {goal:.1f} s; ratio {stopped / goal:.2f}")
    died = measure_agent_death()
    print(f"agent SIGKILLed: the cell raised {died:.2f} s later; goal 15 s; ratio {died / 15:.2f}")
    for hosts in (4, 32):
        took = measure_stacks(hosts)
        print(f"stacks() on {hosts:>2} hosts: {took:.2f} s; goal 2 s; ratio {took / 2:.2f}")


if __name__ == "__main__":
    main()
