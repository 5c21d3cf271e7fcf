"""How fast a failure reaches the notebook, and how fast the rest of the job is gone.

For 4 and 16 local hosts, one host is SIGKILLed (``os.kill`` from the cell, so
its death time is known) while the others are either blocked in a JAX
collective (JAX then aborts them itself) or asleep and unaware (only the
supervisor's stop after the grace period ends them). Printed, each next to
its goal:

- detection: from the host's death to the cell raising (goal: under 1 s);
- teardown: from the death to the last host process gone (goal: grace + 1 s).

    python benchmarks/failure_detection.py [--grace 3] [--hosts 4 16]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import psutil

import kinetic_nb
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


def job_pids(job_uri: str) -> list[int]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if job_uri in " ".join(process.info["cmdline"] or ()):
                found.append(process.pid)
        except psutil.Error:
            continue
    return found


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
    died_at = float(open(death_file).read())
    while job_pids(handle.uri):
        time.sleep(0.02)
    gone_at = time.time()
    os.unlink(death_file)
    return raised_at - died_at, gone_at - died_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grace", type=float, default=3.0)
    parser.add_argument("--hosts", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    os.environ.setdefault("KINETIC_STORAGE", tempfile.mkdtemp(prefix="kinetic-bench-"))
    print(f"grace = {args.grace:g} s")
    print(f"{'peers':<10}  {'hosts':>5}  {'detect s':>8}  {'goal':>5}  {'ratio':>6}  {'gone s':>7}  {'goal':>5}  "
          f"{'ratio':>6}")
    for peers in ("blocked", "asleep"):
        for hosts in args.hosts:
            detect, gone = measure(hosts, args.grace, peers)
            goal_gone = args.grace + 1
            print(f"{peers:<10}  {hosts:>5}  {detect:8.2f}  {1.0:5.1f}  {detect / 1.0:6.2f}  {gone:7.2f}  "
                  f"{goal_gone:5.1f}  {gone / goal_gone:6.2f}")


if __name__ == "__main__":
    main()
