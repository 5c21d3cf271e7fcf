"""What a host installs before its agent runs, when its machine has no kinetic_nb: GKE's prebuilt mode, ssh hosts.

The notebook's own kinetic_nb as a wheel (:func:`package_wheel`: development
installs included), the packages a host needs beside it (:func:`host_packages`)
and the user's ``--requirements``, each stored with the job and signed under
its key, with a record naming them (:func:`store_environment`), which the
standard-library bootstrap (:mod:`kinetic_nb.agent.bootstrap`, whose text
:func:`bootstrap_source` gives) verifies before pip runs. The record is the
same bytes for the same contents (:func:`install_record`): a host that keeps
environments (an ssh host, a restarted pod) finds one by the record's hash.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.metadata
import importlib.resources
import json
import os
import re
import tempfile
import zipfile
from pathlib import Path

from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import write_sealed
from kinetic_nb.storage import Storage
from kinetic_nb.storage.defaults import user_directory

__all__ = ["bootstrap_source", "host_packages", "install_record", "package_version", "package_wheel",
           "store_environment"]

#: The hosts' own packages besides kinetic_nb: what the host-safe core imports
#: (``tests/test_runner_imports.py``), at the versions kinetic_nb requires.
HOST_DISTRIBUTIONS = ("cloudpickle", "cryptography")
#: The extra whose packages a storage scheme needs on the hosts.
STORAGE_EXTRAS = {"gs://": "gcs"}
#: The requirements object stored with a job (read by the pods' pip).
REQUIREMENTS_OBJECT = f"{protocol.ENVIRONMENT_DIR}/requirements.txt"
_NAME = re.compile(r"[A-Za-z0-9._-]*")
_EXTRA_MARKER = re.compile(r"extra\s*==\s*[\"']([^\"']+)[\"']")
#: A fixed time for every file in the wheel, so the same sources make the same bytes.
_WHEEL_DATE = (1980, 1, 1, 0, 0, 0)


@functools.cache  # what runs here is what was imported; asked for by every job, it cost 1.3 ms each time
def package_version() -> str:
    """The version of the kinetic_nb this notebook runs, as installed (``0+checkout`` for a checkout never installed)."""
    try:
        return importlib.metadata.version("kinetic_nb")
    except importlib.metadata.PackageNotFoundError:
        return "0+checkout"


def _package_root() -> Path:
    return Path(str(importlib.resources.files("kinetic_nb")))


def bootstrap_source() -> str:
    """The text of :mod:`kinetic_nb.agent.bootstrap`, which a pod runs with ``python3 -c``."""
    return (_package_root() / "agent" / "bootstrap.py").read_text()


def _package_files() -> list[tuple[str, Path]]:
    """The package's sources, by their names in a wheel (``os.walk``: a third of ``Path.rglob``'s time, for each
    job that ships a wheel)."""
    root = str(_package_root())
    parent = os.path.dirname(root)
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name != "__pycache__"]
        files += [os.path.join(directory, name) for name in names if name.endswith(".py")]
    return sorted((path[len(parent) + 1:].replace(os.sep, "/"), Path(path)) for path in files)


@functools.cache
def _requires() -> tuple[str, ...]:
    try:
        return tuple(importlib.metadata.requires("kinetic_nb") or ())
    except importlib.metadata.PackageNotFoundError:  # run from a checkout on sys.path, never installed
        return ()


def package_wheel(cache: Path | None = None) -> Path:
    """A wheel of the kinetic_nb this notebook runs, built once per content and kept in the user's cache.

    A development install is on no index, and ``pip wheel`` of its source
    needs setuptools from the network, so the wheel is written here from the
    package's own files (``py3-none-any``: kinetic_nb is pure Python) with the
    installed distribution's requirements. The same files give the same bytes.

    Parameters
    ----------
    cache : Path, optional
        Default ``~/.cache/kinetic_nb/wheels``; each build in a directory named by its content hash.
    """
    files = _package_files()
    # The files unchanged since the last call (by their size and modification time) make the same wheel: not
    # read and hashed again for every job (an ssh host's warm start is faster than that).
    stamp = (str(cache), tuple((name, *_size_and_time(path)) for name, path in files))
    known = _built.get(stamp)
    if known is not None and known.exists():
        return known
    _built[stamp] = wheel = _build_wheel(files, cache)
    return wheel


def _size_and_time(path: Path) -> tuple[int, int]:
    status = os.stat(path)
    return status.st_size, status.st_mtime_ns


#: Wheels built by this process, by their files' sizes and modification times.
_built: dict[tuple, Path] = {}


def _build_wheel(files: list[tuple[str, Path]], cache: Path | None) -> Path:
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    version = package_version()
    digest.update(version.encode() + b"\0" + "\n".join(_requires()).encode())
    directory = (cache or user_directory("wheels")) / digest.hexdigest()[:16]
    wheel = directory / f"kinetic_nb-{version}-py3-none-any.whl"
    if wheel.exists():
        return wheel
    directory.mkdir(parents=True, exist_ok=True)
    dist_info = f"kinetic_nb-{version}.dist-info"
    metadata = "".join(["Metadata-Version: 2.1\nName: kinetic_nb\n", f"Version: {version}\n",
                        *(f"Requires-Dist: {requirement}\n" for requirement in _requires())])
    contents = [(name, path.read_bytes()) for name, path in files] + [
        (f"{dist_info}/METADATA", metadata.encode()),
        (f"{dist_info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: kinetic_nb\nRoot-Is-Purelib: true\n"
                               b"Tag: py3-none-any\n"),
    ]
    record = [f"{name},sha256={_record_hash(data)},{len(data)}" for name, data in contents]
    contents.append((f"{dist_info}/RECORD", ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()))
    handle, temporary = tempfile.mkstemp(dir=directory, suffix=".part")
    with os.fdopen(handle, "wb") as file, zipfile.ZipFile(file, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in contents:
            archive.writestr(zipfile.ZipInfo(name, _WHEEL_DATE), data, zipfile.ZIP_DEFLATED)
    os.replace(temporary, wheel)
    return wheel


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def host_packages(storage_uri: str) -> list[str]:
    """What a pod installs beside kinetic_nb (which it installs with ``--no-deps``: the pods need no
    IPython): :data:`HOST_DISTRIBUTIONS`, and the storage's extra, as kinetic_nb's metadata pins them."""
    extras = {extra for scheme, extra in STORAGE_EXTRAS.items() if storage_uri.startswith(scheme)}
    packages = []
    for requirement in _requires():
        spec, _, marker = requirement.partition(";")
        name = _NAME.match(spec.strip()).group(0)
        extra = _EXTRA_MARKER.search(marker)
        extra = extra.group(1) if extra else None
        if (extra is None and name in HOST_DISTRIBUTIONS) or (extra in extras):
            packages.append(spec.strip())
    return packages or [*HOST_DISTRIBUTIONS, *(["google-cloud-storage"] if extras else [])]


def install_record(storage_uri: str, *, requirements: bytes | None, wheel: Path | None = None
                   ) -> tuple[dict, bytes, Path]:
    """What a job's hosts install, as :func:`store_environment` would store it: the record, its bytes (the
    bootstrap keeps an environment by their sha256: the same contents give the same bytes, whatever the job)
    and the wheel it names."""
    wheel = wheel or package_wheel()
    wheel_bytes = wheel.read_bytes()
    # The contents' hashes make the record itself say what is installed: a host that keeps environments
    # (an ssh host, a restarted pod) reuses one only for the same wheel and requirements, whatever their names.
    record = {"wheel": f"{protocol.ENVIRONMENT_DIR}/{wheel.name}",
              "requirements": REQUIREMENTS_OBJECT if requirements is not None else None,
              "packages": host_packages(storage_uri), "wheel_sha256": hashlib.sha256(wheel_bytes).hexdigest(),
              "requirements_sha256": hashlib.sha256(requirements).hexdigest() if requirements is not None else None}
    return record, json.dumps(record, indent=1).encode(), wheel


def store_environment(storage: Storage, key: bytes, *, requirements: bytes | None, wheel: Path | None = None) -> dict:
    """Store, each signed under the job's ``key``, what the hosts install: the wheel, the requirements
    (None: none), and :data:`~kinetic_nb.runner.protocol.ENVIRONMENT_INSTALL` naming them, stored last.

    Returns
    -------
    dict
        The install record, as stored.
    """
    record, body, wheel = install_record(storage.uri, requirements=requirements, wheel=wheel)
    write_sealed(storage, record["wheel"], key, wheel.read_bytes())
    if requirements is not None:
        write_sealed(storage, REQUIREMENTS_OBJECT, key, requirements)
    write_sealed(storage, protocol.ENVIRONMENT_INSTALL, key, body)
    return record
