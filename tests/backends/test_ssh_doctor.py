"""``%kinetic doctor -b ssh`` / ``-b tpu-vm`` against the four real test ``sshd``'s (``tests/ssh_hosts``), and for
``-b tpu-vm`` the Cloud TPU API's recording double (``tests/backends/tpu_api_double``) reached through google-auth's
real ``AuthorizedSession``, as ``test_tpu_vm_backend`` does.

Each check is read off the table's rows (name, status, detail, fix); the failing ones are made real: an address
where nothing listens for ssh, an interpreter that is not there, an address of host 0 the other hosts cannot reach,
a process holding the chips (a file standing in for them, held open).
"""

from __future__ import annotations

import os
import sys

import psutil
import pytest

from kinetic_nb.backends.kubernetes.doctor_report import DoctorReport
from kinetic_nb.backends.ssh import tpu_vm
from kinetic_nb.backends.ssh.backend import SshBackend
from kinetic_nb.backends.ssh.doctor import doctor, doctor_for
from kinetic_nb.backends.ssh.pool import close_pools
from kinetic_nb.backends.ssh.tpu_vm import TpuVmBackend

from ..ssh_hosts import NOBODY
from .conftest import ssh_options
from .tpu_api_double import answering_as_google, chips_held, tpu_node

PROJECT, ZONE = "ml-team", "us-west4-a"
NOTEBOOK_PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"


def rows(report: DoctorReport) -> dict[str, tuple[str, str, str]]:
    """Each row of the report by its name: (status, detail, fix)."""
    return {check.name: (check.status, check.detail, check.fix) for check in report.checks}


def on_ssh(test_hosts, hosts: int = 4, **changed: str) -> SshBackend:
    """``-b ssh`` on the first ``hosts`` test hosts, with ``changed`` options."""
    return SshBackend.from_options(**{**ssh_options(test_hosts, hosts), **changed})


@pytest.fixture
def free_chips(monkeypatch, tmp_path):
    """The hosts' TPU, as a file no process holds."""
    chip = tmp_path / "accel-free"
    chip.write_bytes(b"")
    monkeypatch.setattr(tpu_vm, "TPU_DEVICES", (str(chip),))


# -- -b ssh ---------------------------------------------------------------------------------------------------


def test_hosts_that_can_run_cells_pass_every_row(ssh_hosts, storage_root, free_chips):
    report = doctor(on_ssh(ssh_hosts), "tpu-v5e-16", storage_root)
    found = rows(report)
    assert list(found) == ["hosts reachable", "Python", "storage", "coordinator port", "free TPU chips"]
    assert {name: status for name, (status, _, _) in found.items()} == dict.fromkeys(found, "ok"), report.table()
    assert report.ok
    assert found["hosts reachable"][1] == "all 4 hosts over ssh"
    assert found["Python"][1].endswith(f"the notebook's {NOTEBOOK_PYTHON}")
    assert found["storage"][1] == f"{storage_root}: every host sees it, and its user may use it"
    assert found["coordinator port"][1].startswith(f"every host reaches host 0 at {ssh_hosts.addresses[0]}:")
    # The table looks as the Kubernetes doctor's does.
    assert report.table().splitlines()[0].split() == ["check", "status", "detail"]
    # Host 0's listener ended with the check.
    assert not [process.pid for process in psutil.process_iter(["cmdline"])
                if "server.accept()" in " ".join(process.info["cmdline"] or ())]


def test_an_unreachable_host_has_its_row_and_fix_and_the_others_are_still_checked(ssh_hosts, storage_root):
    backend = on_ssh(ssh_hosts, ssh_hosts="h0,nobody,h2")
    found = rows(doctor(backend, None, storage_root))
    status, detail, fix = found["hosts reachable"]
    assert status == "fail"
    assert detail.startswith("host 1 (nobody) cannot be reached: ") and "\n" not in detail
    assert fix == f"ssh -F {ssh_hosts.config} -v nobody true"
    # The hosts that were reached are checked; the one that was not is named as not checked.
    for name in ("Python", "storage", "coordinator port"):
        status, detail, _ = found[name]
        assert status == "ok", (name, detail)
        assert "not checked on host 1 (nobody) (not reached)" in detail, (name, detail)
    assert "free TPU chips" not in found  # -b ssh without a TPU accelerator


