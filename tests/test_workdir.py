"""The notebook's folder on hosts that do not share its disk: packed here (``shipping.workdir``), unpacked and
entered there (``runner.workdir``); what is left out (credentials, kinetic_nb's own keys, a home directory's
unnamed files), how files are read (as walked, never through a link, never waiting on a FIFO), the limits, and
what a host refuses (an archive another key made, a path outside, a zip bomb, a planted giant)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

from kinetic_nb.errors import IntegrityError, PlanError
from kinetic_nb.runner import encryption, protocol
from kinetic_nb.runner import workdir as unpacking
from kinetic_nb.runner.envelope import write_sealed
from kinetic_nb.runner.workdir import enter_workdir, store_workdir
from kinetic_nb.shipping import workdir as packing
from kinetic_nb.shipping.workdir import Unread, pack_folder, read_regular_file
from kinetic_nb.storage import LocalStorage

KEY = bytes(range(32))
#: A packing or host that would hang (on a FIFO) fails the test after this long instead.
HANG_S = 60


def names(packed) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(packed.data)).namelist()


def contents(packed) -> dict[str, bytes]:
    archive = zipfile.ZipFile(io.BytesIO(packed.data))
    return {name: archive.read(name) for name in archive.namelist()}


def write(root, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())


def test_modules_and_small_files_travel_and_caches_environments_and_ignored_files_do_not(tmp_path):
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / "__init__.py").write_text("VALUE = 41\n")
    (tmp_path / "config.yaml").write_text("lr: 0.1\n")
    for ignored in (".git/HEAD", "__pycache__/x.pyc", ".venv/bin/python", "mylib/__pycache__/y.pyc",
                    ".ipynb_checkpoints/a.ipynb", "data/raw/big.csv", "scratch.tmp", "keep/scratch.tmp"):
        (tmp_path / ignored).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / ignored).write_text("x")
    (tmp_path / ".kineticignore").write_text("# what the hosts need not get\ndata/\n*.tmp\n")
    (tmp_path / "link.py").symlink_to(tmp_path / "config.yaml")
    os.mkfifo(tmp_path / "pipe")
    packed = pack_folder(tmp_path)
    assert names(packed) == [".kineticignore", "config.yaml", "mylib/__init__.py"]
    assert (packed.files, packed.too_large, packed.credentials, packed.home) == (3, (), (), False)
    assert pack_folder(tmp_path).data == packed.data  # the same files, the same bytes


def test_a_file_over_the_cap_stays_behind_and_is_named_and_a_folder_over_the_total_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(packing, "MAX_FILE_BYTES", 1000)
    monkeypatch.setattr(packing, "MAX_TOTAL_BYTES", 2500)
    (tmp_path / "weights.bin").write_bytes(b"w" * 5000)
    (tmp_path / "a.py").write_bytes(b"a" * 900)
    packed = pack_folder(tmp_path)
    assert names(packed) == ["a.py"] and packed.too_large == ("weights.bin (4.9 KiB)",)
    assert "left out for being over 1000 B: weights.bin (4.9 KiB)" in packed.notice(str(tmp_path))
    for name in ("b.py", "c.py"):
        (tmp_path / name).write_bytes(b"b" * 900)
    with pytest.raises(ValueError, match=r"to send to the hosts, over 2\.4 KiB") as caught:
        pack_folder(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"this notebook's folder {tmp_path} has 2.6 KiB to send")
    assert str(tmp_path / ".kineticignore") in message and "(900 B)" in message
    monkeypatch.setattr(packing, "MAX_FILES", 2)  # a large tree: refused at once, not walked to the end
    (tmp_path / "c.py").unlink()
    (tmp_path / "more").mkdir()
    for index in range(3):
        (tmp_path / "more" / f"{index}.py").write_text("")
    with pytest.raises(ValueError, match=r"has more than 2 files to send to the hosts: name what"):
        pack_folder(tmp_path)


CREDENTIAL_FILES = {
    ".ssh/id_ed25519": "ssh key", ".ssh/config": "Host *", ".aws/credentials": "aws", ".config/gcloud/adc.json": "g",
    ".config/gh/hosts.yml": "gh", ".kube/config": "kube", ".docker/config.json": "docker", ".netrc": "netrc",
    ".git-credentials": "git", ".pypirc": "pypi", ".npmrc": "npm", ".pgpass": "pg", ".vault-token": "vault",
    ".env": "A=1", ".env.production": "A=2", "proj/secret.pem": "pem", "proj/tls.key": "key",
    "proj/id_rsa.pub": "pub", "proj/cert.p12": "p12", "proj/credentials.json": "cred",
    "proj/application_default_credentials.json": "adc", "deep/er/.aws/config": "aws",
    "proj/.config/gcloud/credentials.db": "db",
}


def test_credentials_and_kinetic_nbs_own_keys_are_never_shipped_and_the_notice_names_them(tmp_path, monkeypatch):
    """Wherever they lie in the folder; kinetic_nb's cache even when .kineticinclude names it."""
    folder = tmp_path / "notebook"
    write(folder, {**CREDENTIAL_FILES, "mylib.py": "VALUE = 1\n", "proj/train.py": "pass\n"})
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / "cache"))  # this user's keys, inside the folder
    write(folder, {"cache/kinetic_nb/keys/kn-1.kye": "0" * 64, "cache/kinetic_nb/jobs/kn-1/plan.json": "{}"})
    (folder / ".kineticinclude").write_text("/cache/\ncache/kinetic_nb/keys/kn-1.kye\n")
    packed = pack_folder(folder)
    assert names(packed) == [".kineticinclude", "mylib.py", "proj/train.py"]
    assert sorted(packed.credentials) == sorted(
        [".aws/", ".config/gcloud/", ".config/gh/", ".docker/", ".env", ".env.production", ".git-credentials",
         ".kube/", ".netrc", ".npmrc", ".pgpass", ".pypirc", ".ssh/", ".vault-token", "cache/kinetic_nb/",
         "deep/er/.aws/", "proj/.config/gcloud/", "proj/application_default_credentials.json", "proj/cert.p12",
         "proj/credentials.json", "proj/id_rsa.pub", "proj/secret.pem", "proj/tls.key"])
    notice = packed.notice(str(folder))
    assert "\n" not in notice
    assert f"; left out as credentials: {', '.join(packed.credentials[:3])} and {len(packed.credentials) - 3} more " \
           f"(to ship one on purpose, name it in {folder / '.kineticinclude'})" in notice


