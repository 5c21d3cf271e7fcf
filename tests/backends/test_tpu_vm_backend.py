"""``-b tpu-vm``: the slice read from a recording double of the Cloud TPU API (``tests/backends/tpu_api_double``)
through google-auth's real ``AuthorizedSession``, its workers the four real test ``sshd``'s, reached by their
addresses with the key and known-hosts file gcloud would use (here the run's own).
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

import kinetic_nb
from kinetic_nb.backends.ssh import tpu_vm
from kinetic_nb.backends.ssh.pool import close_pools
from kinetic_nb.backends.ssh.tpu_vm import TpuNode, choose_addresses
from kinetic_nb.errors import KineticError, SshHostError

from .tpu_api_double import answering_as_google, chips_held, tpu_node

PROJECT, ZONE = "ml-team", "us-west4-a"


def two_networks(node: dict) -> dict:
    """``node`` on two networks, as the API describes one: each worker's endpoint on each network, worker by
    worker (the second network's addresses are nobody's here)."""
    endpoints = [endpoint for index, first in enumerate(node["networkEndpoints"])
                 for endpoint in (first, {"ipAddress": f"192.0.2.{index + 1}", "port": 8470})]
    return {**node, "networkEndpoints": endpoints,
            "networkConfigs": [{"network": "default"}, {"network": "second"}]}


@pytest.fixture
def tpu_api(ssh_hosts, monkeypatch, tmp_path):
    """The double, answering for TPU VM ``slice-16`` (a v5litepod-16: 4 workers, the test hosts) and a few others;
    the notebook's credentials a token of the test's; gcloud's key the one the hosts accept."""
    nodes = {(PROJECT, ZONE, "slice-16"): tpu_node(ssh_hosts.addresses),
             (PROJECT, ZONE, "creating"): tpu_node(ssh_hosts.addresses, state="CREATING"),
             (PROJECT, ZONE, "stopped"): tpu_node(ssh_hosts.addresses, state="STOPPED"),
             (PROJECT, ZONE, "two-networks"): two_networks(tpu_node(ssh_hosts.addresses)),
             (PROJECT, ZONE, "os-login"): {**tpu_node(ssh_hosts.addresses),
                                           "metadata": {"enable-oslogin": "TRUE"}},
             ("os-login-project", ZONE, "slice-16"): tpu_node(ssh_hosts.addresses),
             ("unreadable-project", ZONE, "slice-16"): tpu_node(ssh_hosts.addresses),
             ("os-login-project", ZONE, "not-here"): {**tpu_node(ssh_hosts.addresses),
                                                      "metadata": {"enable-oslogin": "FALSE"}},
             (PROJECT, ZONE, "preempted"): {**tpu_node(ssh_hosts.addresses, state="PREEMPTED"),
                                            "schedulingConfig": {"spot": True}},
             (PROJECT, ZONE, "maintained"): {**tpu_node(ssh_hosts.addresses), "health": "UNHEALTHY_MAINTENANCE"},
             (PROJECT, ZONE, "v4-32"): tpu_node(ssh_hosts.addresses, accelerator_type="v4-32"),
             (PROJECT, ZONE, "by-topology"): tpu_node(ssh_hosts.addresses, accelerator_type=None,
                                                      accelerator_config={"type": "V5P", "topology": "2x2x4"})}
    with answering_as_google(monkeypatch, nodes, client_key=ssh_hosts.client_key, project=PROJECT,
                             known_hosts=str(tmp_path / "google_compute_known_hosts"),
                             denied={"not-yours", "unreadable-project"}) as double:
        double.os_login_projects.add("os-login-project")
        yield double
    close_pools()  # the next test's known-hosts file is another


def on_tpu_vm(ssh_hosts, tpu: str = "slice-16") -> dict:
    from .conftest import ssh_options

    options = ssh_options(ssh_hosts)
    return {"backend": "tpu-vm", "backend_options": {"tpu": tpu, "zone": ZONE, "ssh_config": options["ssh_config"],
                                                      "ssh_python": options["ssh_python"]}}


