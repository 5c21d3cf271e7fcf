"""Launch overhead of a trivial cell on 1, 2, 4 and 8 local hosts, against a floor.

The floor, measured in the same run: the same number of parallel
``python -c "import kinetic_nb.runner"`` processes, started and waited for.
The goal is a trivial cell (no framework) within 1.5x of the floor. From a
notebook's second local job on, the job's agent is forked by the notebook's
warm agent (``kinetic_nb.agent.warm``), past its imports: that is the "cell"
column. The "cold" column is the same cell with every agent started afresh
(``KINETIC_WARM_AGENT=0``), as a notebook's first job is. JAX and torch
initialisation are printed separately, as the extra time over the trivial
cell.

The ssh rows run the trivial cell with ``-b ssh`` on 4 real sshd's this script
starts on loopback addresses (``tests/ssh_hosts.py``, as the tests do), once
the hosts' environment is installed (a first job installs it), against the
local one-shot cell; and a session's trivial cell on them against a local
session's. ``--no-ssh`` skips them (they need Debian's openssh-server).

The hosts x processes rows (``--shapes 2x4``) run the trivial cell on hosts
that each run several processes (``procs_per_host``: torch on GPU hosts runs
one per GPU), against the floor of as many processes in all.

The Ray column is the same trivial cell with ``-b ray`` on a 4-node Ray
cluster this script starts on this machine (``tests/ray_cluster.py``: 1 CPU
a node, one host per node) and stops before it exits, so only host counts
up to 4 have one; ``--no-ray`` skips it (it needs the ``ray`` extra).

    python benchmarks/launch_overhead.py [--repeat 5] [--hosts 1 2 4 8] [--shapes 2x4] [--no-frameworks] [--no-ray]
                                         [--no-ssh]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' Ray cluster helper

import kinetic_nb
from kinetic_nb.backends.warm_agent import WARM_AGENT_ENV

#: Nodes of the local Ray cluster the Ray column runs on: one host per node, so up to 4 hosts.
RAY_NODES = 4


def floor_seconds(hosts: int) -> float:
    started = time.perf_counter()
    processes = [subprocess.Popen([sys.executable, "-c", "import kinetic_nb.runner"]) for _ in range(hosts)]
    for process in processes:
        process.wait()
    return time.perf_counter() - started


def cell_seconds(source: str, hosts: int, framework: str, **options) -> float:
    started = time.perf_counter()
    kinetic_nb.submit(source, hosts=hosts, framework=framework, **options).result()
    return time.perf_counter() - started


def cold_cell_seconds(source: str, hosts: int, framework: str) -> float:
    """The cell with its agent started afresh, as a notebook's first job's is."""
    os.environ[WARM_AGENT_ENV] = "0"
    try:
        return cell_seconds(source, hosts, framework)
    finally:
        del os.environ[WARM_AGENT_ENV]


def ray_cluster(skip: bool) -> contextlib.AbstractContextManager:
    """The local Ray cluster the Ray column runs on, started on entry and stopped on exit (None with ``skip``)."""
    if skip:
        return contextlib.nullcontext()
    from tests.ray_cluster import RayCluster

    return RayCluster(RAY_NODES)


def ssh_rows(repeat: int) -> None:
    """The trivial cell and a session's trivial cell with -b ssh on 4 loopback sshd's, against the local ones."""
    import sysconfig

    from tests.ssh_hosts import SshTestHosts

    python = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    with tempfile.TemporaryDirectory(prefix="kinetic-bench-ssh-cache-") as cache, \
            tempfile.TemporaryDirectory(prefix="kinetic-bench-notebook-") as notebook, \
            contextlib.chdir(notebook), \
            SshTestHosts(4, {"PYTHONPATH": sysconfig.get_paths()["purelib"], "XDG_CACHE_HOME": cache}) as hosts:
        # (cells run from a notebook's folder of their own: the hosts get a copy of it)
        print(f"\n{'-b ssh, 4 loopback sshd':>24}  {'ssh s':>8}  {'local s':>8}  {'ratio':>6}  (goal <= 1.50)")
        for count in (1, 2, 4):
            on_ssh = {"backend": "ssh", "backend_options": {"ssh_hosts": ",".join(hosts.targets[:count]),
                                                            "ssh_config": hosts.config, "ssh_python": python}}
            cell_seconds("None", None, "none", **on_ssh)  # the hosts' environment, installed once
            ssh_s = median_of(repeat, functools.partial(cell_seconds, "None", None, "none", **on_ssh))
            local_s = median_of(repeat, cell_seconds, "None", count, "none")
            print(f"{f'one-shot cell, {count} hosts':>24}  {ssh_s:8.3f}  {local_s:8.3f}  {ssh_s / local_s:6.2f}")
        ssh_session = kinetic_nb.start(framework="none", echo=False, backend="ssh", backend_options=on_ssh[
            "backend_options"])
        local_session = kinetic_nb.start(hosts=4, framework="none", echo=False)
        try:
            for session in (ssh_session, local_session):
                session.run("None").result()
            runs = max(repeat, 11)
            ssh_s = median_of(runs, lambda: _timed(lambda: ssh_session.run("None").result()))
            local_s = median_of(runs, lambda: _timed(lambda: local_session.run("None").result()))
            print(f"{'session cell, 4 hosts':>24}  {ssh_s:8.3f}  {local_s:8.3f}  {ssh_s / local_s:6.2f}")
        finally:
            ssh_session.stop()
            local_session.stop()


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def median_of(repeat: int, measure, *args) -> float:
    return statistics.median(measure(*args) for _ in range(repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--shapes", nargs="*", default=["2x4"], metavar="HOSTSxPROCS",
                        help="hosts x processes per host rows (none: skip them)")
    parser.add_argument("--no-frameworks", action="store_true", help="skip the JAX and torch rows")
    parser.add_argument("--no-ssh", action="store_true", help="skip the ssh rows (4 local sshd's)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray column (no local Ray cluster)")
    args = parser.parse_args()
    storage = tempfile.TemporaryDirectory(prefix="kinetic-bench-")  # removed as the benchmark ends
    os.environ.setdefault("KINETIC_STORAGE", storage.name)
    cell_seconds("None", 1, "none")  # warm the page cache once, and start this process's warm agent

    print(f"median of {args.repeat} runs; floor = N parallel `python -c 'import kinetic_nb.runner'`; "
          "cold = the cell with its agent started afresh (a notebook's first job); "
          f"ray = the cell with -b ray on a local {RAY_NODES}-node Ray cluster")
    print(f"{'hosts':>5}  {'floor s':>8}  {'cell s':>8}  {'ratio':>6}  {'cold s':>8}  {'ratio':>6}  {'ray s':>8}  "
          f"{'ray/cell':>8}  (goal <= 1.50)")
    trivial = {}
    with ray_cluster(args.no_ray) as cluster:
        on_ray = {"backend": "ray", "backend_options": {"address": cluster.address}} if cluster else None
        if on_ray:
            cell_seconds("None", 1, "none", **on_ray)  # the cluster's first job starts its worker pool
        for hosts in args.hosts:
            floor = median_of(args.repeat, floor_seconds, hosts)
            trivial[hosts] = median_of(args.repeat, cell_seconds, "None", hosts, "none")
            cold = median_of(args.repeat, cold_cell_seconds, "None", hosts, "none")
            ray = "-"
            if on_ray and hosts <= RAY_NODES:
                ray_s = median_of(args.repeat, functools.partial(cell_seconds, "None", hosts, "none", **on_ray))
                ray = f"{ray_s:8.3f}  {ray_s / trivial[hosts]:8.2f}"
            print(f"{hosts:>5}  {floor:8.3f}  {trivial[hosts]:8.3f}  {trivial[hosts] / floor:6.2f}  {cold:8.3f}  "
                  f"{cold / floor:6.2f}  {ray:>8}")
    if args.shapes:
        print(f"\n{'hosts x processes':>17}  {'floor s':>8}  {'cell s':>8}  {'ratio':>6}  (goal <= 1.50; floor: as many "
              "processes in all)")
    for shape in args.shapes:
        hosts, per_host = (int(part) for part in shape.split("x"))
        floor = median_of(args.repeat, floor_seconds, hosts * per_host)
        cell = median_of(args.repeat, functools.partial(cell_seconds, "None", hosts, "none", procs_per_host=per_host))
        print(f"{shape:>17}  {floor:8.3f}  {cell:8.3f}  {cell / floor:6.2f}")
    if not args.no_ssh:
        ssh_rows(args.repeat)
    if args.no_frameworks:
        return
    print("\nframework initialisation (import + distributed init + teardown), over the trivial cell:")
    print(f"{'hosts':>5}  {'jax s':>8}  {'jax extra':>9}  {'torch s':>8}  {'torch extra':>11}")
    repeat = max(1, args.repeat // 2)
    for hosts in args.hosts:
        jax_s = median_of(repeat, cell_seconds, "import jax\njax.process_count()", hosts, "jax")
        torch_s = median_of(repeat, cell_seconds, "import torch.distributed as d\nd.get_world_size()", hosts, "torch")
        print(f"{hosts:>5}  {jax_s:8.3f}  {jax_s - trivial[hosts]:9.3f}  {torch_s:8.3f}  {torch_s - trivial[hosts]:11.3f}")


if __name__ == "__main__":
    main()
