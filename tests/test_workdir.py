"""The notebook's folder on hosts that do not share its disk: packed here (``shipping.workdir``), unpacked and
entered there (``runner.workdir``); what is left out, the limits, and what is refused."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile

import pytest

from kinetic_nb.errors import IntegrityError, PlanError
from kinetic_nb.runner import protocol
from kinetic_nb.runner.envelope import write_sealed
from kinetic_nb.shipping import workdir as packing
from kinetic_nb.shipping.workdir import pack_folder
from kinetic_nb.storage import LocalStorage

KEY = bytes(range(32))


def names(packed) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(packed.data)).namelist()


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
    packed = pack_folder(tmp_path)
    assert names(packed) == [".kineticignore", "config.yaml", "mylib/__init__.py"]
    assert (packed.files, packed.too_large) == (3, ())
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
    monkeypatch.setattr(packing, "MAX_FILES", 2)  # a notebook started in a home directory: refused, not walked
    (tmp_path / "c.py").unlink()
    (tmp_path / "more").mkdir()
    for index in range(3):
        (tmp_path / "more" / f"{index}.py").write_text("")
    with pytest.raises(ValueError, match=r"has more than 2 files to send to the hosts: name what"):
        pack_folder(tmp_path)


def _host(storage, job_dir, *code: str) -> subprocess.CompletedProcess:
    """A fresh process (a host) that enters the stored folder, then runs ``code``."""
    program = ("import sys\nfrom kinetic_nb.runner.workdir import enter_workdir\n"
               "from kinetic_nb.storage import LocalStorage\n"
               f"where = enter_workdir(LocalStorage({str(job_dir)!r}), bytes(range(32)), {protocol.WORKDIR!r}, 'kn-x')\n"
               + "\n".join(code))
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd="/", timeout=60)


def test_a_host_runs_in_its_copy_of_the_folder_with_it_first_on_sys_path(tmp_path):
    folder = tmp_path / "notebook"
    (folder / "mylib").mkdir(parents=True)
    (folder / "mylib" / "__init__.py").write_text("VALUE = 41\n")
    (folder / "config.yaml").write_text("lr: 0.1\n")
    storage = LocalStorage(str(tmp_path / "job"))
    write_sealed(storage, protocol.WORKDIR, KEY, pack_folder(folder).data)
    ran = _host(storage, tmp_path / "job", "import os, mylib", "print(mylib.VALUE + 1, open('config.yaml').read().strip(),"
                " os.getcwd() == where, sys.path[0] == where)")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["42", "lr:", "0.1", "True", "True"]


def test_a_folder_not_sealed_by_this_job_or_naming_a_path_outside_is_refused(tmp_path):
    from kinetic_nb.runner.workdir import enter_workdir

    storage = LocalStorage(str(tmp_path / "job"))
    write_sealed(storage, protocol.WORKDIR, bytes(32), b"sealed under another key")
    with pytest.raises(IntegrityError):
        enter_workdir(storage, KEY, protocol.WORKDIR, "kn-x")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("../escaped.py", "x = 1\n")
    write_sealed(storage, protocol.WORKDIR, KEY, buffer.getvalue())
    here = os.getcwd()
    with pytest.raises(PlanError, match=r"names '\.\./escaped\.py', outside the folder: refused"):
        enter_workdir(storage, KEY, protocol.WORKDIR, "kn-x")
    assert os.getcwd() == here and not (tmp_path / "escaped.py").exists()
