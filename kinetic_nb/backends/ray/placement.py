"""Where a job's hosts go on a Ray cluster: one bundle per host, the strategy, and why a group waits.

Pure functions of the plan and of what the cluster reports (``ray.nodes()``,
``placement_group_table``); no ``ray`` import, so they are tested without a
cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kinetic_nb.accelerators import Accelerator

#: One host per node, as on a real slice: each host has a node's network and accelerators to itself.
SPREAD = "STRICT_SPREAD"
#: ``--ray-pack``: hosts spread over the nodes as evenly as Ray can, so they share a node only when the
#: cluster has fewer nodes than hosts (Ray's ``PACK`` would crowd them onto one node with others idle).
SHARED = "SPREAD"
#: Ray's TPU generation names for the accelerators' families (its pod types are ``{version}-{chips}``).
TPU_VERSIONS = {"tpu-v4": "v4", "tpu-v5e": "v5litepod", "tpu-v5p": "v5p", "tpu-v6e": "v6e"}
#: Each host's actor holds one CPU: enough to run the agent, and what makes one bundle a host.
CPUS_PER_HOST = 1
#: With ``--ray-pack``, a host's share of a CPU: a hundred hosts fit on one CPU of a node, so a node takes
#: more hosts than it has CPUs (Ray refuses a bundle of zeros, so it cannot be none).
SHARED_CPUS_PER_HOST = 0.01


def tpu_version(accelerator: Accelerator) -> str | None:
    """Ray's generation name for a TPU accelerator (``v5litepod``), or None for cpu and gpu."""
    return next((version for prefix, version in TPU_VERSIONS.items() if accelerator.name.startswith(prefix)), None)


#: The generations whose Cloud TPU accelerator type counts TensorCores (two per chip), not chips.
_COUNTS_CORES = frozenset({"v4", "v5p"})


def pod_type(accelerator: Accelerator) -> str:
    """The slice's Cloud TPU accelerator type, as Ray names its TPU resources (``v5litepod-16``, ``v5p-16``;
    ``tpu-v6e-2x4``, two hosts of 4 chips, is a ``v6e-8``)."""
    version = tpu_version(accelerator)
    return f"{version}-{accelerator.devices * (2 if version in _COUNTS_CORES else 1)}"


def host_bundles(accelerator: Accelerator, hosts: int, *, shared: bool = False) -> list[dict[str, float]]:
    """One resource bundle per host: a CPU (a hundredth of one when ``shared``), and the host's GPUs or TPU chips.

    On a TPU slice, host 0's bundle also asks for the slice head's resource
    (``TPU-{pod type}-head``, which Ray puts on worker 0 of each slice), so
    host 0, and with it the coordinator, is the slice's worker 0.
    """
    bundle: dict[str, float] = {"CPU": SHARED_CPUS_PER_HOST if shared else CPUS_PER_HOST}
    if accelerator.kind == "gpu":
        bundle["GPU"] = accelerator.devices_per_host
    elif accelerator.kind == "tpu":
        bundle["TPU"] = accelerator.devices_per_host
    bundles = [dict(bundle) for _ in range(hosts)]
    version = tpu_version(accelerator)
    if version is not None and hosts > 1:
        bundles[0][f"TPU-{pod_type(accelerator)}-head"] = 1
    return bundles


def alive_nodes(nodes: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [node for node in nodes if node.get("Alive")]


def too_few_nodes(hosts: int, nodes: Sequence[Mapping[str, Any]], address: str) -> str | None:
    """Why ``hosts`` hosts cannot each have a node of their own on this cluster, in one line; else None."""
    alive = len(alive_nodes(nodes))
    if hosts <= alive:
        return None
    return (f"{hosts} hosts need {hosts} Ray nodes (one host per node, as on a slice) and the cluster at "
            f"{address} has {alive}: add nodes, use fewer hosts, or pass --ray-pack to let hosts share nodes")


def _resources(bundle: Mapping[str, float]) -> str:
    return ", ".join(f"{name}: {amount:g}" for name, amount in sorted(bundle.items()))


def pending_reason(table: Mapping[str, Any], bundles: Sequence[Mapping[str, float]], strategy: str,
                   nodes: Sequence[Mapping[str, Any]]) -> str:
    """Why a placement group waits, in one line: its scheduling state, what it asks, what the cluster has."""
    stats = table.get("stats") or {}
    state = str(stats.get("scheduling_state") or table.get("state") or "PENDING")
    alive = alive_nodes(nodes)
    free_cpus = sum(node.get("Resources", {}).get("CPU", 0) for node in alive)
    asks = f"{len(bundles)} x {{{_resources(bundles[0])}}}" if bundles else "nothing"
    return (f"Ray placement group {state.lower().replace('_', ' ')}: asks {asks} ({strategy}); "
            f"the cluster has {len(alive)} alive nodes, {free_cpus:g} CPUs in all")