def test_the_nobody_address_itself_is_named(ssh_hosts, storage_root):
    """A bare address where nothing listens for ssh (as a TPU VM's worker is named): its own row's reason."""
    found = rows(doctor(on_ssh(ssh_hosts, 1, ssh_hosts=f"h0,{NOBODY}"), None, storage_root))
    status, detail, fix = found["hosts reachable"]
    assert status == "fail" and detail.startswith(f"host 1 ({NOBODY}) cannot be reached")
    assert fix.endswith(f"-v {NOBODY} true")


def test_a_python_that_is_not_there_fails_its_row_and_leaves_the_rest_unchecked(ssh_hosts, storage_root):
    found = rows(doctor(on_ssh(ssh_hosts, 2, ssh_python="/nowhere/python3"), None, storage_root))
    assert found["hosts reachable"][0] == "ok"
    status, detail, fix = found["Python"]
    assert status == "fail"
    assert detail == (f"host 0 (h0) has no /nowhere/python3: install Python {NOTEBOOK_PYTHON} there, or name one "
                      "with --ssh-python (and 1 more: host 1 (h1))")
    assert fix.startswith("leave out --ssh-python ")  # jobs then install the notebook's where python3 is another
    assert found["storage"][:2] == ("warn", "not checked: no host to ask (no Python to ask)")
    assert found["coordinator port"][0] == "warn"


#: A Python of another minor version than the notebook's, where this machine has one.
OTHER_PYTHON = "/root/.pyenv/versions/3.10.13/bin/python3.10"


@pytest.mark.skipif(not os.access(OTHER_PYTHON, os.X_OK) or sys.version_info[:2] == (3, 10),
                    reason=f"needs {OTHER_PYTHON}, another minor version than the test's")
def test_another_minor_version_fails_its_row_and_the_other_checks_still_run_with_it(ssh_hosts, storage_root):
    """A host's Python of another minor version cannot run the notebook's cells, but it answers the probe: the
    storage and the port are still checked."""
    found = rows(doctor(on_ssh(ssh_hosts, 2, ssh_python=OTHER_PYTHON), None, storage_root))
    status, detail, fix = found["Python"]
    assert status == "fail"
    assert detail.startswith(f"host 0 (h0) runs Python 3.10.13 ({OTHER_PYTHON}) and this notebook {NOTEBOOK_PYTHON}: ")
    assert detail.endswith("(and 1 more: host 1 (h1))") and "--ssh-python is used as it is" in detail
    assert fix.startswith("leave out --ssh-python ")
    assert found["storage"][0] == "ok" and found["coordinator port"][0] == "ok"


def test_a_default_python3_of_another_minor_version_is_fine_the_first_job_installs_the_notebooks(ssh_hosts,
                                                                                                  storage_root):
    """Without --ssh-python, a host's python3 of another minor version (a TPU VM image's 3.10) gets the notebook's
    installed by the first job: the row says so, and passes."""
    report = doctor(on_ssh(ssh_hosts, 2, ssh_python=""), None, storage_root, notebook_python=(3, 99))
    status, detail, fix = rows(report)["Python"]
    assert (status, fix) == ("ok", "")
    assert detail.endswith("the first job installs the notebook's 3.99 into the kinetic_nb cache of host 0 (h0), "
                           "host 1 (h1) (uv's managed CPython, once; later jobs find it there)")


