"""A torch DistributedDataParallel cell, and what full-batch SGD in one process ends with: they must agree."""

from __future__ import annotations

#: Data-parallel SGD on 4 shards of 16 rows (one a rank); the cell's value is the world size and the parameters.
DDP_TRAIN = (
    "import torch, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel\n"
    "torch.manual_seed(0)\n"
    "x, y = torch.randn(64, 3), torch.randn(64, 1)\n"
    "model = DistributedDataParallel(torch.nn.Linear(3, 1))\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "shard = slice(dist.get_rank() * 16, (dist.get_rank() + 1) * 16)\n"
    "for _ in range(5):\n"
    "    optimizer.zero_grad()\n"
    "    torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()\n"
    "    optimizer.step()\n"
    "(dist.get_world_size(), [p.detach().flatten().tolist() for p in model.module.parameters()])\n"
)


def flat(parameters: list[list[float]]) -> list[float]:
    return [value for row in parameters for value in row]


def full_batch_parameters() -> list[list[float]]:
    """The parameters :data:`DDP_TRAIN` ends with, trained here on the whole batch in one process."""
    import torch

    torch.manual_seed(0)
    x, y = torch.randn(64, 3), torch.randn(64, 1)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]
