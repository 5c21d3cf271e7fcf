"""The real-GPU check, for a machine with at least one NVIDIA GPU and torch and JAX built for CUDA.

Runs on the local backend, on the machine's own GPUs (not the CPU simulation):

1. a 1-host torch cell on NCCL: an all-reduce on ``cuda:0`` (one GPU allows an
   NCCL world of one only: NCCL refuses two ranks on one device);
2. a JAX cell whose ``jax.devices()`` are GPUs;
3. a torch session of 3 cells on the GPU, its tensor kept from cell to cell;
4. a shape the machine lacks (``-n`` one more host than it has GPUs), refused in one line;
5. each host's accelerator memory at a cell's end (issue 28): a torch cell holding 1 GiB on ``cuda:0`` and a
   JAX cell holding 1 GiB on its GPU report ``device`` and ``device_peak`` of at least that in their status;
6. a profiled torch cell on the GPU (``--profile``, issue 28): its merged trace holds the GPU's kernels.

Each step prints one line with its result and time; the script exits 1 if any
step fails. Save its output under ``benchmarks/results/`` with the date.

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
import traceback

import kinetic_nb
from kinetic_nb.runner.gpus import machine_gpus

NCCL_ALL_REDUCE = (
    "import torch, torch.distributed as dist\n"
    "t = torch.ones(4, device='cuda') * (dist.get_rank() + 1)\n"
    "dist.all_reduce(t)\n"
    "(dist.get_backend(), str(t.device), torch.cuda.get_device_name(0), t.sum().item())\n"
)
JAX_DEVICES = "import jax\n(jax.default_backend(), [d.platform for d in jax.devices()], jax.process_count())\n"


def step(name: str, run) -> bool:
    started = time.perf_counter()
    try:
        value = run()
    except Exception as error:  # every step is reported, the others still run
        print(f"FAIL {name}: {type(error).__name__}: {str(error).splitlines()[0]} ({time.perf_counter() - started:.1f} s)")
        traceback.print_exc(file=sys.stdout)
        return False
    print(f"ok   {name}: {value!r} ({time.perf_counter() - started:.1f} s)")
    return True


def session_cells() -> list:
    session = kinetic_nb.start(hosts=1, accelerator="gpu-h100x1", framework="torch", echo=False)
    try:
        return [session.run(source).result() for source in (
            "import torch\nx = torch.arange(4.0, device='cuda')\nstr(x.device)",
            "x = x * 2\nx.sum().item()",
            "import torch.distributed as dist\ndist.all_reduce(x)\n(dist.get_backend(), x.sum().item())",
        )]
    finally:
        session.stop()


def too_many_hosts() -> str:
    try:
        kinetic_nb.submit("None", accelerator="gpu-h100x1", hosts=len(machine_gpus()) + 1, framework="none")
    except ValueError as error:
        return str(error)
    raise AssertionError("a shape this machine lacks was not refused")


def device_memory(framework: str) -> dict:
    """A cell that keeps 1 GiB on the GPU: its host's end status must carry at least that as ``device``."""
    source = {"torch": "import torch\nheld = torch.ones(256 * 2**20, device='cuda')\nNone",
              "jax": "import jax.numpy as jnp\nheld = jnp.ones(256 * 2**20)\nheld.block_until_ready()\nNone"}[framework]
    handle = kinetic_nb.submit(source, accelerator="gpu-h100x1", framework=framework)
    handle.result()
    memory = dict(handle.snapshot().hosts[0].memory)
    assert memory.get("device", 0) >= 2**30 and memory.get("device_peak", 0) >= memory["device"], memory
    return memory


def gpu_profile() -> str:
    """A profiled torch cell on the GPU: the merged trace must hold the GPU's own kernels (CUDA activity)."""
    import gzip
    import json

    source = "import torch\na = torch.ones(2048, 2048, device='cuda')\nfloat((a @ a).sum())"
    handle = kinetic_nb.submit(source, accelerator="gpu-h100x1", framework="torch", profile=True)
    handle.result()
    merged = handle.profile()
    with gzip.open(merged.path, "rt") as file:
        events = json.load(file)["traceEvents"]
    kernels = [event for event in events if event.get("cat") == "kernel"]
    assert merged.traced == (0,) and kernels, (merged.missing, {event.get("cat") for event in events})
    return f"{len(kernels)} GPU kernel events in {merged.path}"


def main() -> int:
    os.environ.setdefault("KINETIC_STORAGE", tempfile.mkdtemp(prefix="kinetic-gpu-check-"))
    gpus = machine_gpus()
    print(f"{time.strftime('%Y-%m-%d')} · {platform.node()} · Python {platform.python_version()} · "
          f"kinetic_nb {kinetic_nb.__version__ if hasattr(kinetic_nb, '__version__') else ''} · GPUs: {gpus}")
    results = [
        step("torch NCCL all-reduce on cuda:0, 1 host",
             lambda: kinetic_nb.submit(NCCL_ALL_REDUCE, accelerator="gpu-h100x1", framework="torch").result()),
        step("JAX on the GPU, 1 host",
             lambda: kinetic_nb.submit(JAX_DEVICES, accelerator="gpu-h100x1", framework="jax").result()),
        step("torch session of 3 cells on the GPU", session_cells),
        step("a shape this machine lacks", too_many_hosts),
        step("torch's accelerator memory in a host's end status", lambda: device_memory("torch")),
        step("JAX's accelerator memory in a host's end status", lambda: device_memory("jax")),
        step("a profiled torch cell's merged trace holds its GPU kernels", gpu_profile),
    ]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