def test_a_cell_runs_on_the_slices_workers_in_order_with_its_accelerator(ssh_hosts, tpu_api, tmp_path):
    source = "import os\nprint('worker', os.environ['KINETIC_HOST_INDEX'])\n'leader value'"
    handle = kinetic_nb.submit(source, framework="none", quiet=True, **on_tpu_vm(ssh_hosts))
    assert handle.plan.hosts == 4 and handle.plan.accelerator == "tpu-v5e-16"  # from the node: no -a
    assert handle.result(timeout=300) == "leader value"
    for index in range(4):
        assert f"worker {index}" in handle.logs(index)
    # Read through the real request path: the credentials' token on the request.
    assert ("GET", f"/v2/projects/{PROJECT}/locations/{ZONE}/nodes/slice-16", "Bearer test-token") in tpu_api.requests
    # The job's backend made again from its record (%kinetic jobs, attach, gc) does not ask the API again.
    asked = len(tpu_api.requests)
    assert handle.job_id in [row.job_id for row in kinetic_nb.jobs()]
    assert len(tpu_api.requests) == asked
    # Each worker's host key kept under the node's id and its index, in gcloud's file.
    known = (tmp_path / "google_compute_known_hosts").read_text()
    assert sorted(line.split()[0] for line in known.splitlines()) == [f"tpu.4213374211-{index}" for index in range(4)]


@pytest.mark.parametrize(("tpu", "accelerator"), [("v4-32", "tpu-v4-32"), ("by-topology", "tpu-v5p-32")])
def test_a_four_worker_slice_of_a_generation_that_counts_tensorcores_runs_on_its_four_workers(ssh_hosts, tpu_api,
                                                                                               tpu, accelerator):
    """A v4-32 (32 TensorCores: 4 workers of 4 chips), and a v5p node made with ``--type v5p --topology 2x2x4``,
    which the API describes by its ``acceleratorConfig`` alone: each plans 4 hosts of 4 chips, Cloud TPU's naming
    whatever keras-kinetic calls ``v4-32``, and its cell runs on the test hosts standing in for its workers."""
    source = "import os\nprint('worker', os.environ['KINETIC_HOST_INDEX'])\n'on ' + os.environ['KINETIC_HOST_INDEX']"
    handle = kinetic_nb.submit(source, framework="none", quiet=True, **on_tpu_vm(ssh_hosts, tpu))
    assert (handle.plan.accelerator, handle.plan.hosts, handle.plan.devices_per_host) == (accelerator, 4, 4)
    assert handle.result(timeout=300) == "on 0"
    assert all(f"worker {index}" in handle.logs(index) for index in range(4))


def test_a_key_gcloud_has_not_pushed_is_one_line_with_gclouds_fix(ssh_hosts, tpu_api, monkeypatch):
    monkeypatch.setattr(tpu_vm, "GCLOUD_KEY", ssh_hosts.other_key)
    with pytest.raises(SshHostError) as caught:
        kinetic_nb.submit("1", framework="none", quiet=True, **on_tpu_vm(ssh_hosts))
    text = str(caught.value)
    assert text.startswith(f"host 0 ({ssh_hosts.addresses[0]}): the key was refused") and "\n" not in text
    assert text.endswith(f"run `gcloud compute tpus tpu-vm ssh slice-16 --zone {ZONE} --project {PROJECT} "
                         "--worker=all --command=true` once")


def test_a_worker_whose_tpu_another_process_holds_is_refused_naming_it(ssh_hosts, tpu_api, monkeypatch, tmp_path):
    with chips_held(monkeypatch, tmp_path) as holder, pytest.raises(
            SshHostError, match=rf"^host 0 \({ssh_hosts.addresses[0]}\): its TPU is held by process {holder.pid} "
                                rf"\({sys.executable} -c import time.*\): a job, session or notebook there still runs; "
                                rf"stop it \(kill {holder.pid}\)"):
        kinetic_nb.submit("1", framework="none", quiet=True, **on_tpu_vm(ssh_hosts))


@pytest.mark.parametrize(("kind", "fix"), [("ks", r"end it with %kinetic stop in its notebook"),
                                           ("kn", r"let it end, or end it with %kinetic cancel kn-")])
