"""The ``gke`` marker: tests that need a real GKE cluster (see docs/gke.md)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gke: runs against a real GKE cluster; skipped unless KINETIC_GKE_E2E=1 and cluster credentials exist",
    )