def test_kineticinclude_ships_a_credential_it_names_but_not_one_below_a_folder_it_names(tmp_path):
    write(tmp_path, {**CREDENTIAL_FILES, "proj/train.py": "pass\n"})
    (tmp_path / ".kineticinclude").write_text("# shipped on purpose\n.env.production\nproj/\n.aws/\n*.p12\n")
    packed = pack_folder(tmp_path)
    assert names(packed) == [".aws/credentials", ".env.production", ".kineticinclude", "deep/er/.aws/config",
                             "proj/cert.p12", "proj/train.py"]  # .aws/ names a folder at any depth
    assert "proj/secret.pem" in packed.credentials and ".ssh/id_ed25519" in packed.credentials  # proj/ is above


def test_a_home_directory_ships_only_what_kineticinclude_names(tmp_path, monkeypatch):
    home = tmp_path / "home" / "me"
    write(home, {**CREDENTIAL_FILES, "mylib.py": "VALUE = 1\n", "proj/train.py": "pass\n", "notes.txt": "n"})
    monkeypatch.setenv("HOME", str(home))
    for folder in (home, home.parent, tmp_path, home / ".aws"):  # home, a folder above it, a credentials folder
        packed = pack_folder(folder)
        assert (names(packed), packed.home, packed.credentials) == ([], True, ())
        assert packed.notice(str(folder)) == (
            f"this notebook's folder {folder} is where credentials live (a home directory, a folder above one, or a "
            f"credentials folder): the hosts get only what {folder / '.kineticinclude'} names, one pattern a line "
            "(nothing now)")
    (home / ".kineticinclude").write_text("mylib.py\nproj/\n")
    packed = pack_folder(home)
    assert names(packed) == ["mylib.py", "proj/train.py"]
    assert set(packed.credentials) == {"proj/application_default_credentials.json", "proj/cert.p12",
                                       "proj/credentials.json", "proj/id_rsa.pub", "proj/secret.pem", "proj/tls.key",
                                       "proj/.config/gcloud/credentials.db"}  # proj/ is above them: left out
    assert "(2 files, " in packed.notice(str(home))


