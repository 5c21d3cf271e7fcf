"""Accelerator names (``tpu-v5e-16``, ``gpu-h100x8``) and the slices they stand for.

A name resolves to an :class:`Accelerator`: how many hosts the slice has, how
many chips or GPUs each host holds, the TPU topology and the GKE node-selector
value. The local backend simulates every TPU and GPU slice with one process per
host and CPU devices in place of chips, so the same cell sees the same
``process_count`` and ``device_count`` here as on the real slice.

The registry is built once, at import, from the compact family tables below.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kinetic_nb.errors import UnknownAcceleratorError

__all__ = ["Accelerator", "accelerator_names", "accelerator_table", "kinetic_spellings", "local_notice",
           "resolve_accelerator"]

#: GKE label whose value selects a TPU node pool.
TPU_NODE_SELECTOR = "cloud.google.com/gke-tpu-accelerator"
#: GKE label whose value selects a GPU node pool.
GPU_NODE_SELECTOR = "cloud.google.com/gke-accelerator"
#: Kubernetes' label of a node's machine type. A TPU topology alone can match two
#: kinds of pool (``2x4`` is one host of 8 chips or two hosts of 4): the machine
#: type says how many chips each host has.
MACHINE_TYPE_SELECTOR = "node.kubernetes.io/instance-type"

#: At most this many close matches are suggested for an unknown name: enough to
#: catch a typo, few enough to keep the error on one readable line.
_MAX_SUGGESTIONS = 3
#: Similarity (0..1, difflib's ratio) a known name needs to be suggested. difflib's
#: own default, which keeps ``tpu-v5e-12`` -> ``tpu-v5e-16`` and drops unrelated names.
_SUGGESTION_CUTOFF = 0.6


@dataclass(frozen=True)
class Accelerator:
    """One slice shape: hosts, devices per host, topology and GKE selector.

    Attributes
    ----------
    name : str
        Canonical name, e.g. ``"tpu-v5e-16"``.
    kind : str
        ``"cpu"``, ``"tpu"`` or ``"gpu"``.
    hosts : int
        Hosts (VMs on GCE, pods on GKE) in the slice.
    devices_per_host : int
        TPU chips or GPUs attached to each host; 1 for ``cpu``.
    topology : str or None
        TPU chip topology, e.g. ``"4x4"``; None for cpu and gpu.
    gke_accelerator : str or None
        Value of the GKE node selector (:data:`TPU_NODE_SELECTOR` for TPUs,
        :data:`GPU_NODE_SELECTOR` for GPUs); None for cpu.
    machine_type : str or None
        The GCE machine type of each TPU host (:data:`MACHINE_TYPE_SELECTOR`),
        e.g. ``"ct5lp-hightpu-4t"``; None for cpu and gpu.
    """

    name: str
    kind: str
    hosts: int
    devices_per_host: int
    topology: str | None
    gke_accelerator: str | None
    machine_type: str | None = None

    @property
    def devices(self) -> int:
        """All devices of the slice: ``hosts * devices_per_host``."""
        return self.hosts * self.devices_per_host

    @property
    def simulated_locally(self) -> bool:
        """Whether the local backend stands in CPU devices for this slice's chips."""
        return self.kind in ("tpu", "gpu")


@dataclass(frozen=True)
class _TpuFamily:
    """One TPU generation: its name prefix, GKE value, aliases and sizes, and how keras-kinetic names them."""

    prefix: str
    gke_accelerator: str
    #: The machine type of a host, ``{chips}`` standing for its chips (GKE's TPU machine types).
    machine_type: str
    #: Cloud TPU's other spellings of a size, ``{n}`` standing for the size number.
    alias_patterns: tuple[str, ...]
    #: size number -> (hosts, chips per host, topology)
    sizes: Mapping[int, tuple[int, int, str]]
    #: keras-kinetic's name of the generation, which it numbers by chips (``v5p-8`` is 8 chips there).
    kinetic_name: str
    #: keras-kinetic 0.0.4's slices (``kinetic/core/accelerators.py``): chips -> (hosts, topology).
    kinetic_sizes: Mapping[int, tuple[int, str]]
    #: Shapes besides the sizes, by their own name: name -> (hosts, chips per host, topology).
    shapes: Mapping[str, tuple[int, int, str]] = field(default_factory=dict)


