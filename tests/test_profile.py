"""``--profile``: every host's framework trace of a cell, merged into one Chrome trace with one process per host,
aligned on the cell's barrier; a host that left no trace named; the span marked on the panel's timeline.

The merged JSON is parsed here (Perfetto's TraceProcessor downloads a binary on first use: not on this machine).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import time
from contextlib import redirect_stdout

import pytest

import kinetic_nb
from kinetic_nb.client.profile import merge_records, merged_profile, read_records, trace_path
from kinetic_nb.notebook.display.timeline import plot_timeline
from kinetic_nb.runner import envelope, protocol
from kinetic_nb.storage import LocalStorage

from .magic_shell import magic_shell

#: Events may sit this far outside their host's cell span: the annotation's clock reading and the trace's differ
#: by the time between two calls (µs).
SLACK_US = 2_000

JAX_CELL = """
import jax, jax.numpy as jnp
@jax.jit
def train_step(x):
    return jnp.tanh(x @ x.T).sum()
x = jnp.ones((128, 128))
for _ in range(3):
    loss = train_step(x).block_until_ready()
float(loss)
"""

TORCH_CELL = """
import os, torch, torch.distributed as dist
rank = int(os.environ['RANK'])
a = torch.ones(64, 64)
b = (a @ a).sum()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
if rank == 1:
    raise ValueError('host 1 fails after the collective')
if rank == 2:
    os._exit(7)  # gone before it can store its trace
