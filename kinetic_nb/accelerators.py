"""Accelerator names (``tpu-v5e-16``, ``gpu-h100x8``) and the slices they stand for.

A name resolves to an :class:`Accelerator`: how many hosts the slice has, how
many chips or GPUs each host holds, the TPU topology and the GKE node-selector
value. The local backend simulates every TPU and GPU slice with one process per
host and CPU devices in place of chips, so the same cell sees the same
``process_count`` and ``device_count`` here as on the real slice.

A TPU slice's shape is computed from its generation's rules (how its number
counts, chips per host, its topology), whatever its size; the registry lists a
few sizes of each, built once, at import. :func:`cloud_tpu_accelerator` reads a
Cloud TPU node's own naming (``acceleratorType``, ``acceleratorConfig``).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kinetic_nb.errors import UnknownAcceleratorError

__all__ = ["Accelerator", "accelerator_names", "accelerator_table", "cloud_tpu_accelerator", "kinetic_spellings",
           "local_notice", "resolve_accelerator"]

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
    """One TPU generation: its names, the rules its slices follow, and how keras-kinetic names them."""

    prefix: str
    #: Cloud TPU's name of the generation (``v5litepod-16``), and its ``acceleratorConfig`` type (``V5LITE_POD``).
    cloud_name: str
    config_type: str
    #: The number in a name counts TensorCores (2 a chip: v2, v3, v4, v5p) or chips (1: v5e, v6e).
    cores_per_chip: int
    #: 2 (a ``4x8`` grid) or 3 (a ``4x4x8`` torus).
    dimensions: int
    #: Chips a slice of one host may hold; above them a slice is hosts of :data:`_CHIPS_PER_POD_HOST`.
    single_host_chips: tuple[int, ...]
    #: The chips of a whole pod: the largest slice there is.
    pod_chips: int
    #: The sizes listed by :func:`accelerator_names` (any size that follows the rules resolves).
    listed_sizes: tuple[int, ...]
    #: GKE's value and each host's machine type (``{chips}`` standing for its chips); None where GKE has none.
    gke_accelerator: str | None
    machine_type: str | None
    #: Cloud TPU's other spellings of a size, ``{n}`` standing for the size number.
    alias_patterns: tuple[str, ...]
    #: keras-kinetic's name of the generation, which it numbers by chips (``v5p-8`` is 8 chips there).
    kinetic_name: str = ""
    #: keras-kinetic 0.0.4's slices (``kinetic/core/accelerators.py``): chips -> (hosts, topology).
    kinetic_sizes: Mapping[int, tuple[int, str]] = field(default_factory=dict)
    #: Shapes besides the rules', by their own name: name -> (hosts, chips per host, topology).
    shapes: Mapping[str, tuple[int, int, str]] = field(default_factory=dict)


#: The chips of each host of a multi-host slice, in every generation: a v2/v3 host holds 4 chips (8 cores), a v4
#: or v5p host 4 chips, and a v5e or v6e host of a multi-host slice 4 chips (ct5lp-hightpu-4t, ct6e-standard-4t).
_CHIPS_PER_POD_HOST = 4
#: A v4 or v5p slice of a pod is built of whole 4x4x4 cubes; the smaller ones are 2x2x1, 2x2x2, 2x2x4, 2x4x4.
_CUBE_SIDE = 4
_CUBE_CHIPS = _CUBE_SIDE ** 3
_SUB_CUBE_CHIPS = (4, 8, 16, 32)

# The number in a TPU name is the one Cloud TPU uses: chips for v5e and v6e, TensorCores (two per chip) for v2,
# v3, v4 and v5p. Every shape is computed from these rules (see _tpu_slice); the listed sizes only say which ones
# `accelerator_names()` shows. v5e and v6e: Cloud TPU's single-host types (-1, -4, -8) are one VM holding all of
# their chips (ct5lp-hightpu-8t and ct6e-standard-8t hold 8); from 16 chips on a slice is VMs of 4 chips each,
# as Cloud TPU's v5e and v6e pages list them (v5litepod-16: 4 VMs, v6e-256: 64 VMs).
_TPU_FAMILIES = (
    _TpuFamily(
        prefix="tpu-v2", cloud_name="v2", config_type="V2", cores_per_chip=2, dimensions=2,
        single_host_chips=(4,), pod_chips=256, listed_sizes=(), gke_accelerator=None, machine_type=None,
        alias_patterns=("v2-{n}",),
    ),
    _TpuFamily(
        prefix="tpu-v3", cloud_name="v3", config_type="V3", cores_per_chip=2, dimensions=2,
        single_host_chips=(4,), pod_chips=1024, listed_sizes=(), gke_accelerator=None, machine_type=None,
        alias_patterns=("v3-{n}",),
    ),
    _TpuFamily(
        prefix="tpu-v4", cloud_name="v4", config_type="V4", cores_per_chip=2, dimensions=3,
        single_host_chips=(4,), pod_chips=4096, listed_sizes=(8, 16, 32, 64),
        gke_accelerator="tpu-v4-podslice", machine_type="ct4p-hightpu-{chips}t",
        alias_patterns=("v4-{n}",),
        kinetic_name="v4",
        kinetic_sizes={4: (1, "2x2x1"), 8: (2, "2x2x2"), 16: (4, "2x2x4"), 32: (8, "2x4x4")},
    ),
    _TpuFamily(
        prefix="tpu-v5e", cloud_name="v5litepod", config_type="V5LITE_POD", cores_per_chip=1, dimensions=2,
        single_host_chips=(1, 4, 8), pod_chips=256, listed_sizes=(1, 4, 8, 16, 32, 64),
        gke_accelerator="tpu-v5-lite-podslice", machine_type="ct5lp-hightpu-{chips}t",
        alias_patterns=("v5e-{n}", "v5litepod-{n}", "tpu-v5litepod-{n}"),
        kinetic_name="v5litepod",
        kinetic_sizes={1: (1, "1x1"), 4: (1, "2x2"), 8: (1, "2x4"), 16: (4, "4x4"), 32: (8, "4x8"),
                       64: (16, "8x8")},
    ),
    _TpuFamily(
        prefix="tpu-v5p", cloud_name="v5p", config_type="V5P", cores_per_chip=2, dimensions=3,
        single_host_chips=(4,), pod_chips=8960, listed_sizes=(8, 16, 32),
        gke_accelerator="tpu-v5p-slice", machine_type="ct5p-hightpu-{chips}t",
        alias_patterns=("v5p-{n}",),
        kinetic_name="v5p",
        kinetic_sizes={8: (2, "2x2x2"), 16: (4, "2x2x4")},
    ),
    _TpuFamily(
        prefix="tpu-v6e", cloud_name="v6e", config_type="V6E", cores_per_chip=1, dimensions=2,
        single_host_chips=(1, 4, 8), pod_chips=256, listed_sizes=(1, 4, 8, 16, 32),
        gke_accelerator="tpu-v6e-slice", machine_type="ct6e-standard-{chips}t",
        alias_patterns=("v6e-{n}",),
        # Cloud TPU's v6e-8 is one VM of 8 chips; two hosts of 4 in a 2x4 exist through GKE alone, and are
        # what keras-kinetic provisions for its v6e-8: named apart, by their topology.
        kinetic_name="v6e",
        kinetic_sizes={8: (2, "2x4"), 16: (4, "4x4")},
        shapes={"tpu-v6e-2x4": (2, 4, "2x4")},
    ),
)
_FAMILY_BY_CONFIG_TYPE = {family.config_type: family for family in _TPU_FAMILIES}


def _is_power_of_two(number: int) -> bool:
    return number > 0 and number & (number - 1) == 0


def _valid_chips(family: _TpuFamily, chips: int) -> bool:
    """Whether a slice of ``family`` can hold ``chips``: a single-host count, else (2-D) a power of two from 16
    chips, or (3-D) a sub-cube or whole 4x4x4 cubes; never more than a pod."""
    if chips in family.single_host_chips:
        return True
    if not 0 < chips <= family.pod_chips:
        return False
    if family.dimensions == 2:
        return _is_power_of_two(chips) and chips >= 4 * _CHIPS_PER_POD_HOST
    return chips in _SUB_CUBE_CHIPS or chips % _CUBE_CHIPS == 0


def _rule(family: _TpuFamily) -> str:
    """The sizes ``family`` has, in words, for an error's one line."""
    if family.cores_per_chip == 1:
        counts = f"{family.cloud_name} counts chips (one host of 1, 4 or 8; 4 a host above)"
        sizes = f"1, 4, 8 or a power of two from 16 to {family.pod_chips}"
    elif family.dimensions == 2:
        counts = f"{family.cloud_name} counts TensorCores (2 a chip, 4 chips a host)"
        sizes = f"8 or a power of two from 32 to {family.pod_chips * 2}"
    else:
        counts = f"{family.cloud_name} counts TensorCores (2 a chip, 4 chips a host)"
        sizes = f"8, 16, 32, 64 or a multiple of {_CUBE_CHIPS * 2} up to {family.pod_chips * 2}"
    return f"{counts}: {sizes}"


