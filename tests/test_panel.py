"""The panel driven by snapshots, without a frontend: the widgets' state is what a user would see."""

from __future__ import annotations

import io

import pytest
from IPython.display import DisplayHandle

from kinetic_nb import views
from kinetic_nb.notebook.display.panel import (
    GRID_ABOVE,
    HostPanel,
    TextStatus,
    WidgetView,
    failure_lines,
    host_ranges,
    html_summary,
    text_summary,
    watch_in_background,
)
from kinetic_nb.runner.protocol import ExitSummary, JobPlan
from kinetic_nb.state import HostSnapshot, JobSnapshot, JobStatus

T0 = 1_000_000.0
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "<kinetic In[3]>", line 12, in <module>\n'
    "    raise ValueError('bad shard')\n"
    "ValueError: bad shard\n"
)


def host(index, state="running", phase="execute", **extra) -> HostSnapshot:
    values = dict(started_at=T0, updated_at=T0 + 1, last_line=f"step 7 on host {index}",
                  log_tail=("starting", f"step 7 on host {index}"),
                  history=(("startup", T0), ("execute", T0 + 0.5)))
    values.update(extra)
    return HostSnapshot(index, state, phase, **values)


def failed(index) -> HostSnapshot:
    return host(index, "failed", message="ValueError: bad shard", traceback=TRACEBACK,
                exit=ExitSummary(index, 1, ended_at=T0 + 2))


def job(hosts, status=JobStatus.RUNNING) -> JobSnapshot:
    return JobSnapshot("kn-test", "local", "tpu-v5e-16", status, T0, T0 + 3, tuple(hosts))


def test_all_running():
    panel = HostPanel(4)
    panel.update(job([host(i) for i in range(4)]))
    assert "kn-test · local · tpu-v5e-16 · 4 hosts · 3.0 s · RUNNING" in panel.header.value
    assert "4 running" in panel.header.value
    assert panel.progress.bar_style == "info" and panel.progress.value == 0
    assert len(panel.rows) == 4
    assert "★" in panel.rows[0].value and "★" not in panel.rows[1].value
    assert all("running" in row.value and "in the cell" in row.value for row in panel.rows)
    assert "step 7 on host 3" in panel.rows[3].value
    assert panel.details.titles[0] == "host 0 (leader) · running · in the cell"
    assert "step 7 on host 2" in panel.details.children[2].value
    assert panel.failures.value == ""


def test_host_2_failed_with_its_traceback():
    panel = HostPanel(4)
    stopped = [host(i, "stopped", exit=ExitSummary(i, 3, stopped=True, ended_at=T0 + 2)) for i in (1, 3)]
    leader = host(0, "succeeded", "teardown", exit=ExitSummary(0, 0, recorded_success=True, ended_at=T0 + 2))
    panel.update(job([leader, stopped[0], failed(2), stopped[1]], JobStatus.FAILED))
    assert panel.progress.bar_style == "danger" and panel.progress.value == 4
    assert "failed" in panel.rows[2].value
    assert "stopped" in panel.rows[1].value and "succeeded" in panel.rows[0].value
    assert "ValueError: bad shard" in panel.details.children[2].value
    assert "raise ValueError(&#x27;bad shard&#x27;)" in panel.details.children[2].value  # escaped
    assert panel.details.titles[2] == "host 2 · failed · in the cell"
    assert "host 2: ValueError at In[3], line 12" in panel.failures.value


def test_64_hosts_with_identical_tracebacks_are_grouped():
    panel = HostPanel(64)
    snapshot = job([host(0, "stopped")] + [failed(i) for i in range(1, 64)], JobStatus.FAILED)
    panel.update(snapshot)
    assert panel.compact
    assert failure_lines(snapshot) == ["hosts 1-63: the same ValueError at In[3], line 12"]
    assert "hosts 1-63: the same ValueError at In[3], line 12" in panel.failures.value
    assert panel.grid.value.count("<span") == 64
    assert "hosts 1-63" in panel.problems.value and "hosts 0" in panel.problems.value
    assert len(panel.details.children) == 32  # the first hosts that are not fine, not all 64
    assert "ValueError: bad shard" in panel.details.children[1].value


