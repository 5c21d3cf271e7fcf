"""The failing frame's variables: described on the host (arrays by shape, never by repr; a repr that raises or
hangs costs its own line; secrets masked), carried as text in the failure and the status, shown in the panel and
the exception's notes; and ``%kinetic pm`` on a session's host, whose frame is let go at its next cell."""

from __future__ import annotations

import io
import os
import signal
import time
from contextlib import redirect_stdout

import pytest

import kinetic_nb
from kinetic_nb.errors import PostMortemError
from kinetic_nb.notebook.display.panel import html_summary, text_summary
from kinetic_nb.runner.frame_locals import (
    LEFT_CELL,
    NOTE_NAMES,
    RAISED,
    VALUE_TIME_LIMIT_S,
    FrameLocals,
    frame_locals,
    time_limit,
)
from kinetic_nb.runner.records import read_host_status
from kinetic_nb.runner.redact import Redactor

from .magic_shell import magic_shell

CELL = "<kinetic cell>"
SECRET = "tok-5ecret-value"

#: A class whose repr hangs in Python, one that sleeps, one that raises, and an array-like whose repr must never
#: be called (a real array behind a hung collective would block in C, beyond any time limit).
CLASSES = '''
import time
class Hangs:
    def __repr__(self):
        while True:
            pass
class Sleeps:
    def __repr__(self):
        time.sleep(30)
        return "slept"
class Raises:
    def __repr__(self):
        raise RuntimeError("no repr today")
class Sharded:
    shape = (8, 128)
    dtype = "bfloat16"
    sharding = "NamedSharding(mesh=Mesh('x': 4), spec=PartitionSpec('x',))"
    def __repr__(self):
        raise AssertionError("an array's repr was called")
'''


def cell_line(n: int) -> int:
    """Line ``n`` of what follows CLASSES in a cell."""
    return CLASSES.count("\n") + n


def failed(source: str) -> BaseException:
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(CLASSES + source, CELL, "exec"), namespace)
    except Exception as error:
        return error
    raise AssertionError("the cell did not fail")


def names(frame: FrameLocals) -> dict[str, str]:
    return dict(frame.names)


def test_a_repr_that_hangs_sleeps_or_raises_costs_its_own_line_and_an_array_is_never_printed():
    error = failed(f"token = {SECRET!r}\nh, s, r, a = Hangs(), Sleeps(), Raises(), Sharded()\n"
                   "batch = [a, 1]\nn = 3\nraise ValueError(n)")
    started = time.monotonic()
    [frame] = frame_locals(error, CELL, Redactor([SECRET]))
    assert time.monotonic() - started < 4 * VALUE_TIME_LIMIT_S + 1
    shown = names(frame)
    assert frame.where == RAISED and frame.location == f"Cell line {cell_line(5)}"
    assert shown["token"] == "'***'" and SECRET not in repr(frame)
    assert shown["h"] == shown["s"] == f"<repr took longer than {VALUE_TIME_LIMIT_S:g} s>"
    assert shown["r"] == "<repr failed: RuntimeError: no repr today>"
    assert shown["a"].startswith("__main__.Sharded bfloat16[8,128] NamedSharding(")
    assert shown["batch"] == f"[{shown['a']}, 1]"  # inside a container too
    assert shown["n"] == "3"
    assert not {"time", "Hangs", "__builtins__"} & set(shown)  # modules, classes, dunders: not the cell's variables


def test_a_failure_outside_the_cell_shows_where_it_was_raised_and_where_it_left_the_cell():
    error = failed("import json\ndef parse(text):\n    doc = text.strip()\n    return json.loads(doc)\nparse('{')")
    raised, left = frame_locals(error, CELL, Redactor([]))
    assert raised.where == RAISED and "json" in raised.location and names(raised)["s"] == "'{'"
    assert left.where == LEFT_CELL and left.location == f"Cell line {cell_line(4)}, in parse"
    assert names(left) == {"text": "'{'", "doc": "'{'"}


def test_the_key_in_a_local_is_masked_and_a_failure_that_never_reached_the_cell_has_no_locals():
    key = b"\x01\x02k" * 11
    error = failed(f"held = {key!r}\nraise KeyError('x')")
    [frame] = frame_locals(error, CELL, Redactor([key.hex()]), frozenset({key}))
    assert names(frame)["held"] == "'***'"
    outside = RuntimeError("at the barrier")  # raised where no frame is the cell's
    try:
        raise outside
    except RuntimeError:
        pass
    assert frame_locals(outside, CELL, Redactor([])) == []


