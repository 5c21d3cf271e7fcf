"""A real Ray cluster on this machine: a head and worker nodes, 1 CPU each, on loopback.

Every node is started with ``ray start`` on ``127.0.0.2``: Ray 2.60 replaces
``127.0.0.1`` (and ``localhost``) with the machine's interface address, and
only those two spellings, so another loopback address is how the whole
cluster stays on loopback. Each cluster has its own temporary directory, which
its processes name on their command line or, those whose command line Ray
replaced with a title (``ray::DashboardAgent``, a worker's ``ray::IDLE``),
hold their logs open in: that is how the cluster is stopped (its processes
and no one else's, unlike ``ray stop``) and how a test proves that none of
them survived.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil

#: Loopback, but not a spelling Ray rewrites to the interface address.
NODE_ADDRESS = "127.0.0.2"
#: Seconds one ``ray start`` may take on a busy 2-core machine.
START_TIMEOUT_S = 180.0
#: A node whose raylet was killed is declared dead after about period x threshold (default 15 s).
HEALTH_CHECK = '{"health_check_period_ms": 1000, "health_check_failure_threshold": 3}'
#: How Ray titles the processes whose command line it replaces (its agents, workers and actors).
RAY_TITLE = "ray::"
#: How long, at most, a job's actors and placement group may take to be gone after its outcome.
CLEANUP_WAIT_S = 60.0
#: How a host's actor process names itself (Ray's process title: ``ray::CLASS`` or ``ray::CLASS.METHOD``).
HOST_ACTOR_TITLE = "ray::RayHost"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((NODE_ADDRESS, 0))
        return probe.getsockname()[1]


class RayCluster:
    """``nodes`` Ray nodes of 1 CPU each on this machine; ``address`` is the head's ``HOST:PORT``."""

    def __init__(self, nodes: int = 4):
        self.nodes = nodes
        self.port = _free_port()
        self.address = f"{NODE_ADDRESS}:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="kn-ray-")  # short: Ray's socket paths live below it
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)

    def _ray(self, *arguments: str) -> None:
        # No log monitor: kinetic_nb connects with log_to_driver=False, so nothing reads what it would push, and
        # it took about half of an idle cluster's CPU here.
        command = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--num-cpus", "1",
                   "--node-ip-address", NODE_ADDRESS, "--temp-dir", self.temp_dir, "--disable-usage-stats",
                   "--include-log-monitor", "false", *arguments]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=START_TIMEOUT_S,
                              check=False)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")

    def start(self) -> RayCluster:
        # Every port the head would take by default (8265, 10001) is chosen free: another cluster on this
        # machine (a second test run, a user's own) must not stop this one from starting.
        self._ray("--head", "--port", str(self.port), "--include-dashboard", "true", "--dashboard-host",
                  NODE_ADDRESS, "--dashboard-port", str(_free_port()), "--ray-client-server-port", str(_free_port()),
                  "--system-config", HEALTH_CHECK)
        for _ in range(self.nodes - 1):
            self.add_node()
        return self

    def __enter__(self) -> RayCluster:
        """Start the cluster and wait for its nodes (for scripts; the tests use the ``ray_cluster`` fixture)."""
        try:
            self.start()
            self.wait_for_nodes(self.nodes)
        except BaseException:
            self._stop_and_report()
            raise
        return self

    def __exit__(self, error_type: type | None, *_: object) -> None:
        """Wait for kinetic_nb's actors and groups to be gone (a job's cleanup ends just after its outcome),
        then stop the cluster; name on stderr anything that was left or survived."""
        if error_type is None and (left := self.wait_until_nothing_is_left()):
            print(f"left in the Ray cluster: {left}", file=sys.stderr)
        self._stop_and_report()

    def _stop_and_report(self) -> None:
        survivors = self.stop()
        if survivors:
            print(f"Ray processes that survived the cluster's stop: {survivors}", file=sys.stderr)

    def add_node(self) -> None:
        """Start one more worker node (a node killed by a test comes back this way)."""
        self._ray("--address", self.address)

    def alive_nodes(self) -> list[dict]:
        """The cluster's alive nodes, as ``ray.nodes()`` has them (this process connects, as kinetic_nb would)."""
        from kinetic_nb.backends.ray.backend import connect

        return [node for node in connect(self.address).nodes() if node["Alive"]]

    def wait_for_nodes(self, count: int, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while len(self.alive_nodes()) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster has {len(self.alive_nodes())} alive nodes, not {count}")
            time.sleep(0.5)

    def kill_node(self, node_id: str) -> None:
        """SIGKILL worker node ``node_id``'s raylet, its agents and everything they started, as a machine lost."""
        markers = (f"--node_id={node_id}", f"--node-id={node_id}")
        roots = [process for process in self.processes()
                 if any(marker in " ".join(_cmdline(process)) for marker in markers)]
        assert roots, f"no process of node {node_id}"
        for root in roots:
            try:
                victims = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for process in victims:
                try:
                    process.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster still running: each names the cluster's temporary directory or its
        address on its command line (Ray's client server), or is titled by Ray and holds a file open below
        that directory (its logs)."""
        found = []
        for process in psutil.process_iter(["pid", "cmdline"]):
            try:
                command = " ".join(process.info["cmdline"] or ())
                ours = (self.temp_dir in command or f"--address={self.address} " in f"{command} "
                        or (command.startswith(RAY_TITLE)
                            and any(file.path.startswith(self.temp_dir) for file in process.open_files())))
                if ours and process.status() != "zombie":
                    found.append(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def kinetic_leftovers(self) -> list[str]:
        """kinetic_nb's actors still alive, placement groups not removed and host actor processes still running."""
        from ray.util.state import list_actors, list_placement_groups

        from kinetic_nb.backends.ray.backend import RAY_NAMESPACE

        actors = list_actors(address=self.address, filters=[("ray_namespace", "=", RAY_NAMESPACE)], limit=10000)
        groups = list_placement_groups(address=self.address, limit=10000)
        return ([f"actor {actor.name}: {actor.state}" for actor in actors if actor.state != "DEAD"]
                + [f"group {group.name}: {group.state}" for group in groups
                   if group.name.startswith(("kn-", "ks-")) and group.state != "REMOVED"]
                + [f"process {process.pid}: {' '.join(_cmdline(process))[:100]}" for process in self.host_actors()])

    def host_actors(self) -> list[psutil.Process]:
        """This cluster's processes that are a host's actor (Ray's process title replaced their command line)."""
        return [process for process in self.processes() if " ".join(_cmdline(process)).startswith(HOST_ACTOR_TITLE)]

    def wait_until_nothing_is_left(self, timeout: float = CLEANUP_WAIT_S) -> list[str]:
        """Wait for :meth:`kinetic_leftovers` to be empty; returns what is still left (nothing, normally)."""
        deadline = time.monotonic() + timeout
        while (left := self.kinetic_leftovers()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def stop(self) -> list[str]:
        """Stop every process of the cluster; returns those that survived a SIGKILL (none, normally)."""
        import ray

        ray.shutdown()
        for signum, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
            for process in self.processes():
                try:
                    process.send_signal(signum)
                except psutil.NoSuchProcess:
                    pass
            deadline = time.monotonic() + wait
            while self.processes() and time.monotonic() < deadline:
                time.sleep(0.1)
        survivors = [f"{process.pid}: {' '.join(_cmdline(process))[:200]}" for process in self.processes()]
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return survivors


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []
