"""Bring a distributed framework up before the cell and down after it.

jax and torch are imported only here, and only when the plan asks for them.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os

from kinetic_nb.runner.protocol import Framework, JobPlan

logger = logging.getLogger(__name__)

#: Set by a platform (a LeaderWorkerSet pod, say) whose coordinator is only
#: known on the host; it overrides the plan's address.
COORDINATOR_ENV = "KINETIC_COORDINATOR_ADDRESS"


def coordinator_address(plan: JobPlan) -> str:
    return os.environ.get(COORDINATOR_ENV) or plan.coordinator_address


def initialize(plan: JobPlan, host_index: int) -> None:
    """Join the job's distributed group, with explicit arguments and short timeouts."""
    address = coordinator_address(plan)
    if plan.framework == Framework.JAX.value:
        import jax

        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=plan.hosts,
            process_id=host_index,
            initialization_timeout=int(plan.barrier_timeout_s),
            heartbeat_timeout_seconds=plan.heartbeat_timeout_s,
            shutdown_timeout_seconds=plan.shutdown_timeout_s,
        )
    elif plan.framework == Framework.TORCH.value:
        import torch
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() and not plan.simulated else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}",
            rank=host_index,
            world_size=plan.hosts,
            timeout=datetime.timedelta(seconds=plan.barrier_timeout_s),
        )


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
