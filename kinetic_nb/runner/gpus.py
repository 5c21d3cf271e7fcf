"""The NVIDIA GPUs this machine shows, counted without CUDA: an agent that forks its processes must never
initialize CUDA itself (a child of a process that did cannot use it: "Cannot re-initialize CUDA in forked
subprocess"). Host-safe: the standard library only (NVML through ctypes)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Mapping

__all__ = ["host_devices", "machine_gpus", "visible_gpus"]

#: Where the NVIDIA driver lists one directory per GPU, for when NVML cannot be loaded.
PROC_GPUS = "/proc/driver/nvidia/gpus"
#: The NVML library the driver installs (GKE's device plugin mounts it under /usr/local/nvidia/lib64).
NVML_LIBRARY = "libnvidia-ml.so.1"


def machine_gpus() -> list[str]:
    """Every NVIDIA GPU of this machine by its model name (``["NVIDIA H200"]``), from NVML, else the driver's
    ``/proc`` listing; [] where there is no driver."""
    names = _nvml_names()
    if names is not None:
        return names
    try:
        entries = sorted(os.listdir(PROC_GPUS))
    except OSError:
        return []
    return [_proc_model(entry) for entry in entries]


def visible_gpus(environ: Mapping[str, str], machine: list[str] | None = None) -> list[str]:
    """The GPUs a process started with ``environ`` may use, as ``CUDA_VISIBLE_DEVICES`` entries (indices or
    UUIDs): those the variable names where it is set (none for ``""`` or ``-1``), else every GPU of the machine."""
    machine = machine_gpus() if machine is None else machine
    named = environ.get("CUDA_VISIBLE_DEVICES")
    if named is None:
        return [str(index) for index in range(len(machine))]
    entries = [entry.strip() for entry in named.split(",") if entry.strip()]
    if not entries or entries[0].startswith("-"):
        return []
    return entries


def host_devices(visible: list[str], host: int, per_host: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for host ``host`` of several simulated on one machine: its own ``per_host``
    GPUs of ``visible``, in order."""
    return ",".join(visible[host * per_host:(host + 1) * per_host])


def _nvml_names() -> list[str] | None:
    try:
        nvml = ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        names = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            name = ctypes.create_string_buffer(96)
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0 \
                    and nvml.nvmlDeviceGetName(handle, name, len(name)) == 0:
                names.append(name.value.decode(errors="replace"))
            else:
                names.append("NVIDIA GPU")
        return names
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _proc_model(entry: str) -> str:
    with contextlib.suppress(OSError), open(os.path.join(PROC_GPUS, entry, "information")) as information:
        for line in information:
            if line.startswith("Model:"):
                return line.split(":", 1)[1].strip()
    return "NVIDIA GPU"
