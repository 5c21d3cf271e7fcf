"""A strict structural checker for custom resources against a CRD's openAPIV3Schema, per release.

It does what the API server does with a structural schema before it stores a
custom resource, for the keywords the vendored LeaderWorkerSet CRD subset uses:
``type`` (object, string, integer, boolean, array), ``properties``,
``required``, ``enum``, ``format: int32``, ``minimum``, ``items``,
``x-kubernetes-int-or-string`` and ``x-kubernetes-preserve-unknown-fields``.
An unknown field is an error here (the API server would silently prune it, or
reject it under strict field validation, which the backend asks for).

A property marked ``x-kinetic-core-type: PodTemplateSpec`` (the
LeaderWorkerSet's two pod templates, which the real CRD inlines in full) is
validated against the Kubernetes API's own core/v1 schema with
``kubernetes-validate`` (strict), for every Kubernetes version the tests
cover.

:data:`LWS_RELEASES` holds what each supported LeaderWorkerSet release
accepts where releases differ, written from the API types
(``api/leaderworkerset/v1/leaderworkerset_types.go`` of kubernetes-sigs/lws)
and its pull requests; :func:`load_crd` applies a release's differences to
the vendored schema (the newest release's).
"""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Iterable
from typing import Any

import kubernetes_validate
import yaml

DATA = pathlib.Path(__file__).parent / "data"
_INT32 = (-(2**31), 2**31 - 1)
#: Kubernetes versions whose core/v1 schemas validate the pod templates (set by the tests).
CORE_VERSIONS: tuple[str, ...] = ("1.30",)

#: ``spec.leaderWorkerTemplate.restartPolicy`` by release. ``None`` came in v0.5
#: (kubernetes-sigs/lws#214, which deprecated ``Default``: same behaviour, old
#: name kept); ``RecreateGroupAfterStart`` in v0.9 (#757; v0.8 had the behaviour
#: only behind an annotation, #725, and its enum rejects the value). kinetic_nb
#: sets ``None``, so v0.5 is the oldest release it supports.
_RESTART_POLICIES_V05 = ["Default", "RecreateGroupOnPodRestart", "None"]
LWS_RELEASES: dict[str, dict[str, Any]] = {
    "v0.5": {"restartPolicy": _RESTART_POLICIES_V05},
    "v0.6": {"restartPolicy": _RESTART_POLICIES_V05},
    "v0.7": {"restartPolicy": _RESTART_POLICIES_V05},
    "v0.8": {"restartPolicy": _RESTART_POLICIES_V05},
    "v0.9": {"restartPolicy": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]},
}
NEWEST_RELEASE = "v0.9"


def load_crd(release: str = NEWEST_RELEASE, name: str = "leaderworkerset_crd_v1.yaml") -> dict[str, Any]:
    """The LeaderWorkerSet CRD as ``release`` serves it (see :data:`LWS_RELEASES`)."""
    crd = yaml.safe_load((DATA / name).read_text())
    differences = LWS_RELEASES[release]
    for version in crd["spec"]["versions"]:
        template = (version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
                    ["leaderWorkerTemplate"]["properties"])
        template["restartPolicy"]["enum"] = list(differences["restartPolicy"])
    return copy.deepcopy(crd)


def check_custom_resource(resource: dict[str, Any], crd: dict[str, Any],
                          core_versions: Iterable[str] | None = None) -> list[str]:
    """Every way ``resource`` departs from ``crd``; empty when it conforms."""
    spec = crd["spec"]
    errors = []
    versions = {version["name"]: version for version in spec["versions"] if version.get("served")}
    group, _, version = resource.get("apiVersion", "").partition("/")
    if group != spec["group"] or version not in versions:
        errors.append(f"apiVersion: {resource.get('apiVersion')!r} is not served by {crd['metadata']['name']}")
        return errors
    if resource.get("kind") != spec["names"]["kind"]:
        errors.append(f"kind: {resource.get('kind')!r}, the CRD defines {spec['names']['kind']!r}")
    errors += check(resource, versions[version]["schema"]["openAPIV3Schema"], "",
                    tuple(core_versions or CORE_VERSIONS))
    return errors


def _check_core(value: Any, core_type: str, path: str, core_versions: tuple[str, ...]) -> list[str]:
    """``value`` validated as the core/v1 ``core_type`` by the Kubernetes API's own schemas."""
    if core_type != "PodTemplateSpec":  # pragma: no cover - the only one the CRD subset uses
        raise ValueError(f"no core/v1 validation for {core_type}")
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": value}
    errors = []
    for version in core_versions:
        try:
            kubernetes_validate.validate(wrapped, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = ".".join(str(part) for part in list(error.path)[1:])  # past "template"
            errors.append(f"{path}{'.' + where if where else ''}: {error.message} (core/v1 {core_type}, "
                          f"Kubernetes {version})")
    return errors


def check(value: Any, schema: dict[str, Any], path: str, core_versions: tuple[str, ...] = CORE_VERSIONS
          ) -> list[str]:
    where = path or "(root)"
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return [f"{where}: {value!r} is neither an integer nor a string"]
        return []
    if "x-kinetic-core-type" in schema:
        return _check_core(value, schema["x-kinetic-core-type"], path, core_versions)
    kind = schema.get("type")
    errors: list[str] = []
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        errors += [f"{path}.{name}: required" for name in schema.get("required", []) if name not in value]
        properties = schema.get("properties")
        for name, item in value.items():
            if properties is not None and name in properties:
                errors += check(item, properties[name], f"{path}.{name}", core_versions)
            elif not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{path}.{name}: unknown field")
    elif kind == "string":
        if not isinstance(value, str):
            errors.append(f"{where}: expected a string, got {value!r}")
    elif kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{where}: expected an integer, got {value!r}")
        else:
            if schema.get("format") == "int32" and not _INT32[0] <= value <= _INT32[1]:
                errors.append(f"{where}: {value} does not fit in int32")
            if "minimum" in schema and value < schema["minimum"]:
                errors.append(f"{where}: {value} is below the minimum {schema['minimum']}")
    elif kind == "boolean":
        if not isinstance(value, bool):
            errors.append(f"{where}: expected a boolean, got {value!r}")
    elif kind == "array":
        if not isinstance(value, list):
            errors.append(f"{where}: expected an array, got {value!r}")
        else:
            for position, item in enumerate(value):
                errors += check(item, schema.get("items", {}), f"{path}[{position}]", core_versions)
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    return errors
