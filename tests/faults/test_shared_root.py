"""A shared ``file://`` root cannot redirect a write, as the attacks were found (issue 20, points 2 and 4).

A victim (uid 61001) runs sessions and jobs in a root every user may write; an
attacker (uid 61002) swaps the victim's directory for her own, full of links
back to the victim's files and a 0777 ``outputs/``. Proven each time: the
victim's files keep their bytes, the checkpoint is nowhere the attacker can
read, and nothing of the victim's landed in the attacker's directories.
"""

# ruff: noqa: F811 - the two_users fixture is imported, then named by each test that uses it
from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest

import kinetic_nb
from kinetic_nb.errors import StorageError
from tests.two_users import ATTACKER_UID, VICTIM_UID, TwoUsers, two_users  # noqa: F401

PRECIOUS = b"the victim's precious file: it must keep these bytes\n"
CHECKPOINT = b"model weights only the victim may read"
#: How long the test waits for one side to reach the point where the other acts.
STEP_TIMEOUT_S = 120.0


def _own_environment() -> None:
    """Root's test root ($KINETIC_STORAGE, set by a fixture of another test) is not the victim's to reach."""
    os.environ.pop("KINETIC_STORAGE", None)


def _plant_precious(users: TwoUsers) -> dict[Path, bytes]:
    """Two 0600 files in the victim's home, what the planted links point at."""
    files = {}
    for name in ("precious.txt", "precious2.txt"):
        path = users.victim.home / name
        path.write_bytes(PRECIOUS + name.encode())
        os.chown(path, VICTIM_UID, VICTIM_UID)
        path.chmod(0o600)
        files[path] = path.read_bytes()
    return files


def _swap(target: str, shared: str, victim_home: str, links: dict[str, str]) -> str:
    """As the attacker: rename the deepest directory on the way to ``target`` she may, and build her own in its
    place down to ``target``: 0777 directories, ``links`` (name below target -> where), links back to the
    victim's signed records, and a 0777 ``outputs/``. Returns what was renamed."""
    relative = Path(target).relative_to(shared).parts
    for depth in range(len(relative), 0, -1):
        swapped = os.path.join(shared, *relative[:depth])
        try:
            os.rename(swapped, swapped + ".moved")
        except PermissionError:
            continue
        break
    else:
        raise PermissionError(f"could not rename anything on the way to {target}")
    os.umask(0)
    moved_target = swapped + ".moved" + target[len(swapped):]
    os.makedirs(os.path.join(target, "outputs"), mode=0o777)
    for name in ("plan.json", "handle.json"):
        os.symlink(os.path.join(moved_target, name), os.path.join(target, name))
    for name, where in links.items():
        os.makedirs(os.path.dirname(os.path.join(target, name)), mode=0o777, exist_ok=True)
        os.symlink(where.replace("~", victim_home), os.path.join(target, name))
    return swapped


def _attackers_tree_untouched(users: TwoUsers, swapped: str) -> None:
    """Everything in the attacker's replacement is still hers, her links unchanged, her outputs/ empty."""
    for directory, names, files in os.walk(swapped):
        for name in [*names, *files]:
            info = os.lstat(os.path.join(directory, name))
            assert info.st_uid == ATTACKER_UID, f"{os.path.join(directory, name)} was written by uid {info.st_uid}"
        if directory.endswith("/outputs"):
            assert not names and not files, f"the victim's outputs landed in the attacker's {directory}"


def _attacker_reads_nothing(users: TwoUsers) -> None:
    def look(shared: str) -> list[str]:
        leaked = []
        for directory, _, files in os.walk(shared):
            for name in files:
                try:
                    if CHECKPOINT in Path(directory, name).read_bytes():
                        leaked.append(os.path.join(directory, name))
                except OSError:
                    continue
        return leaked

    assert users.attacker.run(look, str(users.shared)) == []


