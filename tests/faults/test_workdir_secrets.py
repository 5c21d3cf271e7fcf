"""The shipped folder carries no secret a bucket reader can take, and no host keeps a copy of it (issue 38).

Found in a review: a notebook started in the home directory (Colab's and many Jupyter servers' default) shipped
``~/.ssh`` and ``~/.cache/kinetic_nb/keys`` (every job's key) to the bucket in a signed but readable archive,
kept for a failed job's whole life; a reader of the bucket took a live session's key from it. Proven here as two
real users on a real fake-gcs-server: the victim runs a job whose cell fails (so everything stays), the
attacker reads and unpacks every object of the bucket, and none of the victim's secrets, nor any byte of the
folder's files, is in them. And the hosts' copies of the folder are gone when a job ends, when a session stops,
and after a host was killed with SIGKILL.
"""

# ruff: noqa: F811 - the two_users fixture is imported, then named by each test that uses it
from __future__ import annotations

import glob
import io
import os
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

import kinetic_nb
from kinetic_nb.backends.local import LocalBackend
from kinetic_nb.errors import KineticError
from kinetic_nb.runner import envelope, protocol
from kinetic_nb.runner.job_keys import JOB, job_key
from kinetic_nb.storage import open_storage
from tests.two_users import TwoUsers, two_users  # noqa: F401

#: How long a host's agent may take to remove its scratch after its job or session ended.
CLEANUP_TIMEOUT_S = 30.0
#: How long one cell may take (hosts start, import, run).
CELL_TIMEOUT_S = 120.0


class ShippingLocalBackend(LocalBackend):
    """The local backend, shipping the notebook's folder as a pod's, a Ray node's or an ssh host's does."""

    ships_workdir = True


def _plant(folder: Path) -> dict[str, bytes]:
    """The victim's secrets and files in ``folder``: what must never reach the bucket, by name."""
    planted = {".ssh/id_ed25519": b"-----BEGIN OPENSSH PRIVATE KEY-----\n" + os.urandom(32).hex().encode(),
               ".env": b"API_TOKEN=" + os.urandom(16).hex().encode(), "proj/secret.pem": os.urandom(48).hex().encode(),
               "weights.bin": os.urandom(4096),  # deflate keeps it as it is: a plain archive would show it
               "mylib.py": b"VALUE = 41  # " + os.urandom(16).hex().encode() + b"\n"}
    for name, content in planted.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return planted


def _victim_runs_a_failing_job(root: str, subfolder: str) -> dict:
    """As the victim: plant secrets in the notebook's folder (home, or ``home/subfolder`` holding this user's
    kinetic_nb cache), run a job whose key stays in the cache, then a job whose cell fails. Returns every secret
    and the failing cell's message."""
    os.environ.pop("KINETIC_STORAGE", None)
    folder = Path.home() / subfolder
    folder.mkdir(exist_ok=True)
    if subfolder:
        os.environ["XDG_CACHE_HOME"] = str(folder / ".cache")  # this user's keys, inside the folder
    os.chdir(folder)
    planted = _plant(folder)
    backend = ShippingLocalBackend()
    first = kinetic_nb.submit("1", hosts=1, framework="none", backend=backend, storage=root, quiet=True)
    assert first.result(timeout=CELL_TIMEOUT_S) == 1
    failing = kinetic_nb.submit("import os, sys\nimport mylib\n"
                                "raise ValueError(f'{sorted(set(os.listdir()) - {\"__pycache__\"})} {mylib.__file__}')"
                                if subfolder else "import os\nraise ValueError(f'{sorted(os.listdir())}')",
                                hosts=2, framework="none", backend=backend, storage=root, quiet=True)
    try:
        failing.result(timeout=CELL_TIMEOUT_S)
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError("the failing cell did not fail")
    keys = {}
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kinetic_nb" / "keys"
    for path in cache.glob("*.key"):
        keys[path.stem] = bytes.fromhex(path.read_text().strip())
    assert first.job_id in keys and failing.job_id in keys
    return {"planted": planted, "keys": keys, "message": message, "folder": str(folder),
            "first": first.job_id, "failing": failing.job_id}


def _attacker_reads_the_bucket(root: str) -> list[bytes]:
    """As the attacker, who may only read the bucket: every stored object, and what any of them unpacks to."""
    storage = open_storage(root)
    found = []
    for info in storage.list():
        data = storage.read_bytes(info.name)
        found.append(data)
        body = data[:-envelope.TRAILER_BYTES] if envelope.is_sealed(data) else data
        try:
            with zipfile.ZipFile(io.BytesIO(body)) as archive:
                found.extend(archive.read(name) for name in archive.namelist())
        except zipfile.BadZipFile:
            pass
    return found