# The number in a TPU name is the one Cloud TPU uses: chips for v5e and v6e,
# TensorCores (two per chip) for v4 and v5p. Host counts are those of the real slices.
_TPU_FAMILIES = (
    _TpuFamily(
        prefix="tpu-v4",
        gke_accelerator="tpu-v4-podslice",
        machine_type="ct4p-hightpu-{chips}t",
        alias_patterns=("v4-{n}",),
        sizes={8: (1, 4, "2x2x1"), 16: (2, 4, "2x2x2"), 32: (4, 4, "2x2x4"), 64: (8, 4, "2x4x4")},
        kinetic_name="v4",
        kinetic_sizes={4: (1, "2x2x1"), 8: (2, "2x2x2"), 16: (4, "2x2x4"), 32: (8, "2x4x4")},
    ),
    _TpuFamily(
        prefix="tpu-v5e",
        gke_accelerator="tpu-v5-lite-podslice",
        machine_type="ct5lp-hightpu-{chips}t",
        alias_patterns=("v5e-{n}", "v5litepod-{n}", "tpu-v5litepod-{n}"),
        sizes={1: (1, 1, "1x1"), 4: (1, 4, "2x2"), 8: (1, 8, "2x4"), 16: (4, 4, "4x4"), 32: (8, 4, "4x8"),
               64: (16, 4, "8x8")},
        kinetic_name="v5litepod",
        kinetic_sizes={1: (1, "1x1"), 4: (1, "2x2"), 8: (1, "2x4"), 16: (4, "4x4"), 32: (8, "4x8"),
                       64: (16, "8x8")},
    ),
    _TpuFamily(
        prefix="tpu-v5p",
        gke_accelerator="tpu-v5p-slice",
        machine_type="ct5p-hightpu-{chips}t",
        alias_patterns=("v5p-{n}",),
        sizes={8: (1, 4, "2x2x1"), 16: (2, 4, "2x2x2"), 32: (4, 4, "2x2x4")},
        kinetic_name="v5p",
        kinetic_sizes={8: (2, "2x2x2"), 16: (4, "2x2x4")},
    ),
    _TpuFamily(
        prefix="tpu-v6e",
        gke_accelerator="tpu-v6e-slice",
        machine_type="ct6e-standard-{chips}t",
        alias_patterns=("v6e-{n}",),
        # Cloud TPU's v6e-8 is one VM of 8 chips; two hosts of 4 in a 2x4 exist through GKE alone, and are
        # what keras-kinetic provisions for its v6e-8: named apart, by their topology.
        sizes={1: (1, 1, "1x1"), 4: (1, 4, "2x2"), 8: (1, 8, "2x4"), 16: (4, 4, "4x4"), 32: (8, 4, "4x8")},
        kinetic_name="v6e",
        kinetic_sizes={8: (2, "2x4"), 16: (4, "4x4")},
        shapes={"tpu-v6e-2x4": (2, 4, "2x4")},
    ),
)

#: GPU model in the name -> (GKE accelerator value, GPUs per host offered: the machine shapes GKE schedules).
#: Every GPU shape is one host; keras-kinetic names the models alike.
_GPU_MODELS = {
    "l4": ("nvidia-l4", (1, 2, 4, 8)),
    "a100": ("nvidia-tesla-a100", (1, 2, 4, 8, 16)),  # 16: a2-megagpu-16g
    "a100-80gb": ("nvidia-a100-80gb", (1, 2, 4, 8)),
    "h100": ("nvidia-h100-80gb", (1, 2, 4, 8)),
    "h100-mega": ("nvidia-h100-mega-80gb", (8,)),  # a3-megagpu-8g
}

#: The models keras-kinetic knows, by the same names: their spellings are aliases here too.
_KINETIC_GPU_MODELS = frozenset({"l4", "a100", "a100-80gb", "h100"})