def test_a_workers_locals_reach_the_exception_notes_and_the_panel_with_secrets_masked():
    source = ("import os\nhost = int(os.environ['KINETIC_HOST_INDEX'])\n" + CLASSES +
              "token = os.environ['API_TOKEN']\nslow = Hangs()\nweights = Sharded()\n"
              "def step(batch):\n    scaled = batch * 2\n    if host == 1:\n        raise ValueError('diverged')\n"
              "    return scaled\nstep(21)\n")
    handle = kinetic_nb.submit(source, hosts=2, env={"API_TOKEN": SECRET}, echo=False)
    with pytest.raises(ValueError, match="diverged") as raised:
        handle.result()
    notes = raised.value.__notes__
    line = source.splitlines().index("        raise ValueError('diverged')") + 1
    where = f"where it was raised (Cell line {line}, in step): batch = 21, scaled = 42"
    assert f"Variables on host 1 {where}" in notes
    assert not any(SECRET in note for note in notes)
    snapshot = handle.snapshot()
    [frame] = snapshot.hosts[1].frame_locals
    assert names(frame) == {"batch": "21", "scaled": "42"}
    assert f"host 1 variables {where}" in text_summary(snapshot)
    assert "scaled = 42" in html_summary(snapshot) or "scaled = 42" in _drill_down(snapshot)


def _drill_down(snapshot) -> str:
    from kinetic_nb.notebook.display.panel import _detail_html

    return _detail_html(snapshot.hosts[1])


def test_a_top_level_failure_carries_the_cells_own_names_secret_masked_and_a_hanging_repr_cut():
    source = ("import os\n" + CLASSES + "token = os.environ['API_TOKEN']\nslow = Hangs()\nweights = Sharded()\n"
              "count = 7\nratio = 0.5\nlabel = 'run'\nraise RuntimeError('stop here')\n")
    handle = kinetic_nb.submit(source, hosts=1, env={"API_TOKEN": SECRET}, echo=False)
    with pytest.raises(RuntimeError, match="stop here") as raised:
        handle.result()
    [note] = [note for note in raised.value.__notes__ if note.startswith("Variables")]
    assert note.count(" = ") == NOTE_NAMES and "and 1 more" in note  # the first few, then how many more
    [frame] = handle.snapshot().hosts[0].frame_locals
    shown = names(frame)
    assert shown["token"] == "'***'" and shown["count"] == "7"
    assert shown["slow"] == f"<repr took longer than {VALUE_TIME_LIMIT_S:g} s>"
    assert shown["weights"].startswith("__main__.Sharded bfloat16[8,128]")
    assert SECRET not in repr(handle.snapshot())


@pytest.fixture
def session():
    started = kinetic_nb.start(hosts=2, framework="none", idle_timeout=600, grace=2, echo=False,
                               env={"API_TOKEN": SECRET})
    yield started
    started.stop()


FAILS_ON_1 = ("import os, numpy as np\nhost = int(os.environ['KINETIC_HOST_INDEX'])\n"
              "token = os.environ['API_TOKEN']\n"
              "class Freed:\n    def __del__(self):\n        open(os.environ['MARKER'] + str(host), 'w').close()\n"
              "def step(batch):\n    grid = np.arange(6).reshape(2, 3)\n    held = Freed()\n"
              "    if host == 1:\n        import json\n        json.loads(batch)\n    return 1\nstep('{')\n")