def test_a_tpu_a_kinetic_session_or_job_holds_says_how_to_end_it_from_a_notebook(ssh_hosts, tpu_api, monkeypatch,
                                                                                  tmp_path, kind, fix):
    """Killing a session's host by its pid leaves its notebook to find a dead session: the way out is the one
    it was started by."""
    job_id = f"{kind}-20261206-101010-abc123"
    with chips_held(monkeypatch, tmp_path, "-m", "kinetic_nb.agent", "--job", f"file:///jobs/{job_id}") as holder, \
            pytest.raises(SshHostError, match=rf"^host 0 \({ssh_hosts.addresses[0]}\): its TPU is held by kinetic_nb "
                                              rf"(session|job) {job_id} \(process {holder.pid}\): {fix}"):
        kinetic_nb.submit("1", framework="none", quiet=True, **on_tpu_vm(ssh_hosts))


@pytest.mark.parametrize(("tpu", "message"), [
    ("missing", rf"^there is no TPU VM missing in project {PROJECT}, zone {ZONE}: see `gcloud compute tpus tpu-vm list"),
    ("creating", r"^TPU VM creating is CREATING, not READY: wait for it"),
    ("stopped", r"^TPU VM stopped is STOPPED: start it \(`gcloud compute tpus tpu-vm start stopped --zone "),
    # A spot VM that was preempted cannot be started again: the fix is another VM, not `start`.
    ("preempted", r"^TPU VM preempted was preempted, and a spot TPU VM cannot be started again: delete it "),
    ("maintained", r"^TPU VM maintained is READY but under maintenance \(health UNHEALTHY_MAINTENANCE\): wait "),
    ("missing", r"queued resource is there once granted \(`gcloud compute tpus queued-resources list"),
    ("not-yours", r"^the Cloud TPU API refused to describe TPU VM not-yours \(403: Permission 'tpu.nodes.get' denied"),
])
def test_a_slice_that_cannot_be_used_is_one_line_before_any_worker_is_reached(ssh_hosts, tpu_api, tpu, message):
    logins = [ssh_hosts.accepted(index) for index in range(4)]
    with pytest.raises(KineticError, match=message):
        kinetic_nb.submit("1", framework="none", quiet=True, **on_tpu_vm(ssh_hosts, tpu))
    assert [ssh_hosts.accepted(index) for index in range(4)] == logins


def test_an_accelerator_other_than_the_slices_is_one_line(ssh_hosts, tpu_api):
    with pytest.raises(ValueError, match=r"^-a tpu-v5e-8 does not match the slice -b tpu-vm runs on, a tpu-v5e-16: "
                                         r"leave -a out$"):
        kinetic_nb.submit("1", accelerator="tpu-v5e-8", framework="none", quiet=True, **on_tpu_vm(ssh_hosts))


def test_the_tpu_and_zone_are_needed(monkeypatch):
    monkeypatch.delenv("KINETIC_TPU", raising=False)
    monkeypatch.delenv("KINETIC_ZONE", raising=False)
    with pytest.raises(ValueError, match=r"^-b tpu-vm needs the TPU VM and its zone: --tpu NAME --zone ZONE"):
        kinetic_nb.submit("1", quiet=True, backend="tpu-vm", backend_options={"tpu": "slice-16"})


NODE = TpuNode(name="slice", node_id="1", accelerator_type="v4-16", state="READY",
               internal=("10.0.0.2", "10.0.0.3"), external=("34.1.1.2", "34.1.1.3"))


def test_workers_are_reached_inside_their_network_from_a_worker_and_from_outside_by_external_addresses():
    assert choose_addresses(NODE, "auto", here={"192.168.1.5"}) == (("34.1.1.2", "34.1.1.3"), "external")
    assert choose_addresses(NODE, "auto", here={"10.0.0.2"}) == (("10.0.0.2", "10.0.0.3"), "internal")  # on worker 0
    assert choose_addresses(NODE, "internal", here=set()) == (("10.0.0.2", "10.0.0.3"), "internal")
    private = TpuNode(**{**NODE.__dict__, "external": ("34.1.1.2", None)})
    assert choose_addresses(private, "auto", here=set())[1] == "internal"  # not every worker is reachable outside
    with pytest.raises(ValueError, match=r"^TPU VM slice's worker 1 has no external address: run the notebook inside"):
        choose_addresses(private, "external", here=set())
    with pytest.raises(ValueError, match=r"^--tpu-addresses must be one of auto, internal, external, got 'public'$"):
        choose_addresses(NODE, "public", here=set())


