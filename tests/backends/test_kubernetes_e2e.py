"""End to end on a real GKE cluster (marked ``gke``; see docs/gke.md, "Running the end-to-end test").

Skipped unless ``KINETIC_GKE_E2E=1`` and cluster credentials exist (in-cluster,
or a kubeconfig). It also needs ``KINETIC_IMAGE`` (an image with kinetic_nb and
jax) and ``KINETIC_E2E_STORAGE`` (``gs://BUCKET/PREFIX`` the pods may write).
``KINETIC_E2E_ACCELERATORS`` chooses the shapes, comma-separated (default
``cpu-2``: two CPU hosts, an Indexed Job; add ``tpu-v5e-16`` for a
LeaderWorkerSet on a v5e node pool). Namespace, service account and node
selectors come from the usual ``KINETIC_*`` variables.
"""

from __future__ import annotations

import os
import pathlib
import time

import pytest

import kinetic_nb
from kinetic_nb.accelerators import resolve_accelerator
from kinetic_nb.errors import JobFailedError


def _has_credentials() -> bool:
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return True
    paths = os.environ.get("KUBECONFIG", str(pathlib.Path.home() / ".kube" / "config")).split(os.pathsep)
    return any(path and pathlib.Path(path).is_file() for path in paths)


ENABLED = os.environ.get("KINETIC_GKE_E2E") == "1" and _has_credentials()
pytestmark = [
    pytest.mark.gke,
    pytest.mark.skipif(not ENABLED, reason="needs a real GKE cluster: set KINETIC_GKE_E2E=1 with cluster "
                                           "credentials (kubeconfig or in-cluster), KINETIC_IMAGE and "
                                           "KINETIC_E2E_STORAGE=gs://BUCKET/PREFIX (docs/gke.md)"),
    pytest.mark.timeout(3600),
]
ACCELERATORS = [name.strip() for name in os.environ.get("KINETIC_E2E_ACCELERATORS", "cpu-2").split(",") if name.strip()]
#: Pods wait for nodes (a TPU node pool may scale up from zero): minutes, not seconds.
JOB_TIMEOUT_S = 1800.0


@pytest.fixture
def storage() -> str:
    uri = os.environ.get("KINETIC_E2E_STORAGE", "")
    if not uri.startswith("gs://") or not os.environ.get("KINETIC_IMAGE"):
        pytest.fail("the gke tests need KINETIC_E2E_STORAGE=gs://BUCKET/PREFIX and KINETIC_IMAGE")
    return uri


def run_to_the_end(handle, timeout: float = JOB_TIMEOUT_S):
    """Wait for the outcome, asking the backend for exit records on the way, then remove the job's objects."""
    deadline = time.monotonic() + timeout
    try:
        while len(handle.backend.exit_summaries(handle.storage, handle.plan, handle.storage.list(), handle.key)) < handle.plan.hosts:
            if time.monotonic() > deadline:
                raise AssertionError(f"job {handle.job_id} did not end in {timeout:g} s:\n{handle.summary()}")
            time.sleep(5)
        return handle.result(timeout=120)
    finally:
        handle.backend.cleanup(handle.plan)


@pytest.mark.parametrize("shape", ACCELERATORS)
def test_a_jax_cell_runs_on_every_host(shape, storage):
    if shape.startswith("cpu-"):
        accelerator, hosts, env = None, int(shape.split("-")[1]), {"JAX_PLATFORMS": "cpu"}
        devices = hosts
    else:
        accelerator, hosts, env = shape, None, {}
        devices = resolve_accelerator(shape).devices
    source = ("import jax, jax.numpy as jnp\n"
              "from jax.experimental import multihost_utils\n"
              "total = multihost_utils.process_allgather(jnp.ones(1) * jax.process_index()).sum()\n"
              "(jax.process_count(), jax.process_index(), jax.device_count(), float(total))")
    handle = kinetic_nb.submit(source, hosts=hosts, accelerator=accelerator, backend="kubernetes", env=env,
                               storage=storage, timeout=JOB_TIMEOUT_S, quiet=True)
    count = handle.plan.hosts
    assert run_to_the_end(handle) == (count, 0, devices, float(sum(range(count))))


def test_a_pod_that_cannot_be_scheduled_fails_the_job_with_the_schedulers_reason(storage, monkeypatch):
    monkeypatch.setenv("KINETIC_NODE_SELECTOR", "kinetic-nb/e2e-no-such-node=true")
    monkeypatch.setenv("KINETIC_PENDING_TIMEOUT", "60")
    handle = kinetic_nb.submit("1", hosts=2, backend="kubernetes", storage=storage, quiet=True)
    # At once where the cluster autoscaler runs (it finds no pool for the selector), else after the limit.
    with pytest.raises(JobFailedError, match=r"never started: (its pod was Pending for more than 60 s: Unschedulable"
                                             r"|no node pool can add nodes for it: pod didn't trigger scale-up)"):
        run_to_the_end(handle, timeout=600)
