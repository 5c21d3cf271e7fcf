"""Each host's memory at its cell's end: measured on the host, carried in its end status, shown per host, and the
host that stands out flagged (both sides of both thresholds)."""

from __future__ import annotations

import pytest

import kinetic_nb
from kinetic_nb.notebook.display.memory import SKEW_BYTES, SKEW_RATIO, memory_flags, memory_line, stands_out
from kinetic_nb.notebook.display.panel import HostPanel, html_summary, text_summary
from kinetic_nb.runner.memory import measure
from kinetic_nb.state import HostSnapshot, JobSnapshot, JobStatus

MIB = 1024**2


def test_a_process_measures_its_resident_memory_and_no_accelerator_it_does_not_have():
    figures = measure()
    assert figures["rss"] > 10 * MIB and figures["peak_rss"] >= figures["rss"]
    assert "device" not in figures  # no framework started on an accelerator here


def test_cpu_jax_reports_no_accelerator_memory():
    import jax.numpy as jnp

    jnp.ones(4).sum().block_until_ready()  # JAX's backends up, on CPU
    assert "device" not in measure()


@pytest.mark.parametrize(("size", "others", "flagged"), [
    (1000 * MIB, [400 * MIB, 400 * MIB], True),   # 2.5x and 600 MiB more
    (599 * MIB, [400 * MIB, 400 * MIB], False),   # 199 MiB more: under SKEW_BYTES
    (3000 * MIB, [2800 * MIB, 2800 * MIB], False),  # 200 MiB more of large processes: under both
    (int(SKEW_RATIO * 600 * MIB), [600 * MIB], True),  # exactly the ratio, 300 MiB more
    (int(SKEW_RATIO * 600 * MIB) - 1, [600 * MIB], False),  # just under the ratio
    (100 * MIB + SKEW_BYTES, [100 * MIB], True),  # exactly the amount, far over the ratio
    (100 * MIB + SKEW_BYTES - 1, [100 * MIB], False),  # just under the amount
    (900 * MIB, [], False),  # nothing to compare with
])
def test_a_host_stands_out_by_both_the_ratio_and_the_amount(size, others, flagged):
    assert stands_out(size, others) is flagged


def hosts_with(*rss_mib: int, device_mib: tuple[int, ...] = ()) -> list[HostSnapshot]:
    hosts = []
    for index, size in enumerate(rss_mib):
        memory = {"rss": size * MIB, "peak_rss": size * MIB}
        if device_mib:
            memory |= {"device": device_mib[index] * MIB, "device_peak": device_mib[index] * MIB}
        hosts.append(HostSnapshot(index, "succeeded", "teardown", started_at=0.0, updated_at=1.0, memory=memory))
    return hosts


def test_the_panel_shows_each_hosts_memory_and_flags_the_one_above_the_others():
    snapshot = JobSnapshot("kn-mem", "local", "cpu", JobStatus.SUCCEEDED, 0.0, 2.0,
                           tuple(hosts_with(200, 210, 900, 205, device_mib=(1000, 1000, 1000, 3000))))
    text = text_summary(snapshot)
    assert ("memory: host 0 200 MiB, host 1 210 MiB, host 2 900 MiB, host 3 205 MiB; accelerator memory: "
            "host 0 1000 MiB, host 1 1000 MiB, host 2 1000 MiB, host 3 2.9 GiB") in text.splitlines()
    assert ("host 2 holds 900 MiB of resident memory, 4.4x the others' median (205 MiB): a leak, or a shard "
            "larger than theirs?") in text
    assert "host 3 holds 2.9 GiB of accelerator memory, 3.0x the others' median (1000 MiB)" in text
    assert not any(line.startswith(("host 0 holds", "host 1 holds")) for line in text.splitlines())
    panel = HostPanel(4)
    panel.update(snapshot)
    assert "host 2 holds 900 MiB" in panel.failures.value and "memory: host 0 200 MiB," in panel.failures.value
    assert "memory: 900 MiB resident (peak 900 MiB), 1000 MiB on its accelerators" in panel.details.children[2].value
    assert "host 2 holds 900 MiB" in html_summary(snapshot)


def test_hosts_alike_are_not_flagged_and_hosts_not_measured_show_nothing():
    alike = JobSnapshot("kn-mem", "local", "cpu", JobStatus.SUCCEEDED, 0.0, 2.0, tuple(hosts_with(200, 230, 215)))
    assert memory_flags(alike.hosts) == []
    assert "memory: host 0 200 MiB, host 1 230 MiB, host 2 215 MiB" in text_summary(alike).splitlines()
    unmeasured = JobSnapshot("kn-mem", "local", "cpu", JobStatus.RUNNING, 0.0, 2.0,
                             (HostSnapshot(0, "running", "execute"), HostSnapshot(1, "running", "execute")))
    assert memory_line(unmeasured.hosts) == "" and "memory" not in text_summary(unmeasured)


