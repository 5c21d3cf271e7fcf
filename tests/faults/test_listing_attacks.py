"""Listing a shared root, tested as the attacks were found: the attacker plants, the victim lists and attaches.

Each attack runs as two real unprivileged users (``two_users``): the victim
runs ``jobs()``, ``%kinetic jobs`` and ``attach`` in a child that is killed (and
the test failed) if it does not return in time, under an address-space limit
so that a listing that reads without bound fails with ``MemoryError`` instead
of taking the machine.

A shared ``file://`` root keeps each user's jobs in ``ROOT/uid-UID/``, a 0700
directory of that user's own (``tests/faults/test_shared_root.py``), so what the
attacker plants in the shared root itself never reaches the victim's listing
(``test_what_the_attacker_plants_in_the_shared_root_is_never_listed``). Who can
still plant where a victim lists is a bucket's other writers, which have no uid:
so each attack below is planted into the victim's own listing directory by the
test (root), as the attacker's, owned by the attacker's uid, as such a writer
would leave it, and the reader must survive it all the same.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import resource
import unicodedata

import cloudpickle
import pytest

from kinetic_nb.client import catalog
from kinetic_nb.errors import IntegrityError, UnsignedJobError
from kinetic_nb.runner import protocol
from kinetic_nb.storage import open_storage

from ..two_users import two_users  # noqa: F401 - the victim, the attacker and their shared root
from .test_trust import Planted

#: A listing that has not returned by then hangs (the FIFO): the victim's child is killed and the test fails.
LIST_TIMEOUT_S = 60.0
#: Room the victim's listing gets above what its process maps already: far below a 1 GiB read or /dev/zero.
ADDRESS_SPACE_HEADROOM_BYTES = 512 * 1024 * 1024
#: How much a listing of a few small records may add to the process's peak memory.
LISTING_MEMORY_BYTES = 8 * 1024 * 1024
#: Planted by the attacker: dated 2099, and its id sorts first (the newest).
PLANTED_ID = "kn-20990101-000000-badbad"
OTHER_ID = "kn-20980101-000000-0afe00"
PLAN = {"hosts": 1, "accelerator": "cpu", "devices_per_host": 1, "framework": "none",
        "coordinator_address": "127.0.0.1:1", "barrier_timeout_s": 1, "heartbeat_timeout_s": 1,
        "shutdown_timeout_s": 1, "protocol_version": protocol.PROTOCOL_VERSION}


def handle_of(job_id: str, **fields) -> bytes:
    return json.dumps({"job_id": job_id, "backend": "local", "hosts": 1, "accelerator": "cpu",
                       "submitted_at": 4070908800.0, "status": "SUCCEEDED", **fields}).encode()


def plant_as_attacker(two_users, job_id: str, files: dict, *, directory_mode: int = 0o755) -> None:  # noqa: F811
    """Into the victim's listing directory (``uid-UID/`` of the shared root): a job of the attacker's, owned by her."""
    listing = victim_directory(two_users)
    plant(str(listing), job_id, files, directory_mode=directory_mode)
    for path in [listing / job_id, *(listing / job_id).rglob("*")] if directory_mode & 0o100 else [listing / job_id]:
        os.lchown(path, two_users.attacker.uid, two_users.attacker.uid)


def victim_directory(two_users) -> pathlib.Path:  # noqa: F811
    """Where the victim's storage keeps her jobs in the shared root: ``uid-UID/``, hers, 0700."""
    directory = two_users.shared / f"uid-{two_users.victim.uid}"
    if not directory.exists():
        directory.mkdir(mode=0o700)
        os.chown(directory, two_users.victim.uid, two_users.victim.uid)
    return directory


def plant(shared: str, job_id: str, files: dict, *, directory_mode: int = 0o755) -> None:
    """As the attacker: a job directory everyone may read (unless ``directory_mode`` says otherwise)."""
    job = pathlib.Path(shared, job_id)
    job.mkdir(mode=0o755)
    for name, content in files.items():
        path = job / name
        if callable(content):
            content(path)
        else:
            path.write_bytes(content)
            path.chmod(0o644)
    job.chmod(directory_mode)


def limited_memory() -> None:
    """Cap this process's address space a little above what it maps now."""
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + ADDRESS_SPACE_HEADROOM_BYTES, resource.RLIM_INFINITY))


