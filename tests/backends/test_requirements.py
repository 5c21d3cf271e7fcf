"""``--requirements FILE`` as the pods install it: lines only this machine can satisfy are refused in preflight.

Each refusal is one line naming the file, the line number and why; local
``-r`` includes are inlined (and checked the same way); a file with nothing
to inline reaches the pods byte for byte.
"""

from __future__ import annotations

import re

import pytest

from kinetic_nb.backends.base import JobSecrets
from kinetic_nb.backends.host_environment import REQUIREMENTS_OBJECT
from kinetic_nb.backends.kubernetes.backend import KubernetesBackend
from kinetic_nb.backends.kubernetes.settings import KubernetesSettings
from kinetic_nb.backends.requirements import framework_requirement, host_requirements
from kinetic_nb.runner.envelope import read_sealed
from kinetic_nb.storage import open_storage

from .k8s_cluster import FakeKubernetes
from .test_kubernetes_manifests import job_plan

KEY = bytes(range(32))

#: line -> the end of its refusal (after "FILE, line N: 'LINE' ").
REFUSED = {
    "-e ./mypkg": "is an editable install of a directory on this machine",
    "--editable=/home/me/src/lib": "is an editable install of a directory on this machine",
    "-e file:///home/me/lib": "names a file: URL on this machine",
    "./pkg": "is a path on this machine",
    "../sibling/pkg": "is a path on this machine",
    "/abs/path/to/pkg": "is a path on this machine",
    "~/src/pkg": "is a path on this machine",
    "dist/mylib-1.0-py3-none-any.whl": "is a path on this machine",
    "mylib-1.0.tar.gz": "is a path on this machine",
    "file:///home/me/mylib": "names a file: URL on this machine",
    "mylib @ file:///home/me/mylib": "names a file: URL on this machine",
    "mylib @ ./mylib": "is a direct reference to a path on this machine",
    "-c constraints.txt": "names a constraints file on this machine",
    "--constraint=/etc/pins.txt": "names a constraints file on this machine",
    "--find-links ./wheels": "names a wheel directory on this machine",
    "--index-url file:///srv/simple": "names a file: URL on this machine",
}
#: Lines a pod can install from the network, and pip options it reads on its own.
ACCEPTED = [
    "jax[tpu]>=0.4.30 ; python_version >= '3.10'",
    "numpy==1.26.4 --hash=sha256:0123456789abcdef",
    "git+https://github.com/google/flax@v0.8.0#egg=flax",
    "-e git+https://github.com/me/lib.git#egg=lib",
    "mylib @ https://example.com/mylib-1.0-py3-none-any.whl",
    "https://example.com/mylib-1.0.tar.gz",
    "-r https://example.com/base-requirements.txt",
    "-c https://example.com/constraints.txt",
    "--find-links https://storage.googleapis.com/jax-releases/libtpu_releases.html",
    "--extra-index-url https://download.pytorch.org/whl/cpu",
    "--pre",
    "# ./a comment naming a path",
    "torch==2.13.0  # pinned: ./not a path, a comment",
]


@pytest.mark.parametrize("line", REFUSED)
def test_a_line_a_pod_cannot_satisfy_is_refused_in_one_line_naming_the_file_and_line(tmp_path, line):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"jax[tpu]\n\n{line}\nnumpy\n")
    with pytest.raises(ValueError, match=r"requirements\.txt, line 3: ") as caught:
        host_requirements(requirements)
    message = str(caught.value)
    assert message.startswith(f"{requirements}, line 3: {line!r} {REFUSED[line]}"), message
    assert "\n" not in message


def test_lines_a_pod_can_satisfy_pass_and_reach_the_pods_byte_for_byte(tmp_path):
    requirements = tmp_path / "requirements.txt"
    data = ("\n".join(ACCEPTED) + "\r\nscipy \\\n    >=1.11\n").encode()
    requirements.write_bytes(data)
    assert host_requirements(requirements) == data


