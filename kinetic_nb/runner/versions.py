"""The versions a shipped cell depends on, recorded by the notebook and compared on every host.

Functions and classes defined in the notebook travel by value (cloudpickle),
as bytecode: a host with another Python minor version cannot run them, and
cloudpickle guarantees its pickles only between the same versions. So the
plan records the notebook's Python, cloudpickle and framework versions
(:func:`installed_versions`), and each host refuses, in its plan check and in
one line naming both sides, a plan whose Python or cloudpickle minor version
differs from its own (:func:`refusal`). A different framework version is only
noted in the host's log: values rarely depend on it, and the cell may pin it.

Host-safe: the standard library and cloudpickle only; a framework's version is
read from the name of its installed metadata directory, never by importing it
(nor ``importlib.metadata``, whose imports would cost every job's agent about
20 ms before it can start a host).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterable, Mapping

import cloudpickle

__all__ = ["FRAMEWORK_PACKAGES", "framework_notes", "installed_versions", "refusal"]

#: The frameworks whose versions the plan records, when installed.
FRAMEWORK_PACKAGES = ("jax", "jaxlib", "torch")
#: What must match for shipped values to load and run, with why and what to install.
_MUST_MATCH = {
    "python": ("functions and classes shipped from the notebook are bytecode of one Python minor version",
               "use an image with Python {minor}"),
    "cloudpickle": ("cloudpickle loads only what the same cloudpickle version wrote",
                    "install cloudpickle=={version} on the hosts"),
}
_LABELS = {"python": "Python", "cloudpickle": "cloudpickle"}


def installed_versions(packages: Iterable[str] = FRAMEWORK_PACKAGES) -> dict[str, str]:
    """``{"python": "3.11.9", "cloudpickle": "3.1.1", "jax": "0.4.35", ...}``: what is installed here."""
    versions = {"python": platform.python_version(), "cloudpickle": cloudpickle.__version__}
    for package, version in _installed(packages).items():
        if version is not None:
            versions[package] = version
    return versions


def installed_version(package: str) -> str | None:
    """The version of the distribution ``package`` (a plain name: ``jax``, ``torch``) that Python would import,
    or None when none is installed.

    As ``importlib.metadata.version`` finds it: the first ``{name}-{version}.dist-info`` (or ``.egg-info``)
    directory on ``sys.path``, whose name carries the version (the wheel and packaging specifications).
    """
    return _installed([package])[package]


def _installed(packages: Iterable[str]) -> dict[str, str | None]:
    """Each package's version (None: not installed), from one look at each directory on ``sys.path``."""
    found: dict[str, str | None] = dict.fromkeys(packages)
    prefixes = {f"{package.lower()}-": package for package in found}
    for entry in sys.path:
        if all(version is not None for version in found.values()):
            break
        try:
            names = os.listdir(entry or ".")
        except OSError:  # not a directory (a zip), or gone
            continue
        for name in names:
            lowered = name.lower()
            if not lowered.endswith((".dist-info", ".egg-info")):
                continue
            for prefix, package in prefixes.items():
                version = name[len(prefix):].rsplit(".", 1)[0]
                if found[package] is None and lowered.startswith(prefix) and version[:1].isdigit():
                    found[package] = version
    return found


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


def refusal(notebook: Mapping[str, str], host: Mapping[str, str]) -> str | None:
    """One line naming both sides when ``host`` cannot load what ``notebook`` shipped, else None.

    A plan from before versions were recorded (an empty ``notebook``) is never refused.
    """
    for name, (why, remedy) in _MUST_MATCH.items():
        theirs, ours = notebook.get(name), host.get(name)
        if theirs and ours and _minor(theirs) != _minor(ours):
            label = _LABELS[name]
            fix = remedy.format(minor=".".join(_minor(theirs)), version=theirs)
            return f"this host has {label} {ours} and the notebook {label} {theirs}: {why} ({fix})"
    return None


def framework_notes(notebook: Mapping[str, str], host: Mapping[str, str]) -> list[str]:
    """A line for each framework whose version differs between the notebook and this host."""
    return [f"note: this host has {name} {host[name]}, the notebook {name} {notebook[name]}"
            for name in FRAMEWORK_PACKAGES if name in notebook and name in host and notebook[name] != host[name]]