def test_256_hosts_draw_as_a_grid():
    hosts = [host(i, "succeeded" if i % 2 else "running") for i in range(256)]
    hosts[77] = failed(77)
    panel = HostPanel(256)
    panel.update(job(hosts))
    assert panel.compact and not hasattr(panel, "rows")
    assert panel.grid.value.count("<span") == 256
    assert panel.grid.value.count("#e53935") == 1  # one red cell
    assert "hosts 77" in panel.problems.value
    assert panel.details.titles == ("host 77 · failed · in the cell",)
    assert "128 running, 127 succeeded, 1 failed" in panel.header.value


def test_updates_change_only_what_changed():
    panel = HostPanel(2)
    panel.update(job([host(0), host(1)]))
    sent = []
    panel.rows[1].observe(lambda change: sent.append(change), "value")
    panel.update(job([host(0), host(1)]))
    assert sent == []
    panel.update(job([host(0), host(1, last_line="step 8")]))
    assert len(sent) == 1


def test_success_is_styled_success():
    panel = HostPanel(2)
    done = [host(i, "succeeded", "teardown", exit=ExitSummary(i, 0, recorded_success=True, ended_at=T0 + 2))
            for i in range(2)]
    panel.update(job(done, JobStatus.SUCCEEDED))
    assert panel.progress.bar_style == "success" and panel.progress.value == 2


@pytest.mark.parametrize(("indices", "text"), [([1, 2, 3], "1-3"), ([1, 3, 4, 5, 9], "1, 3-5, 9"), ([7], "7")])
def test_host_ranges(indices, text):
    assert host_ranges(indices) == text


def test_text_and_html_twins():
    snapshot = job([host(0, "succeeded"), failed(1)], JobStatus.FAILED)
    text = text_summary(snapshot)
    assert text.splitlines()[0] == "kn-test · local · tpu-v5e-16 · 2 hosts · 2.0 s · FAILED"  # until the last exit
    assert "    0*  succeeded" in text and "    1   failed" in text and "exited with code 1" in text
    assert text.splitlines()[-1] == "host 1: ValueError at In[3], line 12"
    page = html_summary(snapshot)
    assert "<table>" in page and "host 1: ValueError at In[3], line 12" in page
    big = text_summary(job([host(i) for i in range(GRID_ABOVE)] + [failed(GRID_ABOVE)] * 1))
    assert "32 running, 1 failed" in big and big.count("\n") < 10


def test_text_status_writes_a_line_per_change_when_not_a_terminal():
    stream = io.StringIO()
    status = TextStatus(stream)
    status.update(job([host(0), host(1)]))
    status.update(job([host(0), host(1)]))
    status.update(job([host(0), failed(1)]))
    status.close(job([host(0, "succeeded"), failed(1)], JobStatus.FAILED))
    lines = stream.getvalue().splitlines()
    assert lines[0] == "kn-test: 2 running · 3.0 s" and lines[1] == "kn-test: 1 running, 1 failed · 3.0 s"
    assert lines[2].startswith("kn-test · local") and lines[-1] == "host 1: ValueError at In[3], line 12"


class FakeSource:
    """A plain snapshot source: a plan and a script of snapshots; no handle, storage or backend."""

    def __init__(self, snapshots):
        self.plan = JobPlan("kn-test", len(snapshots[0].hosts), "tpu-v5e-16", 4, "none", "127.0.0.1:1", "0" * 64,
                            1.0, 1, 1)
        self.snapshots = list(snapshots)
        self.calls = 0

    def snapshot(self) -> JobSnapshot:
        self.calls += 1
        return self.snapshots[min(self.calls, len(self.snapshots)) - 1]


def script() -> list[JobSnapshot]:
    return [job([host(0), host(1)]), job([host(0), failed(1)]),
            job([host(0, "succeeded"), failed(1)], JobStatus.FAILED)]


def test_watch_follows_a_plain_snapshot_source_until_its_job_ends():
    stream = io.StringIO()
    source = FakeSource(script())
    thread = watch_in_background(source, TextStatus(stream), interval=0.001)
    thread.join(5)
    assert not thread.is_alive() and source.calls == 3  # polled until done, then drawn once more by close
    assert thread.name == "kinetic-watch-kn-test"
    assert stream.getvalue().splitlines()[-1] == "host 1: ValueError at In[3], line 12"


