"""The ``gke`` marker (tests that need a real GKE cluster, see docs/gke.md), and the ssh backend's test hosts."""

from __future__ import annotations

import os
import sys
import sysconfig

import pytest

from ..ssh_hosts import SshTestHosts


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gke: runs against a real GKE cluster; skipped unless KINETIC_GKE_E2E=1 and cluster credentials exist",
    )


@pytest.fixture(scope="session")
def ssh_hosts(tmp_path_factory):
    """Four real sshd's on loopback addresses; every login sees the test interpreter's packages (jax, torch) on
    PYTHONPATH, as a machine with them installed would, and a cache directory of the run's own."""
    cache = tmp_path_factory.mktemp("ssh-hosts-cache")
    environment = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "XDG_CACHE_HOME": str(cache)}
    with SshTestHosts(4, environment) as hosts:
        yield hosts


def ssh_options(ssh_hosts, hosts: int = 4) -> dict:
    """``backend_options`` for ``-b ssh`` on the first ``hosts`` test hosts, with the test interpreter's Python."""
    python = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    return {"ssh_hosts": ",".join(ssh_hosts.targets[:hosts]), "ssh_config": ssh_hosts.config, "ssh_python": python}
