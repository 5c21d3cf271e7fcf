"""The ``gke`` marker (tests that need a real GKE cluster, see docs/gke.md), options for the ssh test hosts, and
kubernetes-validate's schemas read once a run."""

from __future__ import annotations

import functools
import os
import sys

import kubernetes_validate.utils


def _schemas_read_once() -> None:
    """kubernetes-validate reads and parses a kind's schema and its version's definitions (megabytes of JSON) at
    every ``validate``: 15 s of the 152 manifest tests' 19 here. Its validators only read them."""
    if not hasattr(kubernetes_validate.utils.schema_contents, "cache_info"):
        kubernetes_validate.utils.schema_contents = functools.cache(kubernetes_validate.utils.schema_contents)


_schemas_read_once()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gke: runs against a real GKE cluster; skipped unless KINETIC_GKE_E2E=1 and cluster credentials exist",
    )


def python_of_the_hosts() -> str:
    """The interpreter the ssh test hosts run: the test interpreter's own (its packages come on PYTHONPATH)."""
    return os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")


def ssh_options(ssh_hosts, hosts: int = 4) -> dict:
    """``backend_options`` for ``-b ssh`` on the first ``hosts`` test hosts, with the test interpreter's Python."""
    return {"ssh_hosts": ",".join(ssh_hosts.targets[:hosts]), "ssh_config": ssh_hosts.config,
            "ssh_python": python_of_the_hosts()}