def test_a_workers_changed_host_key_names_the_alias_gcloud_keeps_it_under(monkeypatch, tmp_path):
    import sysconfig

    from ..ssh_hosts import SshTestHosts
    from .conftest import python_of_the_hosts

    environment = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "XDG_CACHE_HOME": str(tmp_path / "cache")}
    known_hosts = tmp_path / "google_compute_known_hosts"
    with SshTestHosts(1, environment) as rebuilt, \
            answering_as_google(monkeypatch, {(PROJECT, ZONE, "one"): tpu_node(rebuilt.addresses,
                                                                              accelerator_type="v5litepod-4")},
                                client_key=rebuilt.client_key, known_hosts=str(known_hosts), project=PROJECT):
        options = {"backend": "tpu-vm", "backend_options": {"tpu": "one", "zone": ZONE, "ssh_config": rebuilt.config,
                                                            "ssh_python": python_of_the_hosts()}}
        try:
            assert kinetic_nb.submit("'first'", framework="none", quiet=True, **options).result(timeout=300) == "first"
            close_pools()  # the next job connects afresh, and meets the new key
            rebuilt.forget_host_key(0)
            with pytest.raises(SshHostError) as caught:
                kinetic_nb.submit("1", framework="none", quiet=True, **options)
        finally:
            close_pools()
    assert str(caught.value) == (
        f"host 0 ({rebuilt.addresses[0]}): its host key changed since it was last seen (a rebuilt machine, or "
        f"someone in between): check it, then remove the old one with `ssh-keygen -R tpu.4213374211-0 -f "
        f"{known_hosts}`")


def test_a_node_on_two_networks_runs_on_each_workers_first_networks_address(ssh_hosts, tpu_api):
    """Its endpoints list each worker once per network: the cell runs on its 4 workers, not 8 addresses."""
    handle = kinetic_nb.submit("import socket\nsocket.gethostname()", framework="none", quiet=True,
                               **on_tpu_vm(ssh_hosts, "two-networks"))
    handle.result(timeout=120)
    assert handle.plan.hosts == 4


def test_gclouds_key_is_offered_alone_as_gcloud_offers_it(tpu_api):
    """An agent with many keys would exhaust the server's tries before gcloud's key: IdentitiesOnly, as gcloud."""
    options = tpu_vm.TpuVmBackend("slice-16", zone=ZONE, project=PROJECT).ssh_options()
    assert options[-2:] == (f"IdentityFile={tpu_vm.GCLOUD_KEY}", "IdentitiesOnly=yes")


@pytest.mark.parametrize(("project", "tpu", "user"), [
    (PROJECT, "slice-16", None),  # no OS Login: this machine's user, as before
    (PROJECT, "os-login", "alice_example_com"),  # the node's own metadata
    ("os-login-project", "slice-16", "alice_example_com"),  # its project's
    ("os-login-project", "not-here", None),  # the node's own metadata wins over its project's
    ("unreadable-project", "slice-16", None),  # its metadata may not be read: as before, never an error
])
def test_where_os_login_is_on_the_workers_are_logged_in_as_its_posix_user(tpu_api, project, tpu, user):
    """gcloud logs in as the account's OS Login POSIX user (its primary one), found through the OS Login API with
    the account the token is; a bare address would log in as this machine's user, whom OS Login does not know."""
    backend = tpu_vm.TpuVmBackend(tpu, zone=ZONE, project=project)
    addresses = list(backend.node.internal)
    assert backend.targets == ([f"{user}@{address}" for address in addresses] if user else addresses)
    if user:
        asked = [path for _, path, _ in tpu_api.requests]
        assert "/v1/users/alice@example.com/loginProfile?projectId=" + project + "&systemId=linux" in asked
        assert ("GET", "/v1/userinfo", "Bearer test-token") in tpu_api.requests  # the token in a header only
        assert not any("test-token" in path for path in asked)  # never in a URL, where logs keep it


