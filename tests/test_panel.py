"""The panel driven by snapshots, without a frontend: the widgets' state is what a user would see."""

from __future__ import annotations

import dataclasses
import io
import json

import comm
import pytest
from comm import DummyComm
from IPython.display import DisplayHandle

from kinetic_nb import views
from kinetic_nb.notebook.display.grid import MAX_DIFFERING, differing_hosts, slowest_hosts
from kinetic_nb.notebook.display.grouping import group_lines, grouped_lines
from kinetic_nb.notebook.display.panel import (
    GRID_ABOVE,
    HostPanel,
    TextStatus,
    WidgetView,
    failure_lines,
    html_summary,
    quiet_lines,
    redraw_interval,
    text_summary,
    watch_in_background,
)
from kinetic_nb.runner.protocol import ExitSummary, JobPlan, host_ranges, hosts_named
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
    assert squares(panel) == 64
    assert "hosts that differ: 63 failed, 1 stopped" in panel.differing.value
    assert "… and 52 more: failed hosts 13-63, stopped hosts 0" in panel.differing.value
    assert len(panel.details.children) == 32  # the first hosts that differ, not all 64
    assert "ValueError: bad shard" in panel.details.children[1].value


def test_256_hosts_draw_as_a_grid():
    hosts = [host(i, "succeeded" if i % 2 else "running") for i in range(256)]
    hosts[77] = failed(77)
    panel = HostPanel(256)
    panel.update(job(hosts))
    assert panel.compact and not hasattr(panel, "rows")
    assert squares(panel) == 256 and len(panel.grid.children) == 4  # rows of 64
    assert "".join(row.value for row in panel.grid.children).count("class=kn-failed") == 1  # one red square
    assert ".kn-grid i.kn-failed{background:#e53935}" in panel.grid_style.value
    assert "title='host 77 · failed · in the cell'" in panel.grid.children[1].value
    assert "hosts that differ: 1 failed" in panel.differing.value
    assert panel.details.titles == ("host 77 · failed · in the cell",)
    assert "128 running, 127 succeeded, 1 failed" in panel.header.value


def squares(panel: HostPanel) -> int:
    return sum(row.value.count("<i class=") for row in panel.grid.children)


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


def test_a_message_names_a_thousand_hosts_in_one_short_line():
    assert hosts_named([5]) == "host 5"
    assert hosts_named(range(722, 1024)) == "hosts 722-1023"
    assert hosts_named([1, 3, 2, 9]) == "hosts 1-3, 9"
    scattered = hosts_named(range(0, 1024, 2))  # 512 hosts, no two in a row
    assert scattered.startswith("hosts 0, 2, 4, ") and scattered.endswith(", … (500 more)") and len(scattered) < 80


def test_text_and_html_twins():
    snapshot = job([host(0, "succeeded"), failed(1)], JobStatus.FAILED)
    text = text_summary(snapshot)
    assert text.splitlines()[0] == "kn-test · local · tpu-v5e-16 · 2 hosts · 2.0 s · FAILED"  # until the last exit
    assert "    0*  succeeded" in text and "    1   failed" in text and "exited with code 1" in text
    assert text.splitlines()[-1] == "host 1: ValueError at In[3], line 12"
    page = html_summary(snapshot)
    assert "<table>" in page and "host 1: ValueError at In[3], line 12" in page
    big = text_summary(job([host(i) for i in range(GRID_ABOVE)] + [failed(GRID_ABOVE)] * 1))
    assert "32 running, 1 failed" in big and big.count("\n") < 25


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


def test_a_one_host_cell_says_one_host():
    hosts = [host(0, "succeeded", "execute", updated_at=T0 + 1.5)]
    text = text_summary(session_cell(hosts, JobStatus.SUCCEEDED), brief=True)
    assert text == "In[4] · session ks-test · local · cpu · 1 host · 1.5 s · SUCCEEDED · 1 succeeded"


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


def test_a_host_that_succeeded_shows_no_phase_one_that_failed_shows_where():
    """A succeeded host's last phase ("shutting down") is true of its process but no news: its row, title and
    both twins leave it out; a failed host's still says what it was doing."""
    snapshot = job([host(0, "succeeded", phase="teardown"), failed(1)], JobStatus.FAILED)
    panel = HostPanel(2)
    panel.update(snapshot)
    assert panel.details.titles[0] == "host 0 (leader) · succeeded"
    assert panel.details.titles[1] == "host 1 · failed · in the cell"
    for view in (panel.rows[0].value, text_summary(snapshot), html_summary(snapshot)):
        assert "succeeded" in view and "shutting down" not in view
    assert "in the cell" in panel.rows[1].value


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



