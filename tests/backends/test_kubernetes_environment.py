"""The prebuilt image mode: the pod's bootstrap verifies and installs the job's environment, then runs the agent.

The bootstrap (``kinetic_nb.agent.bootstrap``) runs here for real, in a
subprocess with the standard library only, against ``file://`` storage and
fake-gcs-server: it creates a fresh virtual environment and pip-installs a
real wheel of this kinetic_nb into it, offline (``PIP_NO_INDEX`` and
``PIP_FIND_LINKS`` point pip at a local wheel directory holding cloudpickle
and a small package the requirements name). The last tests run the whole
client path with the pods played by ``FakeKubelet`` (see
``test_kubernetes_client_path.py``), from an image with no kinetic_nb.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import threading
import zipfile

import cloudpickle
import pytest

import kinetic_nb
from kinetic_nb.agent import bootstrap
from kinetic_nb.backends import host_environment as environment
from kinetic_nb.backends.kubernetes import backend as k8s
from kinetic_nb.backends.kubernetes.image_modes import stock_image
from kinetic_nb.runner import envelope, job_keys, protocol
from kinetic_nb.runner.protocol.limits import record_limit
from kinetic_nb.runner.records import read_exit
from kinetic_nb.storage import open_storage

from .k8s_cluster import FakeKubelet, FakeKubernetes, pods_for, wait_for, workload

KEY = bytes(range(32))
NAMESPACE = "ml-team"
pytestmark = pytest.mark.filterwarnings("ignore:job storage file.*is local to this machine:kinetic_nb.errors.KineticWarning")


def _wheel(directory: pathlib.Path, name: str, version: str, files: dict[str, bytes]) -> pathlib.Path:
    dist_info = f"{name}-{version}.dist-info"
    files = {**files, f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for path, data in files.items()]
    files[f"{dist_info}/RECORD"] = ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in files.items():
            archive.writestr(member, data)
    return path


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> pathlib.Path:
    """What pip may install from, offline: this environment's cloudpickle and a package the requirements name."""
    directory = tmp_path_factory.mktemp("wheelhouse")
    package = pathlib.Path(cloudpickle.__file__).parent
    _wheel(directory, "cloudpickle", cloudpickle.__version__,
           {f"cloudpickle/{path.name}": path.read_bytes() for path in package.glob("*.py")})
    _wheel(directory, "kinetic_probe_requirement", "1.0",
           {"kinetic_probe_requirement.py": b"INSTALLED_BY = 'the requirements file'\n"})
    if subprocess.run([IMAGE_PYTHON, "-c", "import cryptography"], capture_output=True).returncode != 0:
        # A host needs cryptography too (host_environment.HOST_DISTRIBUTIONS): a compiled package, so its
        # wheels come from the registry, once, where the image's Python does not have it already.
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest",
                        str(directory), f"cryptography=={importlib.metadata.version('cryptography')}"], check=True)
    return directory


def offline_pip(wheelhouse: pathlib.Path) -> dict[str, str]:
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheelhouse), "PIP_NO_CACHE_DIR": "1"}


#: A stock image's ``python3``: an interpreter of the notebook's version that is no virtual environment's.
IMAGE_PYTHON = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")


