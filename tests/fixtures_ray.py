"""The ``ray_cluster`` fixture: one real 4-node Ray cluster for the whole test session, started on first use.

Stopped at the end of the session, and the session fails if any of its
processes survived. Tests that kill a node start it again before they return.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .ray_cluster import RayCluster

#: Nodes in the test cluster: a head and three workers, as a 4-host slice has 4 machines.
RAY_TEST_NODES = 4


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    cluster = RayCluster(RAY_TEST_NODES)
    try:
        cluster.start()  # inside the try: a start that fails half way leaves its head's processes to stop
        import kinetic_nb.backends.ray.backend as ray_backend

        ray_backend.connect(cluster.address)
        cluster.wait_for_nodes(RAY_TEST_NODES)
        yield cluster
    finally:
        survivors = cluster.stop()
    assert survivors == [], f"Ray processes survived the cluster's stop: {survivors}"