_CPU = Accelerator(name="cpu", kind="cpu", hosts=1, devices_per_host=1, topology=None, gke_accelerator=None)


def _build_registry() -> tuple[Mapping[str, Accelerator], Mapping[str, str], Mapping[str, str]]:
    """Canonical name -> Accelerator (in listing order); alias -> canonical name (Cloud TPU's spellings and
    keras-kinetic's); and spellings that mean one slice in Cloud TPU's naming and another in keras-kinetic's
    -> the one line that refuses them."""
    accelerators = [_CPU]
    cloud: dict[str, str] = {}
    kinetic: dict[str, str] = {}
    for family in _TPU_FAMILIES:
        shapes = [(f"{family.prefix}-{size}", shape) for size, shape in sorted(family.sizes.items())]
        for name, (hosts, chips, topology) in [*shapes, *family.shapes.items()]:
            accelerators.append(Accelerator(name, "tpu", hosts, chips, topology, family.gke_accelerator,
                                            family.machine_type.format(chips=chips)))
            if family.kinetic_sizes.get(hosts * chips) == (hosts, topology):
                kinetic[f"{family.kinetic_name}-{hosts * chips}"] = name
        for size in family.sizes:
            cloud.update({pattern.format(n=size): f"{family.prefix}-{size}" for pattern in family.alias_patterns})
    for model, (gke_value, counts) in _GPU_MODELS.items():
        for count in counts:
            name = f"gpu-{model}x{count}"
            accelerators.append(Accelerator(name, "gpu", 1, count, None, gke_value))
            if model in _KINETIC_GPU_MODELS:
                kinetic[f"{model}x{count}"] = name
                if count == 1:
                    kinetic.update({model: name, f"gpu-{model}": name})
    registry = {acc.name: acc for acc in accelerators}
    aliases = dict(cloud)
    ambiguous: dict[str, str] = {}
    for spelling, name in list(kinetic.items()):
        if spelling.startswith("v5litepod-"):  # keras-kinetic's alias v5e, as it reads it
            kinetic.setdefault(f"v5e-{spelling.removeprefix('v5litepod-')}", name)
    for spelling, name in kinetic.items():
        kind = "gpu" if name.startswith("gpu-") else "tpu"
        if not spelling.startswith(f"{kind}-"):
            aliases[f"{kind}:{spelling}"] = name  # keras-kinetic's own form: its meaning, always
        ours = cloud.get(spelling, spelling if spelling in registry else None)
        if ours is None:
            aliases.setdefault(spelling, name)
        elif ours != name:
            ambiguous[spelling] = (
                f"accelerator {spelling!r} is two slices: {_shape(registry[ours])} in Cloud TPU's naming, which "
                f"kinetic_nb uses ({ours}), and {_shape(registry[name])} in keras-kinetic's ({name} here, or "
                f"tpu:{spelling}); say {ours} or {name}")
    for spelling in ambiguous:
        aliases.pop(spelling, None)
    return MappingProxyType(registry), MappingProxyType(aliases), MappingProxyType(ambiguous)


def _shape(acc: Accelerator) -> str:
    hosts = f"{acc.hosts} host" + ("s" if acc.hosts != 1 else "")
    return f"{hosts} x {acc.devices_per_host} chip" + ("s" if acc.devices_per_host != 1 else "")


def kinetic_spellings(name: str) -> list[str]:
    """How keras-kinetic names the slice ``name`` (its ``tpu:``/``gpu:`` forms), for a listing beside ours."""
    return [alias for alias, canonical in _ALIASES.items() if canonical == name and ":" in alias]


_REGISTRY, _ALIASES, _AMBIGUOUS = _build_registry()


def accelerator_names() -> list[str]:
    """The canonical accelerator names: cpu, then TPUs by generation and size, then GPUs.

    Returns
    -------
    list of str
        A new list; aliases such as ``v5litepod-16`` are not included.
    """
    return list(_REGISTRY)