def test_a_continued_line_is_judged_whole_and_named_by_its_first_line(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("jax\n-e \\\n  ./mypkg\n")
    with pytest.raises(ValueError, match=r"requirements\.txt, line 2: '-e   ./mypkg' is an editable install"):
        host_requirements(requirements)


def test_local_includes_are_inlined_relative_to_the_including_file_and_checked_alike(tmp_path):
    (tmp_path / "deps").mkdir()
    (tmp_path / "deps" / "base.txt").write_text("numpy\n-r more/extra.txt\n")
    (tmp_path / "deps" / "more").mkdir()
    (tmp_path / "deps" / "more" / "extra.txt").write_text("scipy")  # no final newline
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("jax\n-r deps/base.txt\n--requirement=https://example.com/r.txt\nflax\n")
    text = host_requirements(requirements).decode()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines == ["jax", "numpy", "scipy", "--requirement=https://example.com/r.txt", "flax"]
    assert "# -r deps/base.txt: inlined by kinetic_nb" in text

    (tmp_path / "deps" / "more" / "extra.txt").write_text("scipy\n./vendored/lib\n")
    with pytest.raises(ValueError, match="is a path on this machine") as caught:
        host_requirements(requirements)
    assert str(caught.value).startswith(f"{tmp_path}/deps/more/extra.txt, line 2: './vendored/lib' is a path on "
                                        "this machine")


def test_an_include_that_cannot_be_read_or_goes_round_in_a_circle_is_named(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("jax\n-r missing.txt\n")
    with pytest.raises(ValueError, match="cannot read") as caught:
        host_requirements(requirements)
    assert str(caught.value) == (f"{requirements}, line 2: cannot read the requirements file {tmp_path}/missing.txt: "
                                 "No such file or directory")
    (tmp_path / "other.txt").write_text("-r requirements.txt\n")
    requirements.write_text("-r other.txt\n")
    with pytest.raises(ValueError, match=r"other\.txt, line 1: '-r requirements\.txt' includes .*requirements\.txt "
                                         r"again: the includes go round in a circle$"):
        host_requirements(requirements)


def test_a_missing_or_binary_file_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^cannot read the requirements file .*nowhere\.txt: No such file"):
        host_requirements(tmp_path / "nowhere.txt")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00jax")
    with pytest.raises(ValueError, match=r"binary\.txt is not UTF-8 text$"):
        host_requirements(tmp_path / "binary.txt")


@pytest.mark.parametrize("mode", ["prebuilt", "build"])
def test_preflight_refuses_the_file_before_anything_is_stored_or_built(tmp_path, mode):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("jax[tpu]\n-e .\n")
    api = FakeKubernetes()
    settings = KubernetesSettings(image_mode=mode, requirements=str(requirements),
                                  registry="us-docker.pkg.dev/p/kinetic" if mode == "build" else None)
    backend = KubernetesBackend(settings, api=api)
    with pytest.raises(ValueError, match=r"requirements\.txt, line 2: '-e \.' is an editable install"):
        backend.preflight(job_plan("cpu-2-hosts"))  # the build mode fails here before any Cloud Build call
    assert api.calls == []


def test_the_pods_get_the_inlined_file(tmp_path):
    (tmp_path / "base.txt").write_text("numpy\n")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("-r base.txt\njax\n")
    settings = KubernetesSettings(image_mode="prebuilt", requirements=str(requirements))
    backend = KubernetesBackend(settings, api=FakeKubernetes())
    plan = job_plan("cpu-2-hosts")
    backend.preflight(plan)
    storage = open_storage(f"file://{tmp_path}/jobs").child(plan.job_id)
    with pytest.warns(UserWarning, match="is local to this machine"):
        backend.launch(storage, plan, JobSecrets(key=KEY, env={}))
    stored = read_sealed(storage, REQUIREMENTS_OBJECT, KEY).decode()
    assert [line for line in stored.splitlines() if not line.startswith("#")] == ["numpy", "jax"]


# -- the cell's framework, by default -------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "framework", "requirements", "added"), [
    ("tpu", "jax", None, "jax[tpu]=={jax}"),
    ("tpu", "auto", None, "jax[tpu]=={jax}"),  # a session whose first cell picks: JAX on TPUs
    ("gpu", "jax", b"numpy\n", "jax[cuda12]=={jax}"),
    ("gpu", "torch", None, "torch=={torch}"),  # no local build tag: the index's CUDA build at that version
    ("tpu", "jax", b"JAX[tpu]>=0.4.30  # mine\n", None),  # named already (any case, any extra): theirs
    ("gpu", "torch", b"-r more.txt\nTorch==2.5.1\n", None),
    ("tpu", "torch", None, None),  # torch_xla has no version to match: left to --requirements
    ("cpu", "jax", None, None),
    ("gpu", "none", None, None),
])
def test_the_pods_install_the_cells_framework_for_the_accelerator_at_the_notebooks_version(
        kind, framework, requirements, added):
    from kinetic_nb.runner.versions import installed_version

    versions = {name: (installed_version(name) or "").split("+")[0] for name in ("jax", "torch")}
    expected = added.format(**versions) if added else None
    assert framework_requirement(kind, framework, requirements) == expected