# -- 64 to 1,024 hosts ---------------------------------------------------------------------------------------------


def test_identical_lines_are_grouped_with_the_hosts_that_printed_them():
    lines = dict.fromkeys(range(64), "step 10 loss 0.53") | {64: "step 9 loss 0.61", 65: "", 66: "step 10 loss 0.53"}
    assert group_lines(lines) == [([*range(64), 66], "step 10 loss 0.53"), ([64], "step 9 loss 0.61")]
    assert grouped_lines(lines, lambda index: f"host {index}") == ["hosts 0-63, 66: step 10 loss 0.53",
                                                                   "host 64: step 9 loss 0.61"]
    assert grouped_lines({2: "a", 3: "a"}, str, many="ranks") == ["ranks 2-3: a"]


def test_many_differing_lines_are_bounded_keeping_the_biggest_groups():
    lines = dict.fromkeys(range(0, 1024, 2), "done") | {index: f"host {index} says {index}"
                                                              for index in range(1, 1024, 2)}
    shown = grouped_lines(lines, lambda index: f"host {index}", limit=4)
    assert len(shown) == 4
    assert shown[0].startswith("hosts 0, 2, 4, 6,") and shown[0].endswith("… (500 more): done")
    assert shown[1:3] == ["host 1: host 1 says 1", "host 3: host 3 says 3"]
    assert shown[3].startswith("… 510 more hosts with lines of their own: 5, 7, 9,") and "(498 more)" in shown[3]


def quiet(index) -> HostSnapshot:
    return host(index, "quiet", stacks='  File "<kinetic In[3]>", line 4, in <module>\n    time.sleep(60)\n')


def scale_job(succeeded=200) -> JobSnapshot:
    """256 hosts: ``succeeded`` done, host 77 failed, host 78 lost, hosts 100-102 quiet, the rest still running."""
    hosts = [host(i, "succeeded", last_line="step 10 loss 0.53", exit=ExitSummary(i, 0, ended_at=T0 + 2))
             for i in range(256)]
    for index in range(succeeded, 256):
        hosts[index] = host(index, last_line="step 9 loss 0.61")
    hosts[77] = failed(77)
    hosts[78] = host(78, "lost")
    for index in (100, 101, 102):
        hosts[index] = quiet(index)
    return job(hosts)


def test_the_hosts_that_differ_are_failed_lost_quiet_then_the_slowest():
    snapshot = scale_job()
    differing = differing_hosts(snapshot.hosts)
    assert [h.index for h in differing[:5]] == [77, 78, 100, 101, 102]
    assert [h.index for h in differing[5:]] == list(range(200, 256))  # still running while 195 of 256 ended
    assert [h.index for h in slowest_hosts(snapshot.hosts)] == list(range(200, 256))
    panel = HostPanel(256)
    panel.update(snapshot)
    assert "hosts that differ: 1 failed, 1 lost, 3 quiet, 56 still running after 197 of 256 ended" in \
        panel.differing.value
    assert panel.differing.value.count("font-size:12px;white-space:nowrap") == MAX_DIFFERING  # a row each
    assert "… and 49 more: running hosts 207-255" in panel.differing.value
    assert panel.details.titles[:3] == ("host 77 · failed · in the cell", "host 78 · lost · in the cell",
                                        "host 100 · quiet · in the cell")
    # Before most hosts ended, the ones still running are the many: not listed.
    early = scale_job(succeeded=100)
    assert [h.index for h in differing_hosts(early.hosts)] == [77, 78, 100, 101, 102]


def test_a_big_panel_and_its_text_twin_group_the_hosts_lines():
    snapshot = scale_job()
    panel = HostPanel(256)
    panel.update(snapshot)
    assert "hosts 0-76, 79-99, 103-199: step 10 loss 0.53" in panel.lines.value
    assert "hosts 200-255: step 9 loss 0.61" in panel.lines.value
    assert "host 77: step 7 on host 77" in panel.lines.value  # a line that differs: its host's own
    text = text_summary(snapshot)
    lines = text.splitlines()
    assert lines[1] == "56 running, 195 succeeded, 1 failed, 1 lost, 3 quiet"
    assert lines[2] == "hosts that differ: 1 failed, 1 lost, 3 quiet, 56 still running after 197 of 256 ended"
    assert "  hosts 0-76, 79-99, 103-199: step 10 loss 0.53" in lines
    assert lines.index("last lines:") < lines.index("  hosts 200-255: step 9 loss 0.61")
    assert "… and 49 more: running hosts 207-255" in lines
    assert "host 100 is quiet: no output and no phase change since another host ended" in text
    assert "hosts 0-76, 79-99, 103-199: step 10 loss 0.53" in html_summary(snapshot)