def test_the_views_a_handle_is_shown_by_take_plain_values(capsys):
    snapshot = script()[-1]
    assert views.render("text", snapshot) == text_summary(snapshot)
    assert views.render("html", snapshot) == html_summary(snapshot)
    views.render("watch", FakeSource(script())).join(5)  # no widget frontend here: the text twin on stderr
    assert "host 1: ValueError at In[3], line 12" in capsys.readouterr().err
    with pytest.raises(LookupError, match="no view 'sparkline'"):
        views.render("sparkline", snapshot)


def session_cell(hosts, status) -> JobSnapshot:
    """A session's cell as its poller draws it: hosts back to idle have no exit record, and a label."""
    return JobSnapshot("ks-test/cells/000002", "local", "cpu", status, T0, T0 + 3, tuple(hosts),
                       label="In[4] · session ks-test")


def test_a_session_cell_ends_as_a_one_shot_job_does():
    """Hosts back to idle count as done on the bar, keep the phase the cell ended in, show the failing host's
    traceback, say "(no output)" once done, and the header names the cell as the notebook does."""
    done = [host(0, "succeeded", "result upload", log_tail=()),
            host(1, "succeeded", "execute", log_tail=("[Gloo] Rank 1 is connected to 2 peer ranks. Expected number "
                                                       "of connected peer ranks is : 2", "its own line"))]
    panel = HostPanel(3, brief=True)
    panel.update(session_cell([*done, host(2, "failed", message="ValueError: bad shard", traceback=TRACEBACK)],
                              JobStatus.FAILED))
    assert panel.progress.value == 3 and panel.progress.description == "FAILED"
    assert panel.progress.style.description_width == "initial"  # the label is never cut to "SUCCEED..."
    assert panel.header.value.startswith("<b>In[4] · session ks-test · local")
    assert "ks-test/cells/000002" not in panel.header.value
    assert "host 2: ValueError at In[3], line 12" in panel.failures.value
    assert "raise ValueError(&#x27;bad shard&#x27;)" in panel.details.children[2].value
    assert "(no output)</pre>" in panel.details.children[0].value
    assert "[Gloo]" not in panel.details.children[1].value and "its own line" in panel.details.children[1].value
    assert panel.body.layout.display is None  # a failed cell keeps its rows
    running = HostPanel(1)
    running.update(job([host(0, log_tail=())]))
    assert "(no output yet)</pre>" in running.details.children[0].value


def test_a_session_cell_that_succeeded_keeps_its_header_alone():
    hosts = [host(i, "succeeded", "execute", updated_at=T0 + 1.5) for i in range(2)]
    panel = HostPanel(2, brief=True)
    panel.update(session_cell(hosts, JobStatus.RUNNING))
    assert panel.body.layout.display is None
    panel.update(session_cell(hosts, JobStatus.SUCCEEDED))
    assert panel.body.layout.display == "none"
    text = text_summary(session_cell(hosts, JobStatus.SUCCEEDED), brief=True)
    assert text == "In[4] · session ks-test · local · cpu · 2 hosts · 1.5 s · SUCCEEDED · 2 succeeded"
    assert len(text_summary(session_cell(hosts, JobStatus.SUCCEEDED)).splitlines()) == 4  # not brief: every row
    assert "<table>" not in html_summary(session_cell(hosts, JobStatus.SUCCEEDED), brief=True)
    # A host back to idle is done with the cell when its status says so: its time stops there.
    assert hosts[0].ended and hosts[0].elapsed(T0 + 100) == 1.5


def test_a_brief_text_twin_says_nothing_while_the_cell_is_quick():
    stream = io.StringIO()
    status = TextStatus(stream, brief=True)
    quick = JobSnapshot("ks-test/cells/000002", "local", "cpu", JobStatus.RUNNING, T0, T0 + 0.2, (host(0),))
    status.update(quick)
    assert stream.getvalue() == ""
    status.update(session_cell([host(0)], JobStatus.RUNNING))  # 3 s in: it says where the hosts are
    assert stream.getvalue() == "In[4] · session ks-test: 1 running · 3.0 s\n"


# -- hosts that run several processes --------------------------------------------------------------------------


def processes_job(processes, status=JobStatus.RUNNING, per_host=2) -> JobSnapshot:
    return JobSnapshot("kn-test", "local", "gpu-h100x2", status, T0, T0 + 3, tuple(processes), procs_per_host=per_host)