def resolve_accelerator(name: str) -> Accelerator:
    """The accelerator a name or alias stands for.

    Parameters
    ----------
    name : str
        A canonical name (``tpu-v5e-16``) or an alias (``v5litepod-16``,
        ``v5e-16``); case and surrounding whitespace are ignored.

    Returns
    -------
    Accelerator

    Raises
    ------
    UnknownAcceleratorError
        One line naming the value, with close matches when there are any.
    """
    key = str(name).strip().lower()
    if key in _AMBIGUOUS:
        raise UnknownAcceleratorError(_AMBIGUOUS[key])
    canonical = _ALIASES.get(key, key)
    if canonical in _REGISTRY:
        return _REGISTRY[canonical]
    raise UnknownAcceleratorError(_unknown_name_message(name, key))


def _unknown_name_message(name: object, key: str) -> str:
    suggestions = _close_matches(key)
    if suggestions:
        return f"unknown accelerator {name!r}; did you mean: {', '.join(suggestions)}?"
    return f"unknown accelerator {name!r}; kinetic_nb.accelerators.accelerator_names() lists the known names"


def _close_matches(key: str) -> list[str]:
    """Canonical names whose name or alias is close to ``key``: best first, ties in listing order."""
    best_score: dict[str, float] = {}
    for known in [*_REGISTRY, *_ALIASES]:
        score = difflib.SequenceMatcher(None, key, known).ratio()
        if score >= _SUGGESTION_CUTOFF:
            canonical = _ALIASES.get(known, known)
            best_score[canonical] = max(score, best_score.get(canonical, 0.0))
    listing_order = {name: position for position, name in enumerate(_REGISTRY)}
    ranked = sorted(best_score, key=lambda canonical: (-best_score[canonical], listing_order[canonical]))
    return ranked[:_MAX_SUGGESTIONS]


def accelerator_table() -> str:
    """Every accelerator as a plain-text table: its name, hosts x chips (or GPUs), topology, each host's machine
    type, and keras-kinetic's spellings of the same slice (accepted too)."""
    header = ("name", "hosts x chips", "topology", "machine type", "keras-kinetic")
    rows = [header]
    for acc in _REGISTRY.values():
        rows.append((acc.name, f"{acc.hosts} x {acc.devices_per_host}", acc.topology or "-", acc.machine_type or "-",
                     ", ".join(kinetic_spellings(acc.name)) or "-"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1]
             for row in rows]
    lines.append("TPU sizes are Cloud TPU's (v4 and v5p count TensorCores, two per chip); keras-kinetic counts "
                 "chips, so a bare name that means two slices (v5p-8) is refused: say tpu-v5p-8, or tpu:v5p-8 "
                 "for keras-kinetic's.")
    return "\n".join(line.rstrip() for line in lines)


def local_notice(acc: Accelerator, procs_per_host: int = 1, hosts: int | None = None) -> str:
    """One line saying how the local backend runs ``acc``.

    Parameters
    ----------
    acc : Accelerator
    procs_per_host : int
        Processes on each host (torch on GPU hosts: one per GPU).
    hosts : int, optional
        How many hosts (default: the accelerator's).

    Returns
    -------
    str
        e.g. ``"tpu-v5e-16 is simulated locally: 4 host processes x 4 CPU devices each."``, or with several
        processes per host ``"gpu-h100x8 is simulated locally: 2 hosts x 8 processes (16 in all) x 1 CPU device
        each."``
    """
    hosts = acc.hosts if hosts is None else hosts
    how = "is simulated locally" if acc.simulated_locally else "runs locally"
    per_process = max(1, acc.devices_per_host // procs_per_host)
    devices = f"{per_process} CPU device" + ("s" if per_process != 1 else "")
    if procs_per_host > 1:
        return (f"{acc.name} {how}: {hosts} host{'s' if hosts != 1 else ''} x {procs_per_host} processes "
                f"({hosts * procs_per_host} in all) x {devices} each.")
    processes = f"{hosts} host process" + ("es" if hosts != 1 else "")
    each = " each" if hosts > 1 else ""
    return f"{acc.name} {how}: {processes} x {devices}{each}."