def _pack_in_a_child(folder, code: str = "") -> subprocess.CompletedProcess:
    """Pack ``folder`` in a fresh process (one that hangs on a FIFO is killed, failing the test), after ``code``;
    prints the names packed, then the notice."""
    program = "\n".join(["import io, zipfile", "from kinetic_nb.shipping import workdir as packing", code,
                         f"packed = packing.pack_folder({str(folder)!r})",
                         "print(zipfile.ZipFile(io.BytesIO(packed.data)).namelist())",
                         f"print(packed.notice({str(folder)!r}))"])
    try:
        return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"packing {folder} hung")


def test_a_file_is_read_as_walked_never_through_a_link_swapped_in_nor_waiting_on_a_fifo(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the target of a link swapped in")
    folder = tmp_path / "notebook"
    write(folder, {"a.py": "A = 1\n", "b.py": "B = 1\n", "c.py": "C = 1\n"})
    for name in ("a.py", "b.py"):  # what the walk saw, swapped for a link and a FIFO before it is read
        (folder / name).unlink()
    (folder / "a.py").symlink_to(secret)
    os.mkfifo(folder / "b.py")
    with pytest.raises(Unread, match="a symbolic link"):
        read_regular_file(folder / "a.py", 1000)
    with pytest.raises(Unread, match="not a regular file"):
        read_regular_file(folder / "b.py", 1000)
    for name in ("a.py", "b.py"):
        (folder / name).unlink()
    write(folder, {"a.py": "A = 1\n", "b.py": "B = 1\n"})  # and now swapped during a packing
    swap = textwrap.dedent(f"""
        import os
        read = packing.read_regular_file
        def swapped(name, limit, *, dir_fd=None):
            if name in ("a.py", "b.py"):
                os.unlink(name, dir_fd=dir_fd)
                if name == "a.py":
                    os.symlink({str(secret)!r}, name, dir_fd=dir_fd)
                else:
                    os.mkfifo(name, dir_fd=dir_fd)
            return read(name, limit, dir_fd=dir_fd)
        packing.read_regular_file = swapped
    """)
    ran = _pack_in_a_child(folder, swap)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[0] == "['c.py']"


def test_a_grown_file_is_read_up_to_its_cap_and_left_out(tmp_path):
    (tmp_path / "log.txt").write_bytes(b"x" * 5000)
    with pytest.raises(Unread) as caught:
        read_regular_file(tmp_path / "log.txt", 1000)
    assert caught.value.size == 5000
    assert read_regular_file(tmp_path / "log.txt", 5000) == b"x" * 5000


@pytest.mark.parametrize("kind", ["symlink", "fifo", "10 MB"])
@pytest.mark.parametrize("name", [".kineticignore", ".kineticinclude"])
def test_a_pattern_file_is_read_only_as_a_small_regular_file(tmp_path, kind, name):
    folder = tmp_path / "notebook"
    write(folder, {"mylib.py": "VALUE = 1\n", "data.csv": "1,2\n", ".env": "A=1"})
    patterns = "data.csv\n" if name == ".kineticignore" else ".env\n"
    if kind == "symlink":
        (tmp_path / "patterns").write_text(patterns)
        (folder / name).symlink_to(tmp_path / "patterns")
        why = "a symbolic link"
    elif kind == "fifo":
        os.mkfifo(folder / name)
        why = "not a regular file"
    else:
        (folder / name).write_text(patterns + "# padding\n" * (1 << 20))
        why = "over 64.0 KiB"
    ran = _pack_in_a_child(folder)
    assert ran.returncode == 0, ran.stderr
    shipped, notice = ran.stdout.splitlines()
    assert shipped == "['data.csv', 'mylib.py']"  # neither file's patterns applied; the 10 MB one not shipped
    assert f"; {folder / name} was not read ({why}): ignored" in notice


# -- the host's side -----------------------------------------------------------------------------------


def _host(job_dir, *code: str, scratch=None, before: str = "") -> subprocess.CompletedProcess:
    """A fresh process (a host) that enters the stored folder, then runs ``code``."""
    program = (f"import sys\n{before}\nfrom kinetic_nb.runner.workdir import enter_workdir\n"
               "from kinetic_nb.storage import LocalStorage\n"
               f"where = enter_workdir(LocalStorage({str(job_dir)!r}), bytes(range(32)), {protocol.WORKDIR!r}, 'kn-x')\n"
               + "\n".join(code))
    env = {**os.environ, **({unpacking.SCRATCH_DIR_ENV: str(scratch)} if scratch else {})}
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd="/", timeout=HANG_S,
                          env=env)


