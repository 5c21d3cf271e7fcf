"""After a failed or interrupted cell the session stays up when every host comes back; these are the
cases that once lost it: an interrupt sent before the hosts entered the cell, and a next cell that
started (and ran past the grace period) before the agent saw the hosts idle."""

from __future__ import annotations

import pytest

import kinetic_nb


def test_an_interrupt_before_the_hosts_enter_the_cell_stops_it_and_keeps_the_session():
    session = kinetic_nb.start(hosts=2, framework="none", echo=False, quiet=True, grace=5)
    try:
        for _ in range(2):  # the second time, the first cell's late SIGINT must not leak into it
            cell = session.run("import time\nwhile True:\n    time.sleep(0.05)")
            cell.interrupt()
            with pytest.raises(KeyboardInterrupt):
                cell.result(timeout=60)
            assert session.ended() is None
            assert session.run("x = 3; x").result(timeout=60) == 3
    finally:
        session.stop()


def test_hosts_busy_with_the_next_cell_have_come_back_from_the_failed_one():
    session = kinetic_nb.start(hosts=2, framework="none", echo=False, quiet=True, grace=2)
    try:
        failing = "import os, time\nif os.environ['KINETIC_HOST_INDEX'] == '1':\n    raise ValueError('boom')\ntime.sleep(0.5)"
        with pytest.raises(ValueError, match="boom"):
            session.run(failing).result(timeout=60)
        assert session.run("time.sleep(4); 5").result(timeout=60) == 5  # longer than the grace period
        assert session.ended() is None
    finally:
        session.stop()