def _default_topology(family: _TpuFamily, chips: int) -> tuple[int, ...]:
    """The topology Cloud TPU gives a slice of ``chips`` made by its type alone (``v5p-128`` is 4x4x4).

    2-D: the squarest grid of a power of two (``4x8``). 3-D: the most cube-like torus whose sides are whole cubes
    (multiples of 4; powers of two up to 4 below a cube): the shortest longest side, then the longest shortest
    one, which gives Cloud TPU's own (v4-4096: 8x16x16, v5p-640: 4x4x20, v5p-12288: 16x16x24).
    """
    if family.dimensions == 2:
        short = 1 << ((chips.bit_length() - 1) // 2)
        return short, chips // short
    sides = (1, 2, 4) if chips < _CUBE_CHIPS else range(_CUBE_SIDE, chips + 1, _CUBE_SIDE)
    shapes = [(a, b, chips // (a * b)) for a in sides for b in sides
              if a <= b and chips % (a * b) == 0 and chips // (a * b) >= b and chips // (a * b) in sides]
    a, b, c = min(shapes, key=lambda shape: (shape[2], -shape[0]))
    return (b, c, a) if a == 1 else (a, b, c)  # Cloud TPU writes a flat side last: 2x2x1


def _topology_text(sides: tuple[int, ...]) -> str:
    return "x".join(str(side) for side in sides)


def _tpu_slice(family: _TpuFamily, chips: int, topology: tuple[int, ...] | None = None) -> Accelerator:
    """The slice of ``family`` with ``chips`` (valid by :func:`_valid_chips`), its topology the rules' unless the
    node says another of the same chips (a v4 or v5p slice made with ``--topology``: named by it)."""
    default = _default_topology(family, chips)
    topology = topology or default
    size = chips * family.cores_per_chip
    name = f"{family.prefix}-{size}"
    if family.dimensions == 3 and topology != default:
        name = f"{family.prefix}-{_topology_text(topology)}"
    if chips in family.single_host_chips:
        hosts, per_host = 1, chips
    else:
        hosts, per_host = chips // _CHIPS_PER_POD_HOST, _CHIPS_PER_POD_HOST
    machine_type = family.machine_type.format(chips=per_host) if family.machine_type else None
    return Accelerator(name, "tpu", hosts, per_host, _topology_text(topology), family.gke_accelerator, machine_type)


def _parse_topology(family: _TpuFamily, text: str) -> tuple[int, ...] | None:
    """``4x4x8`` as its sides, when ``family`` can have it: its dimensions, chips a valid count, and (3-D) whole
    cubes, or a sub-cube's sides in any order; a 2-D grid is its chips' squarest in any order."""
    if not re.fullmatch(r"\d+(x\d+)+", text):
        return None
    sides = tuple(int(side) for side in text.split("x"))
    chips = math.prod(sides)
    if len(sides) != family.dimensions or not _valid_chips(family, chips):
        return None
    if family.dimensions == 3 and chips >= _CUBE_CHIPS:
        return sides if all(side % _CUBE_SIDE == 0 for side in sides) else None
    return sides if sorted(sides) == sorted(_default_topology(family, chips)) else None


def _size_spellings(family: _TpuFamily) -> list[str]:
    """Every pattern of a size in ``family``'s names: ours (``tpu-v5e-{n}``), then Cloud TPU's."""
    return [f"{family.prefix}-{{n}}", f"{family.cloud_name}-{{n}}", *family.alias_patterns]


def _read_size_name(key: str, families: tuple[_TpuFamily, ...] = _TPU_FAMILIES) -> tuple[_TpuFamily, str] | None:
    """The family and the part after it (``256``, or a topology ``4x4x8``) of a TPU name; None if it is none."""
    for family in families:
        for pattern in _size_spellings(family):
            head = pattern.removesuffix("{n}")
            if key.startswith(head) and re.fullmatch(r"\d+(x\d+)*", key[len(head):]):
                return family, key[len(head):]
    return None


def _slice_by_name(key: str) -> Accelerator | None:
    """A TPU name that follows its generation's rules (``tpu-v5e-256``, ``v4-4096``, ``tpu-v5p-4x4x8``), computed;
    None for any other."""
    found = _read_size_name(key)
    if found is None:
        return None
    family, size = found
    if "x" in size:
        sides = _parse_topology(family, size) if family.dimensions == 3 else None
        return _tpu_slice(family, math.prod(sides), sides) if sides else None
    if int(size) % family.cores_per_chip or not _valid_chips(family, int(size) // family.cores_per_chip):
        return None
    return _tpu_slice(family, int(size) // family.cores_per_chip)


def cloud_tpu_accelerator(accelerator_type: str | None = None, *, config_type: str | None = None,
                          topology: str | None = None) -> Accelerator:
    """The slice a Cloud TPU node is, in Cloud TPU's own naming: its ``acceleratorType`` (``v4-32``,
    ``v5litepod-256``), or its ``acceleratorConfig`` (``type`` ``V5P``, ``topology`` ``4x4x8``), or both.

    Its shape follows the generation's rules, whatever the size: keras-kinetic's spellings play no part here (a
    node's ``v4-32`` is 32 TensorCores, 4 hosts of 4 chips).

    Parameters
    ----------
    accelerator_type : str, optional
        The node's ``acceleratorType``.
    config_type, topology : str, optional
        The node's ``acceleratorConfig``: its ``type`` (``V2``, ``V3``, ``V4``, ``V5LITE_POD``, ``V5P``,
        ``V6E``) and its ``topology``, which wins over the type's default (``v5p-256`` as ``4x8x4``).

    Returns
    -------
    Accelerator

    Raises
    ------
    UnknownAcceleratorError
        One line naming the type, the config or the topology that is not a slice, and the generation's sizes.
    """
    if accelerator_type:
        found = _read_size_name(str(accelerator_type).strip().lower())
        if found is None or "x" in found[1]:
            raise UnknownAcceleratorError(
                f"Cloud TPU accelerator type {accelerator_type!r} is not one kinetic_nb knows: it knows "
                f"{', '.join(family.cloud_name for family in _TPU_FAMILIES)} (e.g. v4-32, v5litepod-16)")
        family, size = found[0], int(found[1])
        if size % family.cores_per_chip or not _valid_chips(family, size // family.cores_per_chip):
            raise UnknownAcceleratorError(
                f"Cloud TPU accelerator type {accelerator_type!r} is not a slice: {_rule(family)}")
        chips = size // family.cores_per_chip
    elif config_type:
        family = _FAMILY_BY_CONFIG_TYPE.get(str(config_type).strip().upper())
        if family is None:
            raise UnknownAcceleratorError(
                f"Cloud TPU accelerator config type {config_type!r} is not one kinetic_nb knows: it knows "
                f"{', '.join(_FAMILY_BY_CONFIG_TYPE)}")
        chips = None
    else:
        raise UnknownAcceleratorError("the Cloud TPU node names no accelerator: neither an acceleratorType nor an "
                                      "acceleratorConfig")
    if not topology:
        if chips is None:
            raise UnknownAcceleratorError(f"Cloud TPU accelerator config {config_type!r} has no topology")
        return _tpu_slice(family, chips)
    sides = _parse_topology(family, str(topology).strip().lower())
    if sides is None or (chips is not None and math.prod(sides) != chips):
        what = f"type {accelerator_type!r}" if accelerator_type else f"config {config_type!r}"
        raise UnknownAcceleratorError(
            f"Cloud TPU topology {topology!r} is not a slice of accelerator {what}: {_rule(family)}, "
            f"{family.dimensions} sides" + (", whole 4x4x4 cubes from 64 chips" if family.dimensions == 3 else ""))
    return _tpu_slice(family, math.prod(sides), sides)



def first_workers(accelerator: Accelerator, hosts: int) -> Accelerator:
    """The slice of ``accelerator``'s generation made of its first ``hosts`` hosts (of a multi-host TPU slice):
    what a test's few loopback machines stand in for (``KINETIC_TPU_TEST_WORKERS``, see ``-b tpu-vm``).

    Raises
    ------
    ValueError
        One line, for an accelerator that is no multi-host TPU slice or a count that makes no slice of it.
    """
    family = next((each for each in _TPU_FAMILIES if accelerator.name.startswith(each.prefix + "-")), None)
    if family is None or accelerator.hosts < 2:
        raise ValueError(f"{accelerator.name} is not a TPU slice of several hosts: it has no first workers to take")
    chips = hosts * accelerator.devices_per_host
    if not 1 <= hosts <= accelerator.hosts or not _valid_chips(family, chips):
        raise ValueError(f"the first {hosts} hosts of {accelerator.name} make no {family.cloud_name} slice: "
                         f"{_rule(family)}")
    first = _tpu_slice(family, chips)
    if first.hosts != hosts:  # a v5e's 8 chips are one host's, not two
        raise ValueError(f"the first {hosts} hosts of {accelerator.name} make no {family.cloud_name} slice of "
                         f"{hosts} hosts: {_rule(family)}")
    return accelerator if hosts == accelerator.hosts else first

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
        listed = [_tpu_slice(family, size // family.cores_per_chip) for size in family.listed_sizes]
        others = [Accelerator(name, "tpu", hosts, chips, topology, family.gke_accelerator,
                              family.machine_type.format(chips=chips) if family.machine_type else None)
                  for name, (hosts, chips, topology) in family.shapes.items()]
        for acc in [*listed, *others]:
            accelerators.append(acc)
            if family.kinetic_sizes.get(acc.devices) == (acc.hosts, acc.topology):
                kinetic[f"{family.kinetic_name}-{acc.devices}"] = acc.name
        for size in family.listed_sizes:
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
        ``v5e-16``); case and surrounding whitespace are ignored. Any TPU
        size that follows its generation's rules resolves, listed or not
        (``tpu-v5e-256``, ``tpu-v4-4096``, ``v5p-12288``, ``tpu-v2-32``), and
        a v4 or v5p slice by its topology too (``tpu-v5p-4x4x8``).

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
    computed = _computed_slice(key)
    if computed is not None:
        return computed
    raise UnknownAcceleratorError(_unknown_name_message(name, key))


#: The slices beyond the listed ones that were asked for, by canonical name: one object per slice, as the
#: listed are (a few per notebook; every name follows the rules, so their number is bounded).
_COMPUTED: dict[str, Accelerator] = {}


def _computed_slice(key: str) -> Accelerator | None:
    """A TPU slice beyond the listed ones, by its generation's rules (``tpu-v5e-256``, ``v4-4096``)."""
    acc = _slice_by_name(key)
    return None if acc is None else _COMPUTED.setdefault(acc.name, acc)


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
                 "for keras-kinetic's. Any size that follows its generation's rules works too (tpu-v5e-256, "
                 "tpu-v4-4096, tpu-v5p-12288, tpu-v2-32).")
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
