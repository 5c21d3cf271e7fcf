"""Bring a distributed framework up before the cell and down after it.

jax and torch are imported only here, and only when the plan asks for them.
"""

from __future__ import annotations

import datetime
import gc
import inspect
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from kinetic_nb.errors import AcceleratorNotSeenError
from kinetic_nb.runner.ports import check_coordinator_port
from kinetic_nb.runner.protocol import Framework, JobPlan

logger = logging.getLogger(__name__)

#: Set by a platform (a LeaderWorkerSet pod, say) whose coordinator is only
#: known on the host; it overrides the plan's address.
COORDINATOR_ENV = "KINETIC_COORDINATOR_ADDRESS"
#: The longest a JAX process other than the leader waits for the coordinator to listen before it joins anyway
#: (JAX then retries on its own, up to the plan's barrier timeout). A JAX client that connects before the
#: coordination service listens waits out gRPC's reconnect backoff, about a second: as a cell's processes start
#: together, every JAX cell paid it.
COORDINATOR_WAIT_S = 60.0
#: How often a waiting process tries the coordinator's port: a refused connection costs microseconds.
COORDINATOR_POLL_S = 0.01


#: Messages of errors that follow from losing a peer (gloo, NCCL, the JAX
#: coordination service), rather than from a host's own code.
_PEER_LOSS = re.compile(
    r"connection (closed|reset) by peer|broken pipe|gloo|nccl|coordination service|heartbeat|"
    r"barrier timed out|peer .* (died|lost|gone)",
    re.IGNORECASE,
)
#: gRPC status codes the JAX coordination service reports when a peer is gone
#: (matched in capitals only: "unavailable" is an ordinary word).
_PEER_LOSS_CODES = re.compile(r"\b(DEADLINE_EXCEEDED|UNAVAILABLE|ABORTED)\b")


#: Where GKE's device plugin mounts the NVIDIA driver (the host script puts it on the paths when it is there).
NVIDIA_DIR = "/usr/local/nvidia"
GKE_DRIVER_HINT = f"; on GKE the driver is mounted at {NVIDIA_DIR}"


def lost_a_peer(text: str) -> bool:
    """Whether ``text`` (an error as ``"Type: message"``) is the framework's word for a peer that is gone: gloo's
    "Connection closed by peer", NCCL's abort, the JAX coordination service's missed heartbeat. A host that
    failed so did not fail on its own; what its framework prints next is teardown noise."""
    return bool(_PEER_LOSS.search(text) or _PEER_LOSS_CODES.search(text))


def on_real_gpus(plan: JobPlan) -> bool:
    """Whether the plan's hosts are GPU hosts (every GPU accelerator's name starts ``gpu-``), not simulated on
    CPU: the framework must see their GPUs."""
    return not plan.simulated and plan.accelerator.startswith("gpu-")


def _jax_cuda_plugin() -> str:
    from importlib import metadata

    names = [name for name in ("jax-cuda12-plugin", "jax-cuda13-plugin", "jaxlib-cuda") if _installed(metadata, name)]
    return f"{', '.join(names)} installed" if names else "no CUDA plugin installed: pip install 'jax[cuda12]'"


def _installed(metadata: Any, name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def coordinator_address(plan: JobPlan) -> str:
    return os.environ.get(COORDINATOR_ENV) or plan.coordinator_address


def local_rank(plan: JobPlan, rank: int) -> int:
    """Process ``rank``'s place on its host, and so its GPU (``cuda:LOCAL_RANK``) where a host runs one per GPU."""
    return rank % plan.procs_per_host


def jax_arguments(plan: JobPlan, rank: int, address: str) -> dict[str, Any]:
    """Every keyword argument the runner would give ``jax.distributed.initialize``, by newer JAX's names.

    ``heartbeat_timeout_seconds`` and ``shutdown_timeout_seconds`` came with
    later JAX releases: the oldest that ``setup.cfg`` allows (0.4.30) takes
    neither and rejects them (:func:`accepted_arguments` leaves them out there).
    A process of several on a GPU host drives its own GPUs (``local_device_ids``).
    """
    arguments = {
        "coordinator_address": address,
        "num_processes": plan.world_size,
        "process_id": rank,
        "initialization_timeout": int(plan.barrier_timeout_s),
        "heartbeat_timeout_seconds": plan.heartbeat_timeout_s,
        "shutdown_timeout_seconds": plan.shutdown_timeout_s,
    }
    if on_real_gpus(plan) and plan.procs_per_host > 1:
        each = max(1, plan.devices_per_host // plan.procs_per_host)
        first = local_rank(plan, rank) * each
        arguments["local_device_ids"] = list(range(first, first + each))
    return arguments


def accepted_arguments(function: Callable[..., Any], arguments: Mapping[str, Any]
                       ) -> tuple[dict[str, Any], list[str]]:
    """The part of ``arguments`` that ``function``'s signature accepts, and the names left out.

    Parameters
    ----------
    function : callable
        The installed ``jax.distributed.initialize``, say.
    arguments : mapping
        Keyword arguments for it.

    Returns
    -------
    (dict, list of str)
        What to pass, and the names of what it does not take, in order. A
        function that takes ``**kwargs``, or whose signature cannot be read,
        is given everything.
    """
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return dict(arguments), []
    if any(parameter.kind == parameter.VAR_KEYWORD for parameter in parameters):
        return dict(arguments), []
    names = {parameter.name for parameter in parameters
             if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)}
    left_out = [name for name in arguments if name not in names]
    return {name: value for name, value in arguments.items() if name in names}, left_out


def wait_for_coordinator(address: str, timeout: float) -> bool:
    """Wait until the coordinator at ``address`` accepts a connection (a name that does not resolve yet, as a
    pod's may not, is tried again).

    Parameters
    ----------
    address : str
        The coordinator's ``host:port`` (an IPv6 host in brackets).
    timeout : float
        Seconds to wait at most.

    Returns
    -------
    bool
        Whether it listens; False once ``timeout`` passed, when the framework's own join says what is wrong.
    """
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, min(1.0, left))).close()
            return True
        except OSError:
            if left <= 0:
                return False
            time.sleep(COORDINATOR_POLL_S)