def run_bootstrap(job_uri: str, directory: pathlib.Path, *command: str, extra: dict[str, str] | None = None,
                  options: tuple[str, ...] = (), python: str = IMAGE_PYTHON) -> subprocess.CompletedProcess:
    """The bootstrap as a pod runs it: ``python3 -c TEXT -- COMMAND``, with no kinetic_nb on its path."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    key_file = directory.parent / "job-key"  # the pod's mounted Secret
    key_file.write_text(KEY.hex())
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), bootstrap.KEY_FILE_ENV: str(key_file),
           bootstrap.JOB_URI_ENV: job_uri, bootstrap.DIRECTORY_ENV: str(directory), **(extra or {})}
    return subprocess.run([python, "-c", environment.bootstrap_source(), *options, "--", *command],
                          env=env, capture_output=True, text=True, timeout=240, cwd=directory.anchor)


# -- the verifier -------------------------------------------------------------------------------


def test_the_bootstraps_verifier_is_the_envelopes():
    assert (bootstrap.DOMAIN, bootstrap.TRAILER_PREFIX, bootstrap.TRAILER_BYTES, bootstrap.BLOCK_BYTES,
            bootstrap.KEY_FILE_ENV, bootstrap.KEY_BYTES) == (
        envelope._DOMAIN, envelope.TRAILER_PREFIX, envelope.TRAILER_BYTES, envelope.BLOCK_BYTES, job_keys.KEY_FILE_ENV,
        job_keys.KEY_BYTES)
    assert bootstrap.INSTALL_OBJECT == protocol.ENVIRONMENT_INSTALL
    # Written out here because kinetic_nb is what the bootstrap installs: the same names as the protocol's.
    assert [bootstrap.EXIT_RECORD.format(host=index) for index in (0, 7)] == [protocol.host_exit(0),
                                                                            protocol.host_exit(7)]
    for body in (b"", b"x", os.urandom(envelope.BLOCK_BYTES + 12345)):  # none, one piece, more than one block
        assert bootstrap.unseal(KEY, "environment/a.whl", envelope.seal(KEY, "environment/a.whl", body)) == body
        assert bootstrap.seal(KEY, "hosts/1/exit.json", body) == envelope.seal(KEY, "hosts/1/exit.json", body)


@pytest.mark.parametrize("damage", ["a byte changed", "another object's", "another key's", "unsigned"])
def test_the_bootstraps_verifier_refuses_what_the_job_did_not_store(damage):
    body = b"PK wheel bytes" * 100
    sealed = {"a byte changed": lambda: envelope.seal(KEY, "environment/a.whl", body)[:50] + b"Q"
              + envelope.seal(KEY, "environment/a.whl", body)[51:],
              "another object's": lambda: envelope.seal(KEY, "environment/b.whl", body),
              "another key's": lambda: envelope.seal(bytes(32), "environment/a.whl", body),
              "unsigned": lambda: body}[damage]()
    with pytest.raises(bootstrap.Refused, match=r"environment/a\.whl"):
        bootstrap.unseal(KEY, "environment/a.whl", sealed)


def test_the_bootstrap_reads_each_object_only_up_to_its_limit(tmp_path, monkeypatch):
    """The job's storage is not trusted: a giant planted where the install record or the wheel belongs is refused
    before it is read into the pod's memory, and the limit matches the protocol's for the install record."""
    assert record_limit(protocol.ENVIRONMENT_INSTALL)[1] == bootstrap.MAX_RECORD_BYTES
    (tmp_path / "environment").mkdir()
    (tmp_path / "environment" / "install.json").write_bytes(b"{" + b" " * bootstrap.MAX_RECORD_BYTES + b"}")
    with pytest.raises(bootstrap.Refused, match=r"install\.json is over the 65536 bytes .*refused, not read"):
        bootstrap.fetch(f"file://{tmp_path}", bootstrap.INSTALL_OBJECT)
    monkeypatch.setattr(bootstrap, "MAX_WHEEL_BYTES", 1000)
    (tmp_path / "environment" / "a.whl").write_bytes(b"w" * 1001)
    with pytest.raises(bootstrap.Refused, match="over the 1000 bytes"):
        bootstrap.fetch(f"file://{tmp_path}", "environment/a.whl", bootstrap.MAX_WHEEL_BYTES)
    assert bootstrap.fetch(f"file://{tmp_path}", "environment/a.whl", 1001) == b"w" * 1001


# -- the bootstrap, run -------------------------------------------------------------------------


def test_the_wheel_is_built_once_per_content(tmp_path):
    first = environment.package_wheel(tmp_path)
    assert environment.package_wheel(tmp_path) == first and first.name.startswith(f"kinetic_nb-{kinetic_nb.__version__}-")
    names = zipfile.ZipFile(first).namelist()
    assert "kinetic_nb/agent/bootstrap.py" in names and not any("__pycache__" in name for name in names)


PROBE = ("import json, sys, kinetic_nb, cloudpickle, kinetic_probe_requirement; "
         "print(json.dumps({'kinetic_nb': kinetic_nb.__file__, 'prefix': sys.prefix, "
         "'requirement': kinetic_probe_requirement.INSTALLED_BY}))")


def test_the_bootstrap_installs_the_signed_wheel_and_requirements_into_a_fresh_environment(tmp_path, wheelhouse):
    storage = open_storage(f"file://{tmp_path}/job")
    environment.store_environment(storage, KEY, requirements=b"kinetic_probe_requirement\n")
    directory = tmp_path / "pod" / "environment"
    done = run_bootstrap(storage.uri, directory, "python", "-c", PROBE, extra=offline_pip(wheelhouse))
    assert done.returncode == 0, done.stderr + done.stdout
    probe = json.loads(done.stdout.splitlines()[-1])
    # The wheel's kinetic_nb, in the new environment, not this checkout's.
    assert probe["prefix"] == str(directory / "venv") and probe["kinetic_nb"].startswith(probe["prefix"])
    assert probe["requirement"] == "the requirements file"
    assert f"{bootstrap.PREFIX}Successfully installed kinetic-nb-{kinetic_nb.__version__}" in done.stdout
    record = json.loads((directory / "record.json").read_text())
    assert record["ok"] and record["started_at"] <= record["ended_at"]

    # A restarted container (the scratch volume kept) finds it installed, and only runs the command.
    again = run_bootstrap(storage.uri, directory, "python", "-c", PROBE, extra=offline_pip(wheelhouse))
    assert again.returncode == 0 and bootstrap.PREFIX not in again.stdout
    assert json.loads((directory / "record.json").read_text()) == record


def test_a_tampered_wheel_is_refused_before_pip_runs(tmp_path, wheelhouse):
    storage = open_storage(f"file://{tmp_path}/job")
    record = environment.store_environment(storage, KEY, requirements=None)
    wheel = tmp_path / "job" / record["wheel"]
    data = bytearray(wheel.read_bytes())
    data[100] ^= 1
    wheel.write_bytes(bytes(data))
    directory = tmp_path / "pod" / "environment"
    done = run_bootstrap(storage.uri, directory, "python", "-c", "print('the agent ran')",
                         extra=offline_pip(wheelhouse))
    assert done.returncode == 1 and "the agent ran" not in done.stdout
    assert done.stderr.strip().splitlines()[-1] == (
        f"kinetic_nb: environment install failed: {record['wheel']} failed verification: it was not stored by "
        "this job's notebook; nothing installed")
    assert not (directory / "venv").exists() and not (directory / "inputs" / wheel.name).exists()


def test_a_rewritten_install_record_is_refused(tmp_path, wheelhouse):
    storage = open_storage(f"file://{tmp_path}/job")
    environment.store_environment(storage, KEY, requirements=None)
    storage.write_bytes(protocol.ENVIRONMENT_INSTALL, b'{"wheel": "environment/evil.whl", "packages": ["evil"]}')
    done = run_bootstrap(storage.uri, tmp_path / "env", "true", extra=offline_pip(wheelhouse))
    assert done.returncode == 1 and "environment/install.json carries no signature" in done.stderr


def test_a_bootstrap_run_by_a_virtual_environments_python_keeps_its_packages_visible(tmp_path, wheelhouse):
    """An ssh host's ``--ssh-python ~/venv/bin/python`` (or an image whose python3 is a venv's): the environment
    kinetic_nb keeps sees that venv's packages (here this test's, psutil among them), after its own kinetic_nb."""
    storage = open_storage(f"file://{tmp_path}/job")
    environment.store_environment(storage, KEY, requirements=None)
    probe = "import json, kinetic_nb, psutil; print(json.dumps([kinetic_nb.__file__, psutil.__file__]))"
    done = run_bootstrap(storage.uri, tmp_path / "env", "python", "-c", probe, extra=offline_pip(wheelhouse),
                         python=sys.executable)
    assert done.returncode == 0, done.stderr + done.stdout
    ours, theirs = json.loads(done.stdout.splitlines()[-1])
    assert ours.startswith(str(tmp_path / "env" / "venv"))  # the wheel's, not this checkout's
    assert theirs.startswith(sys.prefix)  # the outer venv's own


def test_the_bootstrap_reads_gs_storage(gcs_root, wheelhouse, tmp_path):
    storage = open_storage(f"{gcs_root}/job")
    record = environment.store_environment(storage, KEY, requirements=b"kinetic_probe_requirement\n")
    assert "google-cloud-storage>=3.2" in record["packages"]  # the pods reach gs:// with the official client
    done = run_bootstrap(storage.uri, tmp_path / "env", "python", "-c", "import kinetic_nb; print('ok')",
                         options=("--no-requirements",),
                         extra={**offline_pip(wheelhouse), "STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"],
                                # offline, the gcs packages cannot be installed: only kinetic_nb's own here
                                "PIP_FIND_LINKS": str(wheelhouse)})
    # google-cloud-storage is not in the offline wheelhouse: pip says so, after verification passed.
    assert done.returncode == 1 and "google-cloud-storage" in done.stdout
    assert f"Successfully installed kinetic-nb-{kinetic_nb.__version__}" in done.stdout


@pytest.mark.parametrize("where", ["file", "gs"])
def test_an_install_that_fails_on_every_start_records_the_hosts_end_and_parks(where, gcs_root, wheelhouse, tmp_path):
    """A LeaderWorkerSet pod's failed install is restarted by the kubelet for ever, holding its slice: on the
    start after MAX_STARTS failed ones, the bootstrap records the host's end, sealed under the job's key (a
    record every reader verifies), with the last error, and parks instead of failing again. A later start of a
    host whose install had succeeded is no loop."""
    storage = open_storage(f"file://{tmp_path}/job" if where == "file" else f"{gcs_root}/job")
    environment.store_environment(storage, KEY, requirements=b"no-such-package-anywhere\n")
    extra = {**offline_pip(wheelhouse), "KINETIC_HOST_INDEX": "1",
             **({"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]} if where == "gs" else {})}
    for start in range(bootstrap.MAX_STARTS):
        done = run_bootstrap(storage.uri, tmp_path / "env", "true", extra=extra)
        assert done.returncode == 1 and "environment install failed" in done.stderr, (start, done.stderr)
        assert read_exit(storage, KEY, 1) is None
    command, options = _bootstrap_command(storage.uri, tmp_path / "env", extra)
    parked = subprocess.Popen(command, **options, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: read_exit(storage, KEY, 1) is not None, timeout=60, what="the host's recorded end")
        assert parked.poll() is None  # parked, not failing again for the kubelet to restart
    finally:
        parked.terminate()
        parked.wait(timeout=10)
    summary = read_exit(storage, KEY, 1)
    assert summary.failed and summary.exit_code == 1
    assert summary.reason.startswith(f"a crash loop: its environment install failed on each of its "
                                     f"{bootstrap.MAX_STARTS} starts; the last: python -m pip install ... exited "
                                     "with code 1: ERROR: ")
    # pip's own words (offline, on gs:// the storage client is missing first; else the requirement)
    assert "ERROR: No matching distribution found for " in summary.stderr_tail[-1]


def _bootstrap_command(job_uri, directory, extra):
    key_file = directory.parent / "job-key"
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), bootstrap.KEY_FILE_ENV: str(key_file),
           bootstrap.JOB_URI_ENV: job_uri, bootstrap.DIRECTORY_ENV: str(directory), **extra}
    return [IMAGE_PYTHON, "-c", environment.bootstrap_source(), "--", "true"], {"env": env, "cwd": directory.anchor}


# -- the whole path, pods played by FakeKubelet --------------------------------------------------


@pytest.fixture
def prebuilt_cluster(monkeypatch, tmp_path, wheelhouse):
    api = FakeKubernetes()
    monkeypatch.setattr(k8s, "connect", lambda settings: api)
    monkeypatch.delenv("KINETIC_IMAGE", raising=False)
    monkeypatch.setenv("KINETIC_NAMESPACE", NAMESPACE)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("kinetic_probe_requirement\n")
    monkeypatch.setenv("KINETIC_REQUIREMENTS", str(requirements))
    kubelets: list[FakeKubelet] = []

    def start_pods() -> FakeKubelet:
        owner = workload(api.objects.values())
        (tmp_path / "pods").mkdir(exist_ok=True)
        kubelet = FakeKubelet(pods_for([owner]), str(tmp_path / "pods"), secrets=api.secret_value,
                              image_pythonpath=None, scratch_dir=str(tmp_path / "scratch"),
                              extra_env=offline_pip(wheelhouse))
        kubelets.append(kubelet)
        api.pod_source = kubelet.pod_json
        api.on_delete.append(kubelet.collect_with(owner["kind"], owner["metadata"]["name"]))
        kubelet.start()
        return kubelet

    yield api, start_pods
    for kubelet in kubelets:
        kubelet.close()


def test_a_prebuilt_job_installs_then_runs_and_shows_the_install(prebuilt_cluster, tmp_path):
    api, start_pods = prebuilt_cluster
    source = "import kinetic_nb, kinetic_probe_requirement\nkinetic_nb.__file__"
    handle = kinetic_nb.submit(source, hosts=2, backend="kubernetes", storage=f"file://{tmp_path}/jobs",
                               quiet=True, keep=True)
    [job] = [job for job in api.created("Job") if job["metadata"]["name"].endswith("-root") is False]
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == stock_image()
    kubelet = start_pods()
    wait_for(lambda: (kubelet.step(), handle.backend.exit_summaries(handle.storage, handle.plan,
                                                                    handle.storage.list(), handle.key))[1].keys() == {0, 1},
             timeout=240, what="both hosts to end")
    assert handle.result(timeout=30).startswith(str(tmp_path / "scratch" / "pod-0" / "environment" / "venv"))
    for host in handle.hosts():
        assert host.history[0][0] == "environment install"
        assert [phase for phase, _ in host.history][1:3] == ["startup", "plan check"]
        log = handle.logs(host.index)
        assert f"{bootstrap.PREFIX}Successfully installed" in log
        assert log.index(bootstrap.PREFIX) == 0  # the install's output comes first in the host's log


def test_a_session_installs_its_environment_once(prebuilt_cluster, tmp_path):
    api, start_pods = prebuilt_cluster
    started: dict = {}
    thread = threading.Thread(target=lambda: started.setdefault("session", kinetic_nb.start(
        hosts=2, backend="kubernetes", storage=f"file://{tmp_path}/sessions", framework="none", quiet=True,
        echo=False, ready_timeout=240)))
    thread.start()
    wait_for(lambda: any(kind != "Secret" and not name.endswith("-root") for kind, name in api.objects),
             what="the session's workload")
    kubelet = start_pods()
    thread.join(timeout=250)
    session = started["session"]
    try:
        for cell in range(3):
            assert session.run(f"import kinetic_probe_requirement\n{cell}").result(timeout=60) == cell
        records = [tmp_path / "scratch" / f"pod-{index}" / "environment" / "record.json" for index in (0, 1)]
        assert all(record.exists() for record in records)
        assert all(kubelet.runs[index] == 1 for index in (0, 1))  # one container start, so one install
        assert kubelet.output(0).count(f"{bootstrap.PREFIX}Successfully installed kinetic-nb") == 1
    finally:
        session.stop()
    wait_for(lambda: (kubelet.step(), all(process.poll() is not None for process in kubelet.processes.values()))[1],
             timeout=60, what="the session's pods to end")


def test_with_no_client_a_crash_looping_slice_ends_after_its_hosts_record_the_loop(prebuilt_cluster, tmp_path):
    """No notebook watches a LeaderWorkerSet whose install fails on every start (an offline pip here, a private
    cluster with no route to the index there): the kubelet restarts each pod's container (restartPolicy: Always);
    on the start after MAX_STARTS failed ones each host records its end, and the root's watcher then finds
    every host ended: the root completes and the cluster lets the slice go, with the reason in each host's
    record, where %kinetic jobs and attach read it."""
    from kinetic_nb.agent.watch import job_has_ended
    from kinetic_nb.client.launch import launch_hosts
    from kinetic_nb.client.plan import new_job_id, resolve_slice
    from kinetic_nb.runner.job_keys import SESSION

    _, start_pods = prebuilt_cluster
    (tmp_path / "requirements.txt").write_text("no-such-package-anywhere\n")
    acc, hosts = resolve_slice(None, "tpu-v6e-2x4")
    # Launched as a session's hosts are, with no client after it: nothing polls the pods or writes their ends.
    group = launch_hosts(new_job_id("ks"), SESSION, open_storage(f"file://{tmp_path}/jobs"),
                         k8s.KubernetesBackend.from_options(), acc, hosts, framework="none", env={}, quiet=True)
    kubelet = start_pods()

    def both_recorded() -> bool:
        kubelet.step()  # the kubelet restarts what ended; nothing else looks at the job
        return all(read_exit(group.storage, group.key, index) is not None for index in range(hosts))

    wait_for(both_recorded, timeout=240, what="both hosts to record their crash loop")
    assert all(kubelet.runs[index] == bootstrap.MAX_STARTS + 1 for index in range(hosts))
    for index in range(hosts):
        assert read_exit(group.storage, group.key, index).reason.startswith("a crash loop: ")
    assert job_has_ended(group.storage, group.plan, group.key)  # the root's watcher returns: the job ends
    group.backend.cleanup(group.plan)