def test_a_host_0_address_the_others_cannot_reach_fails_the_coordinator_row(ssh_hosts, storage_root):
    """The jobs give the other hosts host 0's address: one they cannot connect to fails here, not in a cell's
    distributed start."""
    class Unreachable(SshBackend):
        def host0_address(self) -> str:
            return "192.0.2.1"  # TEST-NET-1: no machine answers there

    backend = Unreachable.from_options(**ssh_options(ssh_hosts, 3))
    status, detail, fix = rows(doctor(backend, None, storage_root))["coordinator port"]
    assert status == "fail"
    assert detail.startswith("host 1 (h1) cannot connect to host 0 at 192.0.2.1:")
    assert detail.endswith("(and 1 more: host 2 (h2))")
    assert "name host 0 in your ssh config by an address they reach (not 192.0.2.1)" in fix


def test_chips_another_process_holds_fail_their_row_with_the_kill_command(ssh_hosts, storage_root, monkeypatch,
                                                                         tmp_path):
    with chips_held(monkeypatch, tmp_path) as holder:
        status, detail, fix = rows(doctor(on_ssh(ssh_hosts, 2), "tpu-v5e-8", storage_root))["free TPU chips"]
    assert status == "fail"
    assert detail.startswith(f"host 0 (h0): its TPU is held by process {holder.pid} ")
    assert fix == f"ssh -F {ssh_hosts.config} h0 'kill {holder.pid}'"


def test_a_gs_root_is_written_from_here_and_its_endpoint_reached_from_every_host(ssh_hosts, gcs_root):
    status, detail, _ = rows(doctor(on_ssh(ssh_hosts, 2), None, gcs_root))["storage"]
    assert status == "ok", detail
    assert detail.startswith(f"{gcs_root} written, read back and deleted from here; every host reaches 127.0.0.1:")


def test_the_magic_prints_the_table_for_ssh_hosts(ssh_hosts, storage_root, capsys):
    from IPython.core.interactiveshell import InteractiveShell

    options = ssh_options(ssh_hosts, 2)
    shell = InteractiveShell.instance()
    try:
        shell.run_line_magic("load_ext", "kinetic_nb")
        result = shell.run_line_magic("kinetic", f"doctor -b ssh --ssh-hosts {options['ssh_hosts']} --ssh-config "
                                                 f"{options['ssh_config']} --ssh-python {options['ssh_python']}")
    finally:
        InteractiveShell.clear_instance()
    out = capsys.readouterr().out
    assert result is None
    assert out.splitlines()[0].split() == ["check", "status", "detail"]
    assert [line.split()[-1] for line in out.splitlines()[1:] if line.startswith("hosts reachable")] != []
    assert "fail" not in out and "coordinator port" in out


# -- -b tpu-vm ------------------------------------------------------------------------------------------------


@pytest.fixture
def tpu_api(ssh_hosts, monkeypatch, tmp_path):
    """The double, answering for a v5litepod-16 whose workers are the test hosts (``slice-16``), the same with
    OS Login on in its metadata, and a stopped one; gcloud's key the one the hosts accept."""
    nodes = {(PROJECT, ZONE, "slice-16"): tpu_node(ssh_hosts.addresses),
             (PROJECT, ZONE, "os-login"): {**tpu_node(ssh_hosts.addresses), "metadata": {"enable-oslogin": "TRUE"}},
             (PROJECT, ZONE, "stopped"): tpu_node(ssh_hosts.addresses, state="STOPPED")}
    with answering_as_google(monkeypatch, nodes, client_key=ssh_hosts.client_key, project=PROJECT,
                             known_hosts=str(tmp_path / "google_compute_known_hosts")) as double:
        yield double
    close_pools()


def on_tpu_vm(ssh_hosts, tpu: str = "slice-16") -> dict:
    options = ssh_options(ssh_hosts)
    return {"tpu": tpu, "zone": ZONE, "ssh_config": options["ssh_config"], "ssh_python": options["ssh_python"]}