def test_a_row_per_host_each_expandable_to_its_processes():
    panel = HostPanel(4, procs_per_host=2)
    panel.update(processes_job([host(0), host(1), failed(2), host(3, "stopped")], JobStatus.FAILED))
    assert "kn-test · local · gpu-h100x2 · 2 hosts x 2 processes · 2.0 s · FAILED" in panel.header.value
    assert len(panel.rows) == 2 and len(panel.details.children) == 2
    assert "★" in panel.rows[0].value and "running" in panel.rows[0].value
    assert "failed" in panel.rows[1].value  # its worst process's state
    assert "[rank 2] ValueError: bad shard" in panel.rows[1].value  # its failing process's own line, by rank
    assert panel.details.titles == ("host 0 (leader) · running · in the cell · 2 processes",
                                    "host 1 · failed · in the cell · 2 processes")
    drill = panel.details.children[1].value
    assert ">1.0</span>" in drill and ">1.1</span>" in drill  # a row per process: host.process
    assert "host 1, process 0 (rank 2) · failed" in drill and "host 1, process 1 (rank 3) · stopped" in drill
    assert "ValueError: bad shard" in drill and "step 7 on host 3" in drill  # each one's traceback and log
    assert "host 1, process 0 (rank 2): ValueError at In[3], line 12" in panel.failures.value
    assert panel.progress.max == 4  # the bar counts processes


def test_the_text_twin_names_each_process_by_host_and_process():
    text = text_summary(processes_job([host(0), host(1), failed(2), failed(3)], JobStatus.FAILED))
    lines = text.splitlines()
    assert lines[0] == "kn-test · local · gpu-h100x2 · 2 hosts x 2 processes · 2.0 s · FAILED"
    assert lines[1].split() == ["h.proc", "state", "phase", "time", "last", "line", "/", "exit"]
    assert [line.split()[0] for line in lines[2:6]] == ["0.0*", "0.1", "1.0", "1.1"]
    assert "ranks 2-3: the same ValueError at In[3], line 12" in lines
    assert "<td>1.1</td>" in html_summary(processes_job([host(0), host(1), host(2), host(3)]))


# -- the user's words ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("phase", "words"), [("payload load", "loading the cell"),
                                              ("result upload", "sending the result"),
                                              ("teardown", "shutting down"),
                                              ("start barrier", "waiting for the others")])
def test_a_hosts_phase_is_shown_in_a_users_words_never_the_protocols(phase, words):
    snapshot = job([host(0, phase=phase), failed(1)], JobStatus.FAILED)
    panel = HostPanel(2)
    panel.update(snapshot)
    shown = [panel.rows[0].value, panel.details.titles[0], text_summary(snapshot), html_summary(snapshot)]
    assert all(words in view for view in shown)
    assert not any(phase in view for view in shown)


def test_a_failure_names_the_cell_as_the_notebook_does():
    api_cell = TRACEBACK.replace("<kinetic In[3]>", "<kinetic cell>")
    assert failure_lines(job([host(0), failed(1)], JobStatus.FAILED)) == ["host 1: ValueError at In[3], line 12"]
    assert failure_lines(job([host(0), host(1, "failed", message="ValueError: bad shard", traceback=api_cell)],
                             JobStatus.FAILED)) == ["host 1: ValueError at cell line 12"]


def test_a_panel_left_with_hosts_being_stopped_is_redrawn_once_they_have_ended(monkeypatch):
    """The cell returned while its workers were still being stopped: the panel says "stopping", then, once
    they ended, is drawn again as they ended; a text twin, printed already, is not."""
    returned = job([host(0, "stopped"), host(1, "stopping")], JobStatus.CANCELLED)
    ended = job([host(0, "stopped"), host(1, "stopped")], JobStatus.CANCELLED)
    drawn = []
    monkeypatch.setattr("IPython.display.display", lambda bundle, **_: drawn.append(bundle) or DisplayHandle())
    monkeypatch.setattr("IPython.core.display_functions.update_display", lambda bundle, **_: drawn.append(bundle))
    view = WidgetView(2)
    view.close(returned)
    assert "stopping" in view.panel.rows[1].value
    thread = view.settle(returned, lambda: ended)
    thread.join(timeout=5)
    assert "stopping" not in view.panel.rows[1].value and "stopped" in view.panel.rows[1].value
    assert "stopping" not in drawn[-1]["text/html"]  # what a saved notebook keeps, too
    assert view.settle(ended, lambda: pytest.fail("nothing was being stopped")) is None
    assert TextStatus(io.StringIO()).settle(returned, lambda: ended) is None