def test_a_host_runs_in_its_copy_of_the_folder_with_it_first_on_sys_path_below_its_agents_scratch(tmp_path):
    folder = tmp_path / "notebook"
    (folder / "mylib").mkdir(parents=True)
    (folder / "mylib" / "__init__.py").write_text("VALUE = 41\n")
    (folder / "config.yaml").write_text("lr: 0.1\n")
    storage = LocalStorage(str(tmp_path / "job"))
    store_workdir(storage, protocol.WORKDIR, KEY, pack_folder(folder).data)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    ran = _host(tmp_path / "job", "import os, mylib", "print(mylib.VALUE + 1, open('config.yaml').read().strip(),"
                " os.getcwd() == where, sys.path[0] == where, os.path.dirname(where))", scratch=scratch)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["42", "lr:", "0.1", "True", "True", str(scratch)]


def test_the_stored_folder_is_encrypted_and_a_host_without_an_agent_removes_its_copy_at_exit(tmp_path):
    folder = tmp_path / "notebook"
    marker = os.urandom(4096)  # deflate keeps it as it is: a plain archive would show it
    write(folder, {"mylib.py": "VALUE = 41\n", "weights.bin": marker})
    storage = LocalStorage(str(tmp_path / "job"))
    store_workdir(storage, protocol.WORKDIR, KEY, pack_folder(folder).data)
    stored = storage.read_bytes(protocol.WORKDIR)
    assert marker not in stored and marker[:64] not in stored and b"mylib.py" not in stored
    ran = _host(tmp_path / "job", "import mylib", "print(where, mylib.VALUE)")
    assert ran.returncode == 0, ran.stderr
    where, value = ran.stdout.split()
    assert value == "41" and not os.path.exists(where)


def test_a_folder_not_sealed_or_encrypted_by_this_job_or_naming_a_path_outside_is_refused(tmp_path):
    storage = LocalStorage(str(tmp_path / "job"))
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as opened:
        opened.writestr("mylib.py", "x = 1\n")
    write_sealed(storage, protocol.WORKDIR, bytes(32), encryption.encrypt(bytes(32), "workdir", protocol.WORKDIR,
                                                                          archive.getvalue()))
    with pytest.raises(IntegrityError, match="failed verification"):
        enter_workdir(storage, KEY, protocol.WORKDIR, "kn-x")
    write_sealed(storage, protocol.WORKDIR, KEY, archive.getvalue())  # sealed, not encrypted: refused
    with pytest.raises(IntegrityError, match="is not encrypted for this job"):
        enter_workdir(storage, KEY, protocol.WORKDIR, "kn-x")
    storage.delete(protocol.WORKDIR)
    escaping = io.BytesIO()
    with zipfile.ZipFile(escaping, "w") as opened:
        opened.writestr("../escaped.py", "x = 1\n")
    store_workdir(storage, protocol.WORKDIR, KEY, escaping.getvalue())
    here = os.getcwd()
    with pytest.raises(PlanError, match=r"names '\.\./escaped\.py', outside the folder: refused"):
        enter_workdir(storage, KEY, protocol.WORKDIR, "kn-x")
    assert os.getcwd() == here and not (tmp_path / "escaped.py").exists()