def _attack_between(users: TwoUsers, reached: str, attack, *args) -> tuple[threading.Thread, dict]:
    """In a thread: once the victim has written ``reached`` in her home, run ``attack(path it names, *args)`` as
    the attacker, then tell the victim to go on. The victim's heavy side forks from the main thread: a fork from
    a thread while other threads hold locks could deadlock it."""
    outcome: dict = {}
    home = users.victim.home

    def side() -> None:
        try:
            deadline = time.monotonic() + STEP_TIMEOUT_S
            while not (home / reached).exists():
                if time.monotonic() > deadline:
                    raise AssertionError(f"the victim never reached {reached}")
                time.sleep(0.05)
            try:
                outcome["value"] = users.attacker.run(attack, (home / reached).read_text(), *args)
            except PermissionError:
                outcome["value"] = None  # nothing on the way could be renamed
        except BaseException as error:  # re-raised by the test
            outcome["error"] = error
        finally:
            (home / "go").write_text("go")

    thread = threading.Thread(target=side, daemon=True)
    thread.start()
    return thread, outcome


def _swap_while_victim_runs(users: TwoUsers, victim_side, reached: str, links: dict[str, str]) -> tuple:
    """The victim's side, with the attacker's swap once she has reached ``reached``: (her value, what was swapped)."""
    shared, home = str(users.shared), str(users.victim.home)
    thread, attack = _attack_between(users, reached, _swap, shared, home, links)
    value = users.victim.run(victim_side, shared, home, timeout=2 * STEP_TIMEOUT_S)
    thread.join(STEP_TIMEOUT_S)
    if "error" in attack:
        raise attack["error"]
    return value, attack["value"]


def _victim_session(shared: str, home: str) -> object:
    """As the victim: a session's cell 1, then (after the swap) cell 2, which writes a checkpoint."""
    _own_environment()
    session = kinetic_nb.start(hosts=2, framework="none", storage=shared, idle_timeout=600, grace=2, echo=False)
    try:
        assert session.run("x = 1\nx").result() == 1
        Path(home, "cell-1-done").write_text(session.storage.uri[len("file://"):])
        while not os.path.exists(os.path.join(home, "go")):
            time.sleep(0.05)
        cell = session.run("import os, time\ntime.sleep(2.5)\n"  # a heartbeat or two after the swap
                           f"open(os.path.join(os.environ['KINETIC_OUTPUT_DIR'], 'ckpt.bin'), 'wb').write({CHECKPOINT!r})\n"
                           "x + 1")
        try:
            return cell.result()
        except Exception as error:  # a clear failure is allowed; a write through is not
            return f"failed: {type(error).__name__}: {error}"
    finally:
        session.stop()


@pytest.mark.parametrize("sticky", [False, True], ids=["0777", "1777"])
def test_a_session_directory_swapped_between_two_cells_is_never_written_through(two_users, sticky):
    precious = _plant_precious(two_users)
    shared = str(two_users.shared)
    if sticky:  # the attacker's own 0777 sessions/ was enough: no sticky bit protects what lies in it
        two_users.shared.chmod(0o1777)
    two_users.attacker.run(lambda: (os.umask(0), os.mkdir(os.path.join(shared, "sessions"), 0o777)))
    links = {"hosts/0/heartbeat": "~/precious.txt", "cells/000002/ready-1": "~/precious2.txt"}
    value, swapped = _swap_while_victim_runs(two_users, _victim_session, "cell-1-done", links)
    assert sticky or swapped  # a sticky root: nothing on the way to the victim's session may be renamed
    assert value == 2 or str(value).startswith("failed: ")
    assert {path: path.read_bytes() for path in precious} == precious
    if swapped:
        _attackers_tree_untouched(two_users, swapped)
    _attacker_reads_nothing(two_users)


def _victim_job(shared: str, home: str) -> object:
    """As the victim: a one-shot job whose cell waits for the swap, then writes a checkpoint."""
    _own_environment()
    source = ("import os, time\n"
              f"while not os.path.exists({os.path.join(home, 'go')!r}):\n    time.sleep(0.05)\n"
              "time.sleep(2.5)\n"  # a heartbeat or two after the swap
              f"open(os.path.join(os.environ['KINETIC_OUTPUT_DIR'], 'ckpt.bin'), 'wb').write({CHECKPOINT!r})\n"
              "'done'")
    job = kinetic_nb.submit(source, hosts=2, framework="none", storage=shared, echo=False)
    Path(home, "submitted").write_text(job.storage.uri[len("file://"):])
    try:
        return job.result(timeout=STEP_TIMEOUT_S)
    except Exception as error:  # a clear failure is allowed; a write through is not
        return f"failed: {type(error).__name__}: {error}"


