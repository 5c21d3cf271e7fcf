"""An interrupt sent the moment a session's cell is submitted, before any host has entered it, still
stops the cell, and the session stays up (it used to be lost, and the agent then ended the session)."""

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