def _bomb(members: dict[str, int]) -> bytes:
    """A zip whose members inflate to the given sizes (zeros: a few hundred KB for 200 MB)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, size in members.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w") as member:
                for _ in range(size >> 20):
                    member.write(bytes(1 << 20))
                member.write(bytes(size & ((1 << 20) - 1)))
    return buffer.getvalue()


def test_a_zip_bomb_is_refused_with_no_more_than_a_cap_written_and_nothing_left(tmp_path):
    bomb = _bomb({"mylib.py": 200 << 20})
    assert len(bomb) < 300_000
    storage = LocalStorage(str(tmp_path / "job"))
    store_workdir(storage, protocol.WORKDIR, KEY, bomb)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    written = "int(next(l for l in open('/proc/self/io') if l.startswith('wchar')).split()[1])"
    ran = _host(tmp_path / "job", scratch=scratch, before=textwrap.dedent(f"""
        from kinetic_nb.errors import PlanError
        import kinetic_nb.runner.workdir as w
        from kinetic_nb.storage import LocalStorage
        before = {written}
        try:
            w.enter_workdir(LocalStorage({str(tmp_path / 'job')!r}), bytes(range(32)), {protocol.WORKDIR!r}, 'kn-x')
        except PlanError as error:
            print('refused', error)
        print('written', {written} - before)
        sys.exit(0)
    """))
    assert ran.returncode == 0, ran.stderr
    *refused, written_line = ran.stdout.splitlines()
    assert int(written_line.split()[1]) <= unpacking.MAX_FILE_BYTES + (1 << 20)
    assert refused == ["refused the notebook's folder holds 'mylib.py', which inflates past 10485760 bytes: refused"]
    assert list(scratch.iterdir()) == []  # nothing left on disk


def test_an_archive_over_the_count_or_the_total_is_refused_and_nothing_left(tmp_path, monkeypatch):
    storage = LocalStorage(str(tmp_path / "job"))
    monkeypatch.setenv(unpacking.SCRATCH_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(unpacking, "MAX_FILES", 3)
    store_workdir(storage, protocol.WORKDIR, KEY, _bomb({f"{index}.py": 0 for index in range(4)}))
    with pytest.raises(PlanError, match=r"^the notebook's folder holds 4 files, more than 3: refused$"):
        enter_workdir(storage, KEY, protocol.WORKDIR, "kn-x")
    monkeypatch.setattr(unpacking, "MAX_TOTAL_BYTES", 3 << 20)
    storage.delete(protocol.WORKDIR)
    store_workdir(storage, protocol.WORKDIR, KEY, _bomb({"a.py": 2 << 20, "b.py": 2 << 20}))
    with pytest.raises(PlanError, match=r"^the notebook's folder inflates past 3145728 bytes: refused$"):
        enter_workdir(storage, KEY, protocol.WORKDIR, "kn-x")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["job"]


def test_a_planted_giant_is_refused_from_its_listed_size_without_being_read(tmp_path):
    storage = LocalStorage(str(tmp_path / "job"))
    storage.write_bytes(protocol.WORKDIR, b"")
    with open(storage.local_path(protocol.WORKDIR), "r+b") as planted:
        planted.truncate(256 << 20)  # sparse: costs no disk
    ran = _host(tmp_path / "job", before=textwrap.dedent(f"""
        import resource
        from kinetic_nb.errors import IntegrityError, PlanError
        import kinetic_nb.runner.workdir as w
        from kinetic_nb.storage import LocalStorage
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            w.enter_workdir(LocalStorage({str(tmp_path / 'job')!r}), bytes(range(32)), {protocol.WORKDIR!r}, 'kn-x')
        except (IntegrityError, PlanError) as error:
            print('refused', error)
        print('grew', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
        sys.exit(0)
    """))
    assert ran.returncode == 0, ran.stderr
    refused, grew = ran.stdout.splitlines()
    assert int(grew.split()[1]) < 16 << 10  # KiB: the object was never read into memory
    assert refused.startswith(f"refused {storage.uri}/{protocol.WORKDIR} is {256 << 20} bytes, over its limit "
                              f"of {unpacking.MAX_STORED_BYTES} ") and refused.endswith(": refused, not read")
    assert unpacking.MAX_STORED_BYTES < 256 << 20