def test_the_memory_line_and_its_flags_show_once_the_cell_ended_never_while_it_runs():
    """A session host's status carries the figures of its last cell's end: while this cell runs they are not its."""
    hosts = tuple(HostSnapshot(index, "running", "execute", started_at=0.0, updated_at=1.0, memory=host.memory)
                  for index, host in enumerate(hosts_with(200, 210, 900)))
    running = JobSnapshot("ks-mem/cells/000002", "local", "cpu", JobStatus.RUNNING, 0.0, 2.0, hosts)
    panel = HostPanel(3)
    panel.update(running)
    shown = [text_summary(running), html_summary(running), panel.failures.value, panel.details.children[2].value]
    assert not any("MiB" in view for view in shown)
    ended = JobSnapshot("ks-mem/cells/000002", "local", "cpu", JobStatus.SUCCEEDED, 0.0, 2.0,
                        tuple(hosts_with(200, 210, 900)))
    panel.update(ended)
    assert "memory: host 0 200 MiB, host 1 210 MiB, host 2 900 MiB" in panel.failures.value
    assert "host 2 holds 900 MiB" in panel.failures.value and "900 MiB resident" in panel.details.children[2].value


def test_many_hosts_memory_is_a_range():
    assert memory_line(hosts_with(*range(100, 120))) == "memory: 100 MiB to 119 MiB across 20 hosts"


def test_a_host_running_several_processes_is_their_sum():
    processes = hosts_with(100, 100, 100, 500)  # host 1's second process holds more
    snapshot = JobSnapshot("kn-mem", "local", "gpu-h100x2", JobStatus.SUCCEEDED, 0.0, 2.0, tuple(processes),
                           procs_per_host=2)
    text = text_summary(snapshot)
    assert "memory: host 0 200 MiB, host 1 600 MiB" in text.splitlines()
    assert "host 1 holds 600 MiB of resident memory, 3.0x the others' median (200 MiB)" in text


def test_a_real_job_carries_each_hosts_memory_and_flags_the_host_that_holds_more():
    source = ("import os\n"
              "if os.environ['KINETIC_HOST_INDEX'] == '2':\n"
              "    held = b'\\x01' * (700 * 2**20)  # touched, so resident\n"
              "'done'")
    handle = kinetic_nb.submit(source, hosts=3, framework="none", quiet=True)
    assert handle.result(timeout=120) == "done"
    hosts = handle.snapshot().hosts
    assert all(host.memory["rss"] > 10 * MIB for host in hosts)
    assert hosts[2].memory["rss"] - max(hosts[0].memory["rss"], hosts[1].memory["rss"]) > 600 * MIB
    summary = handle.summary()
    assert "memory: host 0 " in summary
    flags = [line for line in summary.splitlines() if " holds " in line]
    assert len(flags) == 1 and flags[0].startswith("host 2 holds ")


def test_a_session_cell_carries_the_memory_its_hosts_hold_after_it():
    session = kinetic_nb.start(hosts=2, framework="none", echo=False)
    try:
        session.run("import os\nmine = int(os.environ['KINETIC_HOST_INDEX'])").result(timeout=120)
        grown = session.run("held = b'\\x01' * (500 * 2**20) if mine == 1 else b''")
        grown.result(timeout=120)
        assert grown.summary().count(" holds ") == 1 and "host 1 holds " in grown.summary()
        freed = session.run("del held\nimport gc\ngc.collect()")
        freed.result(timeout=120)
        assert " holds " not in freed.summary()  # freed: the next cell's figures say so
    finally:
        session.stop()



@pytest.mark.parametrize(("after_each_cell", "reported"), [
    ([200, 300, 400, 500, 600, 200 + 512], True),  # 512 MiB over the last 5 cells
    ([200, 300, 400, 500, 600, 200 + 511], False),  # a MiB short
    ([200, 1000, 1000, 1000, 1000], False),  # 800 MiB, but over 4 cells: not yet the stated number
    ([900, 300, 300, 300, 300, 300, 300], False),  # shrinking
])
def test_a_session_host_whose_memory_grows_by_the_stated_amount_over_the_stated_cells_is_said_once(
        after_each_cell, reported):
    from kinetic_nb.client.memory_growth import GROWTH_BYTES, GROWTH_CELLS, MemoryGrowth

    assert (GROWTH_BYTES, GROWTH_CELLS) == (512 * MIB, 5)
    growth = MemoryGrowth()
    said = []
    for size in after_each_cell:
        said += growth.note([HostSnapshot(0, "idle", "execute", memory={"rss": 300 * MIB}),
                             HostSnapshot(1, "idle", "execute", memory={"rss": size * MIB})])
    assert len(said) == (1 if reported else 0)
    if reported:
        assert said[0] == ("kinetic_nb: host 1's memory grew by 512 MiB over the last 5 cells (200 MiB -> 712 MiB): "
                           "does a cell keep what it makes (a list it appends to, arrays it caches)?")
        assert growth.note([HostSnapshot(1, "idle", "execute", memory={"rss": 2000 * MIB})]) == []  # said once


def test_a_session_whose_cells_keep_growing_on_one_host_says_so_once_in_the_cells_output(capfd):
    session = kinetic_nb.start(hosts=2, framework="none", echo=False)
    try:
        session.run("import os\nmine = int(os.environ['KINETIC_HOST_INDEX'])\nkept = []").result(timeout=120)
        capfd.readouterr()
        for _ in range(6):
            session.run("kept.append(b'\\x01' * (120 * 2**20) if mine == 1 else b'')").result(timeout=120)
        said = [line for line in capfd.readouterr().err.splitlines() if "memory grew" in line]
        assert len(said) == 1 and said[0].startswith("kinetic_nb: host 1's memory grew by ")
        assert "over the last 5 cells" in said[0]
    finally:
        session.stop()
