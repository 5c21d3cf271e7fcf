"""A slice of 1,024 light hosts (``KINETIC_LIGHT_HOSTS=1``: hosts with no framework, forked from the lean agent)
runs the real protocol on this machine: the start barrier, each cell's barrier and its outcome by the seed's rules,
the notebook's looks, the panel's text twin. Every host is a real process; none survives the test."""

from __future__ import annotations

import io
import os
import time

import pytest

import kinetic_nb
from kinetic_nb.agent import processes
from kinetic_nb.notebook.display.panel import text_summary

HOSTS = processes.MAX_LIGHT_HOSTS
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def forked_at(pid: int) -> float:
    """When process ``pid`` began, on ``time.time()``'s clock (to a clock tick): /proc counts from the boot."""
    with open(f"/proc/{pid}/stat") as stat:
        ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    return ticks * TICK_S + time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


@pytest.fixture
def light_hosts(monkeypatch):
    monkeypatch.setenv(processes.LIGHT_HOSTS_ENV, "1")
    problem = processes.host_count_problem(HOSTS, "none")
    assert problem is None, problem  # this machine runs them (2 cores, 24 GiB); it is said in one line if not


def test_a_session_of_1024_light_hosts_runs_cells_by_the_seeds_rules(light_hosts, tmp_path):
    started_at = time.monotonic()
    session = kinetic_nb.start(hosts=HOSTS, framework="none", idle_timeout=600, echo=False)
    try:
        start_s = time.monotonic() - started_at
        # The hosts start together: none began its work (its status's start) before the last one was forked.
        statuses = [session.host_status(rank) for rank in range(HOSTS)]
        last_fork = max(forked_at(status.pid) for status in statuses)
        first_start = min(status.started_at for status in statuses)
        assert first_start >= last_fork - TICK_S, f"a host started {last_fork - first_start:.3f} s before the last fork"
        assert session.run("import os\nint(os.environ['KINETIC_HOST_INDEX'])").result() == 0  # the leader's value
        printed = io.StringIO()
        # Host 1000 fails once every host has printed its line (each leaves a mark after it): a failure stops the
        # hosts still running, so without this a host on a busy machine could be stopped before its print.
        failing = session.run(f"import os, time\nhost = int(os.environ['KINETIC_HOST_INDEX'])\n"
                              "print('step 10 loss 9.99' if host == 7 else 'step 10 loss 0.53', flush=True)\n"
                              f"open(os.path.join({str(tmp_path)!r}, str(host)), 'w').close()\n"
                              "if host == 1000:\n"
                              f"    while len(os.listdir({str(tmp_path)!r})) < {HOSTS}:\n"
                              "        time.sleep(0.05)\n"
                              "    raise ValueError('host 1000 lost its shard')",
                              echo=lambda text, stream: printed.write(text))
        with pytest.raises(ValueError, match="host 1000 lost its shard") as info:
            failing.result()
        assert printed.getvalue() == "step 10 loss 0.53\n"  # the leader's output only, as ever
        assert "Reported by host 1000" in "\n".join(getattr(info.value, "__notes__", []))
        assert [host.state for host in failing.final.hosts].count("failed") == 1
        # The panel's rows show every host's last line as it is: identical ones once, with their hosts.
        summary = text_summary(failing.final)
        assert "host 7: step 10 loss 9.99" in summary, summary
        assert "hosts 0-6, 8-999, 1001-1023: step 10 loss 0.53" in summary, summary
        assert session.run("x = 41\nx + 1").result() == 42  # the slice stayed up: every host back to idle
        print(f"1,024 light hosts: session up in {start_s:.1f} s")
    finally:
        session.stop()