def test_a_running_jobs_directory_swapped_in_a_non_sticky_root_is_never_written_through(two_users):
    precious = _plant_precious(two_users)
    links = {"hosts/0/heartbeat": "~/precious.txt", "hosts/1/heartbeat": "~/precious2.txt"}
    value, swapped = _swap_while_victim_runs(two_users, _victim_job, "submitted", links)
    assert swapped
    assert value == "done" or str(value).startswith("failed: ")
    assert {path: path.read_bytes() for path in precious} == precious
    _attackers_tree_untouched(two_users, swapped)
    _attacker_reads_nothing(two_users)


def _job_with_a_lax_umask(shared: str) -> dict[str, tuple[int, bool]]:
    """As the victim, under umask 000: a job whose cell writes a file and a directory into its outputs."""
    _own_environment()
    os.umask(0)
    source = ("import os\nout = os.environ['KINETIC_OUTPUT_DIR']\nos.makedirs(os.path.join(out, 'sub'), exist_ok=True)\n"
              "open(os.path.join(out, 'sub', 'weights.bin'), 'wb').write(b'w')\n"
              "open(os.path.join(out, f'shard-{os.environ[\"KINETIC_HOST_INDEX\"]}.txt'), 'w').write('s')\n1")
    job = kinetic_nb.submit(source, hosts=2, framework="none", storage=shared, echo=False, keep=True)
    assert job.result(timeout=STEP_TIMEOUT_S) == 1
    root = job.storage.local_path()
    modes = {"": (stat.S_IMODE(os.stat(root).st_mode), True)}
    for directory, names, files in os.walk(root):
        for name in [*names, *files]:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            modes[os.path.relpath(path, root)] = (stat.S_IMODE(info.st_mode), stat.S_ISDIR(info.st_mode))
    return modes


def test_outputs_and_everything_hosts_create_are_private_whatever_the_umask(two_users):
    modes = two_users.victim.run(_job_with_a_lax_umask, str(two_users.shared))
    assert {"outputs", "outputs/sub", "outputs/sub/weights.bin", "outputs/shard-0.txt", "plan.json"} <= set(modes)
    wrong = {name: f"{mode:o}" for name, (mode, directory) in modes.items() if mode != (0o700 if directory else 0o600)}
    assert wrong == {}


def _start_and_run(shared: str) -> object:
    _own_environment()
    session = kinetic_nb.start(hosts=1, framework="none", storage=shared, idle_timeout=600, echo=False)
    try:
        return session.run("21 * 2").result()
    finally:
        session.stop()


def test_an_attackers_private_sessions_directory_stops_no_one(two_users):
    shared = str(two_users.shared)
    two_users.attacker.run(lambda: os.mkdir(os.path.join(shared, "sessions"), 0o700))
    assert two_users.victim.run(_start_and_run, shared) == 42


def test_a_squatted_user_directory_is_refused_in_one_line(two_users):
    shared = str(two_users.shared)
    two_users.attacker.run(lambda: (os.umask(0), os.mkdir(os.path.join(shared, f"uid-{VICTIM_UID}"), 0o777)))
    with pytest.raises(StorageError) as raised:
        two_users.victim.run(_start_and_run, shared)
    message = str(raised.value)
    assert f"{shared}/uid-{VICTIM_UID} is owned by uid {ATTACKER_UID}" in message and "\n" not in message
    assert os.listdir(os.path.join(shared, f"uid-{VICTIM_UID}")) == []


@pytest.mark.parametrize("planted", ["link", "file"])
def test_a_link_or_a_file_in_place_of_the_user_directory_is_refused_naming_it_and_its_owner(two_users, planted):
    shared = str(two_users.shared)
    mine = os.path.join(shared, f"uid-{VICTIM_UID}")

    def plant() -> None:
        os.mkdir(os.path.join(shared, "hers"), 0o777)
        if planted == "link":
            os.symlink(os.path.join(shared, "hers"), mine)
        else:
            open(mine, "w").close()

    two_users.attacker.run(plant)
    with pytest.raises(StorageError) as raised:
        two_users.victim.run(_start_and_run, shared)
    message = str(raised.value)
    what = "is a symbolic link (to " if planted == "link" else "is not a directory"
    assert message.startswith(f"{mine} {what}") and f"owned by uid {ATTACKER_UID}" in message
    assert "Bad file descriptor" not in message and "\n" not in message
    assert os.listdir(os.path.join(shared, "hers")) == []