def test_the_text_twin_of_1024_hosts_is_as_short_as_of_64():
    hosts = [quiet(i) if i % 2 else failed(i) for i in range(1024)]
    hosts = [dataclasses.replace(h, last_line=f"step {h.index}", traceback=TRACEBACK.replace("shard", str(h.index)))
             for h in hosts]
    text = text_summary(job(hosts))
    assert len(text.splitlines()) < 4 * (MAX_DIFFERING + 1) + 10 + 5, text  # rows, failures, quiet, lines
    assert "… and 500 more failed or lost with failures of their own: 24, 26," in text
    assert "… and 500 more quiet: 25, 27," in text
    assert "… 1015 more hosts with lines of their own: 9-1023" in text


class CountingComm(DummyComm):
    """A widget's comm that keeps what each update message would send to the browser."""

    sent: list[tuple[str, int]] = []  # noqa: RUF012 - one list for every widget of a test

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys) -> None:
        if msg_type == "comm_msg":
            CountingComm.sent.append((self.comm_id, len(json.dumps(data, ensure_ascii=False).encode())))


@pytest.fixture
def counted(monkeypatch):
    monkeypatch.setattr(comm, "create_comm", CountingComm)
    CountingComm.sent = []
    return CountingComm.sent


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_big_panel_resends_only_what_changed(counted):
    clock = Clock()
    hosts = [host(i) for i in range(1024)]
    panel = HostPanel(1024, clock=clock)
    panel.update(job(hosts))
    first = sum(size for _, size in counted)
    assert first > 1024 * 40  # every square, once
    counted.clear()
    clock.now += panel.interval
    panel.update(job(hosts))
    assert counted == []  # nothing changed: nothing sent, not even an equal value
    hosts[700] = failed(700)
    clock.now += panel.interval
    panel.update(job(hosts))
    rows = [row.model_id for row in panel.grid.children]
    assert [rows.index(model) for model, _ in counted if model in rows] == [700 // 64]  # that host's row alone
    assert sum(size for _, size in counted) < first / 4


def test_a_big_panel_draws_at_most_once_per_interval_and_always_its_last(counted):
    clock = Clock()
    panel = HostPanel(1024, clock=clock)
    assert panel.interval == redraw_interval(1024) == 2.0 and redraw_interval(16) == redraw_interval(128) == 0.25
    hosts = [host(i) for i in range(1024)]
    panel.update(job(hosts))
    hosts[5] = failed(5)
    clock.now = 1.0
    panel.update(job(hosts))
    assert "failed" not in panel.header.value  # too soon: skipped
    clock.now = 2.0
    panel.update(job(hosts))
    assert "1 failed" in panel.header.value
    hosts[6] = failed(6)
    clock.now = 2.1
    panel.update(job(hosts, JobStatus.FAILED))  # the cell ended: drawn at once
    assert "2 failed" in panel.header.value
    hosts[7] = failed(7)
    panel.update(job(hosts), final=True)
    assert "3 failed" in panel.header.value
    small = HostPanel(16, clock=clock)
    small.update(job([host(i) for i in range(16)]))
    small.update(job([failed(0)] + [host(i) for i in range(1, 16)]))
    assert "1 failed" in small.header.value  # rows are never skipped


def test_a_quiet_host_stopped_by_a_signal_says_so_in_the_text_twin():
    """A host whose process is stopped (SIGSTOP) cannot dump its stacks: its agent says why, and the quiet line
    says it rather than where the cell is."""
    stopped = host(2, "quiet", stacks="no answer: host 2 is stopped by a signal (SIGSTOP or SIGTSTP): process 77 "
                                      "runs nothing, its stacks' dump included, until it gets SIGCONT\n")
    [line] = quiet_lines(job([host(0), host(1), stopped]))
    assert line == ("host 2 is quiet: no output and no phase change since another host ended; host 2 is stopped by a "
                    "signal (SIGSTOP or SIGTSTP): process 77 runs nothing, its stacks' dump included, until it gets "
                    "SIGCONT")
