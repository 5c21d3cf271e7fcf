"""Two cells submitted at once keep their hosts, ports and objects apart."""

from __future__ import annotations

import kinetic_nb

CELL = (
    "import os, jax, jax.numpy as jnp\n"
    "from jax.experimental import multihost_utils\n"
    "total = float(multihost_utils.process_allgather(jnp.ones(1) * (jax.process_index() + 1)).sum())\n"
    "(os.environ['KINETIC_JOB_ID'], os.environ['JAX_COORDINATOR_ADDRESS'], total, scale * total)\n"
)


def test_two_jobs_at_once_do_not_mix():
    first = kinetic_nb.submit(CELL, hosts=2, namespace={"scale": 10}, keep=True)
    second = kinetic_nb.submit(CELL, hosts=3, namespace={"scale": 100}, keep=True)
    assert first.job_id != second.job_id
    first_job, first_port, first_total, first_scaled = first.result()
    second_job, second_port, second_total, second_scaled = second.result()
    assert (first_job, first_total, first_scaled) == (first.job_id, 3.0, 30.0)
    assert (second_job, second_total, second_scaled) == (second.job_id, 6.0, 600.0)
    assert first_port != second_port
    for handle in (first, second):
        hosts = {name.split("/")[1] for name in (i.name for i in handle.storage.list()) if name.startswith("hosts/")}
        assert hosts == {str(i) for i in range(handle.plan.hosts)}
        assert handle.storage.uri.endswith(handle.job_id)