def test_post_mortem_on_a_session(session, tmp_path):
    session.run(f"import os\nos.environ['MARKER'] = {str(tmp_path / 'freed-')!r}").result()
    marker = tmp_path / "freed-1"  # host 1's objects of its failing frame, let go
    with pytest.raises(Exception, match="Expecting property name"):
        session.run(FAILS_ON_1).result()
    # The leader's status.json as cell 2 left it (on a local disk it follows the cell's end a moment later).
    deadline = time.monotonic() + 10
    while ((leader_before := read_host_status(session.records, session.group.key, 0)).cell, leader_before.state) \
            != (2, "idle"):
        assert time.monotonic() < deadline, "the leader's status never reached cell 2"
        time.sleep(0.01)
    assert session.post_mortem(1, "len(s), idx") == "(1, 0)"  # json's frame: %debug's innermost
    assert session.post_mortem(1, "batch * 2, grid.sum()", frame="cell") == "('{{', np.int64(15))"
    assert session.post_mortem(1, "grid", frame="cell") == "array([[0, 1, 2],\n       [3, 4, 5]])"
    assert session.post_mortem(1, "token", frame="cell") == "'***'"  # an -e value never comes back
    with pytest.raises(PostMortemError, match="on host 1, in cell 2's failing frame: NameError: name 'nope'"):
        session.post_mortem(1, "nope")
    with pytest.raises(PostMortemError, match=r"host 0 of session .* did not fail in its last cell"):
        session.post_mortem(0, "1")
    with pytest.raises(ValueError, match="has ranks 0-1, not 5"):
        session.post_mortem(5, "1")
    # The other host was not touched: its status was not written again.
    assert read_host_status(session.records, session.group.key, 0).revision == leader_before.revision
    assert (tmp_path / "freed-0").exists()  # the leader's step returned: its objects were let go at once
    assert not marker.exists()  # host 1 still holds its failing frame's objects
    # Host 1 lets its frame go as the next cell starts, before the cell's barrier: the cell already sees it gone.
    assert session.run("os.path.exists(os.environ['MARKER'] + '1')").result() is True
    assert marker.exists()
    with pytest.raises(PostMortemError, match=r"host 1 .* did not fail in its last cell \(3\)"):
        session.post_mortem(1, "1")


def test_the_pm_magic_prints_the_value_and_a_bad_line_is_one_usage_error():
    with magic_shell() as shell:
        refused = shell.run_cell("%kinetic pm 1 x")
        assert "this notebook is on no session" in str(refused.error_in_exec)
        shell.run_line_magic("kinetic", "start -n 2 --framework none --idle-timeout 600")
        shell.run_cell("%%kinetic --quiet\nimport os\nd = {'a': 1}\nif os.environ['KINETIC_HOST_INDEX'] == '1':\n"
                       "    d['missing']\n")
        printed = io.StringIO()
        with redirect_stdout(printed):
            answered = shell.run_cell('%kinetic pm 1 d["a"] + 1, sorted(d)')  # quotes reach Python as written
        assert answered.error_in_exec is None and printed.getvalue().strip() == "(2, ['a'])"
        for line in ("%kinetic pm 1 --cell sorted(d)", "%kinetic pm --cell 1 sorted(d)"):  # the help's order, and the other
            printed = io.StringIO()
            with redirect_stdout(printed):
                answered = shell.run_cell(line)
            assert answered.error_in_exec is None and printed.getvalue().strip() == "['a']", line
        for line, message in (("%kinetic pm", "expects a host and an expression"),
                              ("%kinetic pm one x", "batch.shape, not 'one x'"),
                              ("%kinetic pm 0 d", "host 0 of session ks-"),
                              ("%kinetic pm 1 d[", "SyntaxError")):
            error = shell.run_cell(line).error_in_exec
            assert type(error).__name__ == "UsageError" and message in str(error), (line, error)
            assert "\n" not in str(error)


def test_post_mortem_and_a_profile_on_a_bucket_session(gcs_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the merged trace lands next to the notebook: the working directory
    session = kinetic_nb.start(hosts=2, framework="none", storage=gcs_root, idle_timeout=600, echo=False)
    try:
        failing = session.run("import os\nlimit = 3\nif os.environ['KINETIC_HOST_INDEX'] == '1':\n"
                              "    raise OverflowError(limit * 2)\n", profile=True)
        with pytest.raises(OverflowError, match="6"):
            failing.result()
        assert session.post_mortem(1, "limit + 1") == "4"
        merged = failing.profile()
        assert not merged.path.startswith("gs://") and os.path.exists(merged.path)  # on this machine, this user's
        assert sorted(merged.missing) == [0, 1]  # no framework in this cell: each host's span only
    finally:
        session.stop()


def test_the_time_limit_puts_back_a_timer_the_cell_had_set():
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        with time_limit(0.05):
            pass
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < left <= 30.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