def _needles(ran: dict) -> dict[str, bytes]:
    """Each secret as it could appear: files' bytes, keys raw, in hex, and bound to their jobs."""
    needles = {f"the file {name}": content for name, content in ran["planted"].items()}
    for job_id, secret in ran["keys"].items():
        bound = job_key(secret, JOB, job_id)
        needles.update({f"{job_id}'s key": secret, f"{job_id}'s key in hex": secret.hex().encode(),
                        f"{job_id}'s bound key": bytes(bound), f"{job_id}'s bound key in hex": bound.hex().encode()})
    return needles


@pytest.mark.parametrize("subfolder", ["", "work"], ids=["home", "a folder holding the cache and dotfiles"])
def test_a_bucket_reader_finds_no_secret_and_no_byte_of_the_folder(two_users: TwoUsers, gcs_root, subfolder):
    ran = two_users.victim.run(_victim_runs_a_failing_job, gcs_root, subfolder)
    stored = two_users.attacker.run(_attacker_reads_the_bucket, gcs_root)
    assert len(stored) > 10  # the attacker did read the jobs' objects
    leaked = [what for what, needle in _needles(ran).items() if any(needle in data for data in stored)]
    assert not leaked, f"in the bucket: {', '.join(leaked)}"
    if subfolder:  # the folder's modules still reach the hosts, from their own copy of it
        shipped, module = ran["message"].rsplit(" ", 1)
        assert shipped == "['mylib.py', 'weights.bin']"  # no .ssh, .env, .cache, proj/secret.pem
        assert module.endswith("/mylib.py") and not module.startswith(ran["folder"])
    else:  # a home directory ships what .kineticinclude names: nothing here
        assert ran["message"] == "[]"


# -- no copy left on the hosts -------------------------------------------------------------------------------


def _copies(job_id: str) -> list[str]:
    """What of ``job_id`` lies in this machine's temporary directory: the agent's scratch, any copy of the folder."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"kinetic-{job_id}-*"))


def _gone(path: str, job_id: str) -> None:
    deadline = time.monotonic() + CLEANUP_TIMEOUT_S
    while (os.path.exists(path) or _copies(job_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(path), f"the hosts' copy {path} is still there"
    assert not _copies(job_id), f"left behind: {_copies(job_id)}"


@pytest.fixture
def notebook_folder(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "notebook"
    folder.mkdir()
    (folder / "mylib.py").write_text("VALUE = 41\n")
    monkeypatch.chdir(folder)
    return folder


def test_no_copy_of_the_folder_is_left_once_a_job_ends(notebook_folder):
    handle = kinetic_nb.submit("import os, mylib\n(mylib.VALUE + 1, os.getcwd())", hosts=2, framework="none",
                               backend=ShippingLocalBackend(), quiet=True)
    value, where = handle.result(timeout=CELL_TIMEOUT_S)
    assert value == 42 and where != str(notebook_folder)
    _gone(where, handle.job_id)


def test_no_copy_of_the_folder_is_left_once_a_session_stops(notebook_folder):
    session = kinetic_nb.start(hosts=2, framework="none", backend=ShippingLocalBackend(), echo=False, quiet=True,
                               idle_timeout=600)
    try:
        value, where = session.run("import os, mylib\n(mylib.VALUE + 1, os.getcwd())").result(timeout=CELL_TIMEOUT_S)
        assert value == 42 and os.path.isdir(where)
    finally:
        session.stop()
    _gone(where, session.session_id)


def test_no_copy_of_the_folder_is_left_after_a_host_was_killed(notebook_folder):
    said = notebook_folder / "where.txt"
    handle = kinetic_nb.submit(f"import os, signal\nopen({str(said)!r}, 'w').write(os.getcwd())\n"
                               "os.kill(os.getpid(), signal.SIGKILL)", hosts=1, framework="none",
                               backend=ShippingLocalBackend(), quiet=True)
    with pytest.raises(KineticError, match="SIGKILL"):
        handle.result(timeout=CELL_TIMEOUT_S)
    where = said.read_text()
    assert where.startswith(tempfile.gettempdir())
    _gone(where, handle.job_id)


def test_the_stored_folder_holds_no_plaintext_of_its_files(notebook_folder, storage_root):
    marker = os.urandom(4096)
    (notebook_folder / "weights.bin").write_bytes(marker)
    handle = kinetic_nb.submit("import mylib\nmylib.VALUE", hosts=1, framework="none", keep=True,
                               backend=ShippingLocalBackend(), quiet=True)
    assert handle.result(timeout=CELL_TIMEOUT_S) == 41
    stored = open_storage(storage_root).child(handle.job_id).read_bytes(protocol.WORKDIR)
    assert marker not in stored and b"mylib.py" not in stored