def list_and_print(root: str) -> tuple[list[catalog.JobRecord], str, str | None, int]:
    """As the victim: ``jobs()``, what ``%kinetic jobs`` prints, its error if any, and the peak memory it added."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "kinetic_nb")
    limited_memory()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    records = catalog.jobs(storage=root)
    added = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = shell.run_cell(f"%kinetic jobs --storage {root}")
    error = result.error_in_exec
    return records, printed.getvalue(), None if error is None else f"{type(error).__name__}: {error}", added


def victim_lists(two_users, root: str) -> tuple[dict[str, catalog.JobRecord], list[str]]:  # noqa: F811
    records, printed, error, _ = two_users.victim.run(list_and_print, root, timeout=LIST_TIMEOUT_S)
    assert error is None
    rows = printed.splitlines()[1:]
    assert all(not unicodedata.category(char).startswith("C") for row in rows for char in row)
    return {record.job_id: record for record in records}, rows


def status_row(rows: list[str], job_id: str) -> str:
    [row] = [row for row in rows if row.startswith(job_id)]
    return row


@pytest.fixture
def shared_root(two_users):  # noqa: F811
    """The 0777 root, with one ordinary planted job beside each attack: the listing must still show it."""
    plant_as_attacker(two_users, OTHER_ID, {protocol.HANDLE: handle_of(OTHER_ID)})
    return f"file://{two_users.shared}"


def test_what_the_attacker_plants_in_the_shared_root_is_never_listed(two_users, shared_root):  # noqa: F811
    two_users.attacker.run(plant, str(two_users.shared), PLANTED_ID, {protocol.HANDLE: os.mkfifo})
    listed, rows = victim_lists(two_users, shared_root)
    assert PLANTED_ID not in listed and set(listed) == {OTHER_ID} and len(rows) == 1


def test_a_fifo_named_handle_json_does_not_hang_the_listing(two_users, shared_root):  # noqa: F811
    plant_as_attacker(two_users, PLANTED_ID, {protocol.HANDLE: os.mkfifo})
    listed, rows = victim_lists(two_users, shared_root)
    assert listed[PLANTED_ID].status.startswith("UNREADABLE: ") and "not a regular file" in listed[PLANTED_ID].status
    assert listed[OTHER_ID].status == catalog.NOT_YOURS and len(rows) == 2


def test_a_link_to_dev_zero_is_not_followed(two_users, shared_root):  # noqa: F811
    plant_as_attacker(two_users, PLANTED_ID,
                           {protocol.HANDLE: lambda path: os.symlink("/dev/zero", path)})
    listed, rows = victim_lists(two_users, shared_root)
    assert "symbolic link" in listed[PLANTED_ID].status and listed[OTHER_ID].status == catalog.NOT_YOURS
    assert len(rows) == 2


def test_a_sparse_gigabyte_is_not_read(two_users, shared_root):  # noqa: F811
    def sparse(path: pathlib.Path) -> None:
        with open(path, "wb") as file:
            file.truncate(1 << 30)
        path.chmod(0o644)

    plant_as_attacker(two_users, PLANTED_ID, {protocol.HANDLE: sparse})
    records, _, error, added = two_users.victim.run(list_and_print, shared_root, timeout=LIST_TIMEOUT_S)
    assert error is None and added < LISTING_MEMORY_BYTES
    listed = {record.job_id: record for record in records}
    assert listed[PLANTED_ID].status.startswith("UNREADABLE: ") and "over the" in listed[PLANTED_ID].status


def test_an_unreadable_entry_is_one_row_and_the_rest_is_listed(two_users, shared_root):  # noqa: F811
    plant_as_attacker(two_users, PLANTED_ID, {protocol.HANDLE: handle_of(PLANTED_ID)},
                           directory_mode=0o700)
    listed, rows = victim_lists(two_users, shared_root)
    assert "Permission denied" in listed[PLANTED_ID].status and listed[PLANTED_ID].status.startswith("UNREADABLE: ")
    assert listed[OTHER_ID].status == catalog.NOT_YOURS and len(rows) == 2


@pytest.mark.parametrize(("field", "value"), [("hosts", "many"), ("hosts", -3), ("submitted_at", 1e300),
                                              ("submitted_at", float("nan")), ("accelerator", ["tpu"]),
                                              ("status", {"x": 1})])
def test_a_field_of_the_wrong_type_or_range_is_one_row(two_users, shared_root, field, value):  # noqa: F811
    plant_as_attacker(two_users, PLANTED_ID,
                           {protocol.HANDLE: handle_of(PLANTED_ID, **{field: value})})
    listed, rows = victim_lists(two_users, shared_root)
    assert listed[PLANTED_ID].status.startswith("UNREADABLE: ") and field in listed[PLANTED_ID].status
    assert listed[OTHER_ID].status == catalog.NOT_YOURS and len(rows) == 2


def test_a_newline_in_a_field_draws_no_row_of_its_own(two_users, shared_root):  # noqa: F811
    fake = f"cpu\n{'kn-20990101-000000-fa4e00':<26}  2099-01-01 00:00:00      1  cpu           SUCCEEDED"
    plant_as_attacker(two_users, PLANTED_ID,
                           {protocol.HANDLE: handle_of(PLANTED_ID, accelerator=fake, backend="local\r\x1b[2K")})
    listed, rows = victim_lists(two_users, shared_root)  # no control character in any row
    assert len(rows) == 2 and not any(row.startswith("kn-20990101-000000-fa4e00") for row in rows)
    assert listed[PLANTED_ID].status == catalog.NOT_YOURS and "\n" not in listed[PLANTED_ID].accelerator


def attach_refused(root: str, job_id: str) -> str:
    try:
        catalog.attach(job_id, storage=root)
    except ValueError as error:
        return str(error)
    return "attached"


def test_an_id_ending_in_a_newline_is_no_id(two_users, shared_root):  # noqa: F811
    newline_id = PLANTED_ID + "\n"
    plant_as_attacker(two_users, newline_id, {protocol.HANDLE: handle_of(newline_id)})
    listed, rows = victim_lists(two_users, shared_root)
    assert list(listed) == [OTHER_ID] and len(rows) == 1
    assert "is not a job id" in two_users.victim.run(attach_refused, shared_root, newline_id)


def plant_unsigned_job(shared: str, marker: str) -> None:
    """As the attacker: an unsigned SUCCEEDED job dated 2099 whose result writes ``marker`` when unpickled."""
    result = cloudpickle.dumps({"success": True, "result": Planted(marker), "outputs": {}, "phase": "execute",
                                "host_index": 0})
    plant(shared, PLANTED_ID, {protocol.PLAN: json.dumps({"job_id": PLANTED_ID, **PLAN}).encode(),
                               protocol.HANDLE: handle_of(PLANTED_ID), protocol.RESULT: result})
    exit_record = pathlib.Path(shared, PLANTED_ID, protocol.host_exit(0))
    exit_record.parent.mkdir(mode=0o755, parents=True)
    exit_record.parent.parent.chmod(0o755)
    exit_record.write_bytes(protocol.ExitSummary(0, 0, recorded_success=True).to_json())
    exit_record.chmod(0o644)


def attach_every_way(root: str, job_id: str) -> dict[str, str]:
    """As the victim: how ``attach`` answers, plainly, with the opt-in, and through the magic."""
    from IPython.core.interactiveshell import InteractiveShell

    answers = {}
    for name, kwargs in (("plain", {}), ("trusted", {"trust_unsigned": True})):
        try:
            answers[name] = f"returned {catalog.attach(job_id, storage=root, **kwargs).result()!r}"
        except IntegrityError as error:
            answers[name] = f"{type(error).__name__}: {error}"
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "kinetic_nb")
    for name, flag in (("magic", ""), ("magic trusted", " --trust-unsigned")):
        with contextlib.redirect_stdout(io.StringIO()):
            result = shell.run_cell(f"%kinetic attach {job_id} --storage {root}{flag}")
        answers[name] = f"{type(result.error_in_exec).__name__}: {result.error_in_exec}"
    return answers


def test_a_planted_unsigned_job_is_not_yours_and_never_unpickled(two_users, shared_root):  # noqa: F811
    marker = two_users.shared / "planted-code-ran"
    plant_unsigned_job(str(victim_directory(two_users)), str(marker))
    for path in [victim_directory(two_users) / PLANTED_ID, *(victim_directory(two_users) / PLANTED_ID).rglob("*")]:
        os.lchown(path, two_users.attacker.uid, two_users.attacker.uid)
    listed, rows = victim_lists(two_users, shared_root)
    assert listed[PLANTED_ID].status == catalog.NOT_YOURS and status_row(rows, PLANTED_ID).endswith(catalog.NOT_YOURS)
    answers = two_users.victim.run(attach_every_way, shared_root, PLANTED_ID)
    for name, answer in answers.items():
        assert "not yours" in answer and "\n" not in answer, name
        assert "trust" not in answer.replace("trusted or not", ""), name  # no advice to trust it
    assert answers["plain"].startswith("IntegrityError") and answers["trusted"].startswith("IntegrityError")
    assert answers["magic"].startswith("UsageError") and answers["magic trusted"].startswith("UsageError")
    assert not marker.exists()


def store_own_unsigned_job(root: str, job_id: str) -> None:
    """As the victim: a job of her own from before signing (no key, no signature)."""
    job = open_storage(root).child(job_id)
    job.write_bytes(protocol.PLAN, json.dumps({"job_id": job_id, **PLAN}).encode())
    job.write_bytes(protocol.HANDLE, json.dumps({"job_id": job_id, "backend": "local", "hosts": 1}).encode())
    job.write_bytes(protocol.RESULT, cloudpickle.dumps({"success": True, "result": "written before signing",
                                                        "outputs": {}, "phase": "execute", "host_index": 0}))
    job.write_bytes(protocol.host_exit(0), protocol.ExitSummary(0, 0, recorded_success=True).to_json())


def list_and_attach_own(root: str, job_id: str) -> tuple[str, str, object]:
    [record] = [record for record in catalog.jobs(storage=root) if record.job_id == job_id]
    try:
        catalog.attach(job_id, storage=root)
        advice = "attached without the opt-in"
    except UnsignedJobError as error:
        advice = str(error)
    return record.status, advice, catalog.attach(job_id, storage=root, trust_unsigned=True).result()


def test_the_victims_own_job_from_before_signing_opens_with_the_opt_in(two_users, shared_root):  # noqa: F811
    own_id = "kn-20200101-000000-01d0b5"
    two_users.victim.run(store_own_unsigned_job, shared_root, own_id)
    status, advice, value = two_users.victim.run(list_and_attach_own, shared_root, own_id)
    assert status == catalog.UNSIGNED and value == "written before signing"
    assert "--trust-unsigned (trust_unsigned=True) unpickles this job's stored result" in advice
    assert "only for a job you ran yourself" in advice and "\n" not in advice