@pytest.mark.parametrize("mode", ["prebuilt", "custom"])
def test_a_tpu_jobs_pods_get_jax_tpu_and_the_launch_says_so(tmp_path, mode, capsys):
    """In the prebuilt mode the stored requirements end with the framework's line and the launch's notice says
    what it added; in the custom mode the image is as it is (the doctor warns instead)."""
    import kinetic_nb

    requirements = tmp_path / "requirements.txt"
    requirements.write_text("numpy\n")
    api = FakeKubernetes()
    settings = KubernetesSettings(namespace="ml-team", image_mode=mode,
                                  requirements=str(requirements) if mode == "prebuilt" else None,
                                  image="img:1" if mode == "custom" else None)
    backend = KubernetesBackend(settings, api=api)
    with pytest.warns(UserWarning, match="is local to this machine"):
        handle = kinetic_nb.submit("1", accelerator="tpu-v5e-16", framework="jax", backend=backend,
                                   storage=f"file://{tmp_path}/jobs", keep=True)
    line = framework_requirement("tpu", "jax", None)
    notices = [text for text in capsys.readouterr().out.splitlines() if text.startswith("kinetic_nb: ")]
    if mode == "prebuilt":
        stored = read_sealed(handle.storage, REQUIREMENTS_OBJECT, handle.key).decode().splitlines()
        assert stored == ["numpy", line]
        assert (f"kinetic_nb: the pods install {line} for tpu-v5e-16 (this notebook's version); name jax in "
                "--requirements to choose another") in notices
        # A one-shot job's pods are new each time: the way to install once is said with it.
        assert ("kinetic_nb: each one-shot job's pods install it again (minutes a cell): a session (%kinetic start) "
                "installs it once for all its cells, and --image-mode build once for good") in notices
    else:
        assert not handle.storage.exists(REQUIREMENTS_OBJECT)
        assert not any("the pods install" in text for text in notices)
        assert not any("install it again" in text for text in notices)
    handle.cancel()  # its poller stops with it


@pytest.mark.parametrize(("version", "refused"), [
    ("0.4.30", True), ("0.4.38", True), ("0.5.0", True), ("0.5.0rc1", True),
    ("0.5.1", False), ("0.6.0+local", False), ("0.10.2", False),
])
def test_a_jax_whose_tpu_build_the_index_cannot_install_is_refused_in_one_line(monkeypatch, version, refused):
    """jax[tpu] 0.4.30-0.5.0 pin a libtpu-nightly the index does not hold: the hosts' install would fail after
    minutes; it is refused before anything starts, saying which JAX works."""
    from kinetic_nb.errors import KineticError
    from kinetic_nb.runner import versions

    monkeypatch.setattr(versions, "installed_version", lambda name: version if name == "jax" else None)
    if refused:
        with pytest.raises(KineticError, match=rf"^this notebook's JAX {re.escape(version)} cannot be installed on "
                                               r"TPU hosts .* use JAX 0\.5\.1 or later"):
            framework_requirement("tpu", "jax", None)
    else:
        assert framework_requirement("tpu", "jax", None) == f"jax[tpu]=={version.split('+')[0]}"
    assert framework_requirement("tpu", "jax", b"jax[tpu]==0.4.30\n-f ./wheels\n") is None  # theirs, as named
    assert framework_requirement("gpu", "jax", None) == f"jax[cuda12]=={version.split('+')[0]}"  # GPUs are fine