float(total)
"""


@pytest.fixture(autouse=True)
def in_a_notebook_folder(tmp_path, monkeypatch):
    """Each test runs where its merged traces may land (next to the notebook: the working directory)."""
    monkeypatch.chdir(tmp_path)


def load(path: str) -> dict:
    """A merged trace: gzipped where its name says so, plain JSON otherwise."""
    with (gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")) as file:
        return json.load(file)


def processes(trace: dict) -> dict[int, str]:
    return {event["pid"]: event["args"]["name"] for event in trace["traceEvents"]
            if event["ph"] == "M" and event["name"] == "process_name"}


def cell_span(trace: dict, pid: int) -> tuple[float, float]:
    [span] = [event for event in trace["traceEvents"]
              if event["pid"] == pid and event["ph"] == "X" and event["name"].startswith("cell ")]
    return span["ts"], span["ts"] + span["dur"]


def named(trace: dict, pid: int, text: str) -> list[dict]:
    return [event for event in trace["traceEvents"]
            if event["pid"] == pid and event["ph"] == "X" and text in event.get("name", "")]


def test_a_profiled_4_host_jax_cell_merges_into_one_process_per_host_with_events_inside_the_cells_span(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a script's trace goes to its working directory, as a notebook's goes beside it
    handle = kinetic_nb.submit(JAX_CELL, hosts=4, profile=True, echo=False)
    assert handle.result() == pytest.approx(128 * 128)  # tanh(128) is 1.0 in float32
    merged = handle.profile()
    assert merged.traced == (0, 1, 2, 3) and merged.missing == {} and merged.framework == "jax"
    assert merged.path.startswith(str(tmp_path))  # next to the notebook (or script), never in the job's storage
    trace = load(merged.path)
    assert processes(trace) == {0: "host 0", 1: "host 1", 2: "host 2", 3: "host 3"}
    assert {event["pid"] for event in trace["traceEvents"]} == {0, 1, 2, 3}
    for pid in range(4):
        start, end = cell_span(trace, pid)
        assert start >= 0  # after the barrier, on that host's own clock
        steps = named(trace, pid, "train_step")
        assert steps, f"host {pid}'s trace has no train_step"
        for event in steps:
            assert start - SLACK_US <= event["ts"] and event["ts"] + event.get("dur", 0) <= end + SLACK_US
        assert any(event["name"] == "barrier passed" and event["ts"] == 0 for event in trace["traceEvents"]
                   if event["pid"] == pid)
    # The span is on each host's status, for the panel's timeline.
    snapshot = handle.snapshot()
    assert all(host.profiled and host.profiled[0] <= host.profiled[1] for host in snapshot.hosts)
    figure = plot_timeline(snapshot)
    assert "profiled" in [text.get_text() for text in figure.axes[0].get_legend().get_texts()]


def test_a_failed_torch_cell_keeps_the_traces_its_hosts_wrote_and_names_the_one_that_left_none():
    echoed: list[str] = []
    handle = kinetic_nb.submit(TORCH_CELL, hosts=3, framework="torch", profile=True, grace=5,
                               echo=lambda text, stream: echoed.append(text))
    with pytest.raises(ValueError, match="host 1 fails after the collective"):
        handle.result()
    assert "USDT" in handle.logs(0) and "USDT" not in "".join(echoed)  # torch's profiler lines: chatter
    merged = handle.profile()
    assert merged.traced == (0, 1) and merged.framework == "torch"
    assert list(merged.missing) == [2] and "left no profile" in merged.missing[2]
    trace = load(merged.path)
    assert processes(trace) == {0: "host 0", 1: "host 1", 2: "host 2 (no profile)"}
    for pid in (0, 1):
        start, end = cell_span(trace, pid)
        for text in ("aten::mm", "allreduce"):
            found = named(trace, pid, text)
            assert found, f"host {pid} has no {text}"
            assert all(start - SLACK_US <= event["ts"] <= end + SLACK_US for event in found)
    assert not [event for event in trace["traceEvents"] if event["pid"] == 2 and event["ph"] != "M"]
    lines = merged.describe()
    assert lines[0].startswith("kinetic_nb: profile on 2 hosts (torch), one process per host")
    assert any(line.strip().startswith("host 2: left no profile") for line in lines)


def record(rank: int, trace: dict | None, *, framework: str = "torch", problem: str = "") -> dict:
    return {"rank": rank, "seq": 1, "framework": framework, "problem": problem, "barrier_at": 100.0,
            "marker_at": 100.5, "ended_at": 101.0, "annotation": "kinetic cell 1", "trace": trace}


def test_the_merge_places_each_host_by_its_own_annotation_and_keeps_ids_and_threads_apart():
    def host_trace(skew_us: float) -> dict:  # the same cell on two hosts whose trace clocks start apart
        return {"traceEvents": [
            {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 701, "tid": 5, "name": "thread_name", "args": {"name": "python"}},
            {"ph": "M", "pid": 701, "tid": 5, "name": "thread_name", "args": {"name": "renamed later"}},
            {"ph": "X", "pid": 701, "tid": 5, "ts": 1000.0 + skew_us, "dur": 400.0, "name": "kinetic cell 1"},
            {"ph": "X", "pid": 701, "tid": 5, "ts": 1100.0 + skew_us, "dur": 50.0, "name": "matmul"},
            {"ph": "s", "pid": 701, "tid": 5, "ts": 1100.0 + skew_us, "id": 1, "name": "flow"},
            {"ph": "i", "s": "g", "pid": "Traces", "tid": "", "ts": 900.0 + skew_us, "name": "start"},
            {}]}

    trace, why = merge_records({0: record(0, host_trace(0.0)), 1: record(1, host_trace(77_000.0))}, 3,
                               lambda rank: f"host {rank}", {2: "left no profile"})
    assert why == {2: "left no profile"}
    events = trace["traceEvents"]
    matmuls = [event for event in events if event.get("name") == "matmul"]
    assert [event["ts"] for event in matmuls] == [pytest.approx(500_000 + 100)] * 2  # both 100 µs into the cell
    assert {event["id"] for event in events if event["ph"] == "s"} == {"0:1", "1:1"}
    assert all(event.get("s") != "g" for event in events)
    threads = {(event["pid"], event["args"]["name"]) for event in events if event.get("name") == "thread_name"}
    assert (0, "/host:CPU / python") in threads and (0, "Traces / thread ") in threads
    assert (0, "/host:CPU / renamed later") not in threads
    assert processes(trace)[2] == "host 2 (no profile)"
    assert trace["otherData"]["missing"] == {"2": "left no profile"}


def test_a_host_with_no_framework_keeps_its_span_and_says_why_and_a_torch_trace_falls_back_to_its_base_time():
    bare = record(0, None, framework="", problem="no framework profiler: the cell uses neither JAX nor torch")
    torch_trace = {"baseTimeNanoseconds": 100_000_000_000, "traceEvents": [
        {"ph": "X", "pid": 9, "tid": 9, "ts": 600_000.0, "dur": 10.0, "name": "aten::add"}]}
    trace, why = merge_records({0: bare, 1: record(1, torch_trace)}, 2, lambda rank: f"host {rank}", {})
    assert why == {0: "no framework profiler: the cell uses neither JAX nor torch"}
    [add] = [event for event in trace["traceEvents"] if event.get("name") == "aten::add"]
    assert add["ts"] == pytest.approx(600_000.0)  # 100 s + 0.6 s of its clock, 100 s at the barrier
    assert cell_span(trace, 0) == (pytest.approx(500_000.0), pytest.approx(1_000_000.0))


def test_a_record_that_does_not_verify_is_never_read(tmp_path):
    storage = LocalStorage(f"file://{tmp_path}")
    key, other = b"k" * 32, b"o" * 32
    body = gzip.compress(json.dumps(record(0, None)).encode())
    envelope.write_sealed(storage, protocol.host_profile(0), key, body)
    envelope.write_sealed(storage, protocol.host_profile(1), other, body)  # sealed under another key
    records, why = read_records(storage, key, 3, host_done=lambda rank: True, wait_s=0.2)
    assert list(records) == [0]
    assert "its profile was not read" in why[1] and "left no profile" in why[2]


def test_kinetic_profile_profiles_the_sessions_next_cell_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with magic_shell() as shell:
        refused = shell.run_cell("%kinetic profile")
        assert "a one-shot cell takes %%kinetic --profile" in str(refused.error_in_exec)
        shell.run_line_magic("kinetic", "start -n 2 --framework none --idle-timeout 600")
        shell.run_line_magic("kinetic", "profile")
        said = io.StringIO()
        with redirect_stdout(said):  # a notice, not an error
            assert shell.run_cell("%%kinetic --quiet\nsum(range(10))").result == 45
        assert "kinetic_nb: profile of In[1] with no framework trace, each host's barrier and cell span only: " in \
            said.getvalue()
        assert "  hosts 0-1: no framework profiler: the cell uses neither JAX nor torch" in said.getvalue()
        session = shell.magics_manager.registry["KineticMagics"].session
        merged = session.cell(1).profile()
        assert merged.missing == {0: "no framework profiler: the cell uses neither JAX nor torch",
                                  1: "no framework profiler: the cell uses neither JAX nor torch"}
        assert sorted(processes(load(merged.path))) == [0, 1]
        said = io.StringIO()
        with redirect_stdout(said):  # a notice, not an error
            shell.run_cell("%%kinetic --quiet\n1")
        assert "profile" not in said.getvalue()  # the cell after is not profiled
        with pytest.raises(ValueError, match="was not profiled"):
            session.cell(2).profile()


def test_a_one_shot_profile_flag_says_where_the_merged_trace_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with magic_shell() as shell:
        said = io.StringIO()
        with redirect_stdout(said):  # a notice, not an error
            assert shell.run_cell("%%kinetic -n 2 --quiet --profile\n'profiled'").result == "profiled"
        lines = said.getvalue().splitlines()
        [first] = [line for line in lines if line.startswith("kinetic_nb: profile ")]
        path = first.rsplit(": ", 1)[1]
        assert sorted(processes(load(path))) == [0, 1]
        assert any("ui.perfetto.dev" in line for line in lines)


def test_the_merged_trace_is_this_users_alone_and_one_replaced_in_storage_is_never_taken(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    handle = kinetic_nb.submit("'profiled'", hosts=2, framework="none", profile=True, echo=False, keep=True)
    assert handle.result() == "profiled"
    planted = gzip.compress(json.dumps({"traceEvents": [{"ph": "M", "pid": 9, "name": "process_name",
                                                         "args": {"name": "planted"}}]}).encode())
    handle.storage.write_bytes(protocol.PROFILE_MERGED, planted)  # there before the merge, as a bucket's writer
    merged = handle.profile()
    handle.storage.write_bytes(protocol.PROFILE_MERGED, planted)  # and replaced after it
    assert os.path.dirname(merged.path) == str(tmp_path)
    assert stat.S_IMODE(os.stat(merged.path).st_mode) == 0o600  # this user's alone
    assert sorted(processes(load(merged.path))) == [0, 1]  # the hosts' verified records, merged
    assert handle.profile().path == merged.path and sorted(processes(load(handle.profile().path))) == [0, 1]
    assert not any(handle.storage.uri in line or protocol.PROFILE_MERGED in line for line in merged.describe())


# Where the merged trace goes, and what the notebook says of it.

def test_the_trace_goes_next_to_the_notebook_named_after_the_cell_and_the_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the kernel's working directory: the notebook's
    when = 1_800_000_000.0
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    assert trace_path("kinetic In[5]", when=when) == tmp_path / f"profile-In5-{stamp}.trace.json"
    assert trace_path("In[12]", tmp_path / "traces" / "new", when=when).parent == tmp_path / "traces" / "new"
    assert (tmp_path / "traces" / "new").is_dir()  # --profile-dir may name a folder not made yet
    assert trace_path("ks-abc/cells/000002", when=when).name == f"profile-ks-abc-cells-000002-{stamp}.trace.json"


def test_the_merged_trace_names_the_cell_as_the_notebook_does_and_its_notice_links_to_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    storage = LocalStorage(f"file://{tmp_path / 'job'}")
    key = b"k" * 32
    for rank in (0, 1):
        envelope.write_sealed(storage, protocol.host_profile(rank), key,
                              gzip.compress(json.dumps(record(rank, None, framework="")).encode()))
    path = trace_path("kinetic In[2]")
    merged = merged_profile(storage, key, 2, lambda rank: f"host {rank}", lambda rank: True, str(path), 0.2,
                            cell="kinetic In[2]")
    trace = json.loads(path.read_text())  # plain JSON: JupyterLab opens it
    spans = [event["name"] for event in trace["traceEvents"] if event["ph"] == "X"]
    assert spans == ["In[2]", "In[2]"]  # never "cell 1"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    lines = merged.describe()
    assert lines[0].startswith("kinetic_nb: profile of In[2] with no framework trace")
    assert lines[0].endswith(f": {path.name}")  # relative to the notebook, not a hidden folder elsewhere
    notice = merged.notice()
    assert notice["text/plain"] == "\n".join(lines)
    assert f'<a href="{path.name.replace("[", "%5B")}" target="_blank">{path.name}</a>' in notice["text/html"]
    elsewhere = tmp_path.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    monkeypatch.chdir(elsewhere)  # a trace outside the notebook's folder: its whole path, no link it cannot open
    assert merged.describe()[0].endswith(f": {path}") and "<a " not in merged.notice()["text/html"]
