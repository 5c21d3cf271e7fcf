"""What a host process holds in memory at a cell's end: its resident memory and peak, and its accelerator's.

Measured when a host's status records a cell's end (``StatusReporter``), so it
travels in the write that happens anyway. The accelerator's figures come only
from a framework already started on the host: JAX's ``Device.memory_stats()``
once its backends are up, torch's CUDA allocator once CUDA is initialized; a
host that never started one (or CPU JAX, whose devices report nothing) has
none. Nothing here starts a framework or blocks. Host-safe.
"""

from __future__ import annotations

import os
import resource
import sys

__all__ = ["format_bytes", "measure"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def measure() -> dict[str, int]:
    """``rss`` and ``peak_rss`` (bytes) of this process, and ``device``/``device_peak`` (bytes in use on its
    accelerators, now and at most) where its framework reports them."""
    figures = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        with open("/proc/self/statm") as statm:
            figures["rss"] = int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        figures["rss"] = figures["peak_rss"]
    figures["peak_rss"] = max(figures["peak_rss"], figures["rss"])  # the two are counted apart, in other units
    device = _jax_device_memory() or _torch_device_memory()
    if device:
        figures["device"], figures["device_peak"] = device
    return figures


def _jax_device_memory() -> tuple[int, int] | None:
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            return None  # asking would start JAX's backends
        stats = [device.memory_stats() or {} for device in jax.local_devices()]
    except Exception:  # noqa: BLE001 - a figure to show, never a reason for a cell to fail
        return None
    if not any("bytes_in_use" in each for each in stats):
        return None  # CPU devices report nothing
    return (sum(each.get("bytes_in_use", 0) for each in stats),
            sum(each.get("peak_bytes_in_use", 0) for each in stats))


def _torch_device_memory() -> tuple[int, int] | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None  # asking would initialize CUDA
        return int(torch.cuda.memory_allocated()), int(torch.cuda.max_memory_allocated())
    except Exception:  # noqa: BLE001 - a figure to show, never a reason for a cell to fail
        return None


def format_bytes(size: float) -> str:
    """``size`` bytes as a person reads them: ``512 MiB``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