def test_a_tpu_vm_slice_that_can_run_cells_passes_every_row(ssh_hosts, tpu_api, storage_root, free_chips):
    report = doctor_for(TpuVmBackend, None, storage_root, on_tpu_vm(ssh_hosts))
    found = rows(report)
    assert list(found) == ["TPU VM", "OS Login", "hosts reachable", "Python", "storage", "coordinator port",
                           "free TPU chips"]
    assert report.ok and all(status == "ok" for status, _, _ in found.values()), report.table()
    assert found["TPU VM"][1] == "slice-16 is READY: tpu-v5e-16, 4 workers, reached at their internal addresses"
    assert found["OS Login"][1] == (f"off (its project's metadata): the workers are logged in as {ssh_hosts.user}, "
                                    "as ssh would")


def test_os_login_names_the_posix_user_and_a_refused_login_gets_gclouds_fix(ssh_hosts, tpu_api, storage_root):
    """The workers are logged in as the account's OS Login user, whom the test hosts do not let in: the row says
    who, and the refusal's fix is gcloud's, which pushes the key (to OS Login too)."""
    found = rows(doctor_for(TpuVmBackend, None, storage_root, on_tpu_vm(ssh_hosts, "os-login")))
    assert found["OS Login"][:2] == ("ok", f"on (the TPU VM's metadata): the workers are logged in as "
                                           f"{tpu_api.posix_user}, your account's OS Login user")
    status, detail, fix = found["hosts reachable"]
    assert status == "fail" and detail.startswith(f"host 0 ({tpu_api.posix_user}@{ssh_hosts.addresses[0]}): the key "
                                                  "was refused")
    assert fix == (f"gcloud compute tpus tpu-vm ssh os-login --zone {ZONE} --project {PROJECT} --worker=all "
                   "--command=true")


def test_a_tpu_vm_that_is_not_ready_is_one_row_with_its_fix(ssh_hosts, tpu_api, storage_root):
    logins = [ssh_hosts.accepted(index) for index in range(4)]
    report = doctor_for(TpuVmBackend, None, storage_root, on_tpu_vm(ssh_hosts, "stopped"))
    assert [check.name for check in report.checks] == ["TPU VM"] and not report.ok
    assert report.checks[0].fix == f"gcloud compute tpus tpu-vm start stopped --zone {ZONE}"
    assert [ssh_hosts.accepted(index) for index in range(4)] == logins  # no worker was reached


def test_a_tpu_vm_worker_whose_chips_are_held_gets_the_kill_command_on_that_worker(ssh_hosts, tpu_api, storage_root,
                                                                                    monkeypatch, tmp_path):
    with chips_held(monkeypatch, tmp_path) as holder:
        status, detail, fix = rows(doctor_for(TpuVmBackend, None, storage_root,
                                              on_tpu_vm(ssh_hosts)))["free TPU chips"]
    assert status == "fail" and detail.endswith("(and 3 more: host 1 (127.0.0.21), host 2 (127.0.0.22), host 3 "
                                                "(127.0.0.23))")
    assert fix == (f"gcloud compute tpus tpu-vm ssh slice-16 --zone {ZONE} --project {PROJECT} --worker=0 "
                   f"--command='kill {holder.pid}'")


@pytest.mark.parametrize(("problem", "fix"), [
    ("host 0 (h0): its TPU is held by process 812 (python train.py) of user bob: ask bob to stop it, or stop it as "
     "root (sudo kill 812)", "ssh h0 'sudo kill 812'"),
    ("host 0 (h0): its TPU is held by kinetic_nb job kn-20261206-1, of this notebook's user: end it with "
     "%kinetic cancel kn-20261206-1, then run the cell again", "%kinetic cancel kn-20261206-1"),
])
def test_a_holders_fix_is_the_command_its_line_names(problem, fix):
    """Another user's process is killed as root, as its line says; a job's id is taken without the text after."""
    from kinetic_nb.backends.ssh.connections import SshHost
    from kinetic_nb.backends.ssh.doctor import _holder_fix

    assert _holder_fix(SshBackend(["h0"]), SshHost(0, "h0"), problem) == fix