def initialize(plan: JobPlan, rank: int) -> None:
    """Join the job's distributed group as process ``rank``, with explicit arguments and short timeouts.

    An older JAX (``setup.cfg`` allows 0.4.30) is given only the arguments
    its ``jax.distributed.initialize`` takes; one line on this host's stderr
    names what was left out (JAX's own defaults apply to those). On real GPUs
    a torch process is bound to ``cuda:LOCAL_RANK`` (``torch.cuda.set_device``,
    as torchrun's scripts do: every GPU stays visible, so ``cuda:N`` names
    the same device in every process of the host); a host that shows fewer
    GPUs than its accelerator has fails in one line naming what it saw. A JAX
    process other than the leader joins once the coordinator listens
    (:func:`wait_for_coordinator`), not into gRPC's reconnect backoff.
    """
    address = coordinator_address(plan)
    if rank == 0 and joins_a_group(plan):
        check_coordinator_port(address, plan.name_of(rank))  # one line, not JAX's segmentation fault
    if plan.framework == Framework.JAX.value:
        import jax

        arguments, left_out = accepted_arguments(jax.distributed.initialize, jax_arguments(plan, rank, address))
        if left_out:
            print(f"kinetic_nb: jax {getattr(jax, '__version__', '(unknown version)')}'s "
                  f"jax.distributed.initialize takes no {', '.join(left_out)}: left out, JAX's defaults apply",
                  file=sys.stderr, flush=True)
        if rank != 0:
            wait_for_coordinator(address, min(COORDINATOR_WAIT_S, plan.barrier_timeout_s))
        jax.distributed.initialize(**arguments)
        if on_real_gpus(plan) and jax.default_backend() != "gpu":
            raise AcceleratorNotSeenError(
                f"JAX sees no GPU on this {plan.accelerator} host (jax {jax.__version__}, backend "
                f"{jax.default_backend()}: {_jax_cuda_plugin()}){GKE_DRIVER_HINT}")
        wanted = max(1, plan.devices_per_host // plan.procs_per_host)
        if on_real_gpus(plan) and jax.local_device_count() < wanted:
            raise AcceleratorNotSeenError(
                f"JAX sees {jax.local_device_count()} GPU(s) in {plan.name_of(rank)} of this {plan.accelerator} "
                f"slice, which gives it {wanted} ({plan.devices_per_host} per host, {plan.procs_per_host} "
                f"process{'es' if plan.procs_per_host > 1 else ''} per host)")
    elif plan.framework == Framework.TORCH.value:
        import torch
        import torch.distributed as dist

        if on_real_gpus(plan) and not torch.cuda.is_available():
            raise AcceleratorNotSeenError(
                f"torch sees no CUDA on this {plan.accelerator} host (torch {torch.__version__}, "
                f"{'built for CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU-only build'}, "
                f"{torch.cuda.device_count()} GPU(s) visible){GKE_DRIVER_HINT}")
        if on_real_gpus(plan):
            if torch.cuda.device_count() < plan.devices_per_host:
                raise AcceleratorNotSeenError(
                    f"torch sees {torch.cuda.device_count()} GPU(s) on this {plan.accelerator} host, which has "
                    f"{plan.devices_per_host} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")
            torch.cuda.set_device(local_rank(plan, rank) * max(1, plan.devices_per_host // plan.procs_per_host))
        # A GPU accelerator that is not simulated never falls back to gloo: it has CUDA, checked above.
        backend = "nccl" if on_real_gpus(plan) else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=plan.world_size,
            timeout=datetime.timedelta(seconds=plan.barrier_timeout_s),
        )


def joins_a_group(plan: JobPlan) -> bool:
    """Whether the plan's hosts join a distributed group (jax or torch): one they leave at the end."""
    return plan.framework in (Framework.JAX.value, Framework.TORCH.value)


def shut_down(plan: JobPlan) -> None:
    """Leave the group cleanly after a successful cell.

    torch: collect garbage, meet the peers at a barrier and destroy the group;
    without that a gloo process can abort at exit after a correct result.
    jax: its shutdown barrier, bounded by the plan's shutdown timeout.
    """
    if plan.framework == Framework.JAX.value:
        import jax

        jax.distributed.shutdown()
    elif plan.framework == Framework.TORCH.value:
        import torch.distributed as dist

        if dist.is_initialized():
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()