def test_an_os_login_lookup_that_failed_is_tried_again_never_skipped(tpu_api):
    """The OS Login API fails once: that try raises, and the next one logs in as the POSIX user, never as this
    machine's user with the node already read."""
    tpu_api.login_profile_outages = 1
    backend = tpu_vm.TpuVmBackend("os-login", zone=ZONE, project=PROJECT)
    with pytest.raises(KineticError):
        backend.targets  # noqa: B018 - it raises
    assert backend.targets == [f"alice_example_com@{address}" for address in backend.node.internal]



def through_external_addresses(ssh_hosts, external: list[str], tmp_path) -> str:
    """An ssh config that reaches each test host at ``external[i]`` as well, as a laptop reaches a worker at its
    external address (``ssh_relay.py`` carries the connection to the host's sshd); nothing else answers there."""
    relay = os.path.join(os.path.dirname(__file__), "ssh_relay.py")
    text = pathlib.Path(ssh_hosts.config).read_text()
    blocks, lines = text.split("\nHost "), [text]
    for outside, address, port in zip(external, ssh_hosts.addresses, ssh_hosts.ports, strict=True):
        own = next(block for block in blocks if block.startswith(f"{address}\n"))
        settings = [line for line in own.splitlines()[1:] if not line.strip().startswith("Port ")]
        lines += [f"Host {outside}", f"  ProxyCommand {sys.executable} {relay} {address} {port}", *settings]
    config = tmp_path / "ssh_config_outside"
    config.write_text("\n".join(lines) + "\n")
    return str(config)


def test_workers_meet_on_internal_addresses_and_the_notebook_reaches_the_hub_over_ssh(ssh_hosts, tpu_api, gcs_root,
                                                                                      tmp_path, monkeypatch):
    """The notebook outside the slice's network reaches the workers at their external addresses, where only ssh
    answers (no route at all here): the JAX coordinator and the session's hub are at worker 0's internal address
    (the workers meet there), and the notebook's channel to the hub is a port forwarded over its ssh connection."""
    from kinetic_nb.backends.ssh.connections import Connections

    forwarded = []
    forward = Connections.forward
    monkeypatch.setattr(Connections, "forward", lambda self, index, remote: forwarded.append(
        (index, remote, route := forward(self, index, remote))) or route)
    external = [f"192.0.2.{20 + index}" for index in range(4)]
    tpu_api.nodes[(PROJECT, ZONE, "outside")] = tpu_node(ssh_hosts.addresses, external=external)
    options = on_tpu_vm(ssh_hosts, "outside")
    options["backend_options"]["ssh_config"] = through_external_addresses(ssh_hosts, external, tmp_path)
    session = kinetic_nb.start(framework="jax", storage=gcs_root, echo=False, idle_timeout=600,
                               env={"JAX_PLATFORMS": "cpu"}, **options)
    try:
        assert session.group.backend.targets == external  # the notebook's ssh goes to the external addresses
        source = ("import os, jax, jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
                  "total = multihost_utils.process_allgather(jnp.ones(2) * jax.process_index()).sum()\n"
                  "(os.environ['JAX_COORDINATOR_ADDRESS'], os.environ['MASTER_ADDR'], jax.process_count(), "
                  "float(total))")
        coordinator, master, processes, total = session.run(source).result(timeout=300)
        assert coordinator.startswith(f"{ssh_hosts.addresses[0]}:") and master == ssh_hosts.addresses[0]
        assert (processes, total) == (4, 12.0)
        # The cell came through the channel, whose route is a loopback port ssh forwards to the hub on worker 0.
        assert session.channel is not None
        [(worker, hub, (here, _))] = forwarded
        assert (worker, hub[0], here) == (0, ssh_hosts.addresses[0], "127.0.0.1")
        assert session.run("'again'").result(timeout=120) == "again"
    finally:
        session.stop()
        close_pools()


