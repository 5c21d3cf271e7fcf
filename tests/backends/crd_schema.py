"""A small structural checker for custom resources against a CRD's openAPIV3Schema.

It does what the API server does with a structural schema before it stores a
custom resource, for the keywords the vendored LeaderWorkerSet CRD subset uses:
``type`` (object, string, integer, boolean, array), ``properties``,
``required``, ``enum``, ``format: int32``, ``minimum``, ``items``,
``x-kubernetes-int-or-string`` and ``x-kubernetes-preserve-unknown-fields``.
An unknown field is an error here (the API server would silently prune it, or
reject it under strict field validation, which the backend asks for).
"""

from __future__ import annotations

import pathlib
from typing import Any

import yaml

DATA = pathlib.Path(__file__).parent / "data"
_INT32 = (-(2**31), 2**31 - 1)


def load_crd(name: str = "leaderworkerset_crd_v1.yaml") -> dict[str, Any]:
    return yaml.safe_load((DATA / name).read_text())


def check_custom_resource(resource: dict[str, Any], crd: dict[str, Any]) -> list[str]:
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
    errors += check(resource, versions[version]["schema"]["openAPIV3Schema"], "")
    return errors


def check(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    where = path or "(root)"
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return [f"{where}: {value!r} is neither an integer nor a string"]
        return []
    kind = schema.get("type")
    errors: list[str] = []
    if kind == "object":
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        errors += [f"{path}.{name}: required" for name in schema.get("required", []) if name not in value]
        properties = schema.get("properties")
        for name, item in value.items():
            if properties is not None and name in properties:
                errors += check(item, properties[name], f"{path}.{name}")
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
                errors += check(item, schema.get("items", {}), f"{path}[{position}]")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    return errors