def big_slice(ssh_hosts, workers: int, **node) -> dict:
    """A node of ``workers`` workers, the test hosts its first (the rest at addresses nobody answers)."""
    addresses = [*ssh_hosts.addresses[:workers], *(f"192.0.2.{100 + index}" for index in range(workers - 4))]
    return tpu_node(addresses, **node)


@pytest.mark.parametrize(("tpu", "workers", "node", "full", "run_as"), [
    ("v4-32", 4, {"accelerator_type": "v4-32"}, ("tpu-v4-32", 4, 4, "2x2x4"), ("tpu-v4-32", 4, 4)),
    ("v6e-8", 1, {"accelerator_type": "v6e-8"}, ("tpu-v6e-8", 1, 8, "2x4"), ("tpu-v6e-8", 1, 8)),
    ("v5p-128", 16, {"accelerator_type": "v5p-128"}, ("tpu-v5p-128", 16, 4, "4x4x4"), ("tpu-v5p-32", 4, 4)),
    ("v5litepod-256", 64, {"accelerator_type": "v5litepod-256"}, ("tpu-v5e-256", 64, 4, "16x16"),
     ("tpu-v5e-16", 4, 4)),
    ("v6e-256-by-config", 64, {"accelerator_type": None, "accelerator_config": {"type": "V6E", "topology": "16x16"}},
     ("tpu-v6e-256", 64, 4, "16x16"), ("tpu-v6e-16", 4, 4)),
])
def test_each_slice_is_planned_whole_and_its_first_workers_run_a_jax_cell(ssh_hosts, tpu_api, monkeypatch, tpu,
                                                                          workers, node, full, run_as):
    """Each slice is planned from the API's answer (hosts x chips, topology), whatever its size; one of more
    workers than the test hosts runs, with the test-only ``KINETIC_TPU_TEST_WORKERS=4``, on its first four (the
    test hosts) as the same generation's 4-host slice, and every one runs a JAX cell there."""
    tpu_api.nodes[(PROJECT, ZONE, tpu)] = big_slice(ssh_hosts, workers, **node)
    backend = tpu_vm.TpuVmBackend(tpu, zone=ZONE, project=PROJECT)
    whole = backend.node.accelerator
    assert (whole.name, whole.hosts, whole.devices_per_host, whole.topology) == full
    assert len(backend.node.internal) == workers
    if workers > len(ssh_hosts.addresses):
        monkeypatch.setenv(tpu_vm.TEST_WORKERS_ENV, "4")
    source = ("import jax, jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
              "total = multihost_utils.process_allgather(jnp.ones(2) * jax.process_index()).sum()\n"
              "(jax.process_count(), float(total))")
    handle = kinetic_nb.submit(source, framework="jax", quiet=True, env={"JAX_PLATFORMS": "cpu"},
                               **on_tpu_vm(ssh_hosts, tpu))
    assert (handle.plan.accelerator, handle.plan.hosts, handle.plan.devices_per_host) == run_as
    hosts = run_as[1]
    assert handle.result(timeout=300) == (hosts, float(sum(range(hosts)) * 2))


def test_a_two_network_node_plans_one_worker_per_endpoint_of_its_first_network(ssh_hosts, tpu_api):
    two = tpu_vm.TpuVmBackend("two-networks", zone=ZONE, project=PROJECT)
    assert two.targets == ssh_hosts.addresses and two.node.accelerator.name == "tpu-v5e-16"


def test_the_test_only_worker_count_is_checked(ssh_hosts, tpu_api, monkeypatch):
    monkeypatch.setenv(tpu_vm.TEST_WORKERS_ENV, "3")
    with pytest.raises(ValueError, match="the first 3 hosts of tpu-v5e-16 make no v5litepod slice"):
        tpu_vm.TpuVmBackend("slice-16", zone=ZONE, project=PROJECT).default_accelerator()
    monkeypatch.setenv(tpu_vm.TEST_WORKERS_ENV, "four")
    with pytest.raises(ValueError, match=r"\$KINETIC_TPU_TEST_WORKERS must be a number of workers, got 'four'"):
        tpu_vm.TpuVmBackend("slice-16", zone=ZONE, project=PROJECT).targets  # noqa: B018 - it raises
