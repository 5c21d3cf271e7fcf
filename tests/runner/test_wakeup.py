"""A local session's wakeups: the host whose end completes a cell's count wakes the notebooks, once."""

from __future__ import annotations

import concurrent.futures

from kinetic_nb.runner.wakeup import last_to_end


def test_only_the_host_that_completes_the_count_is_the_last_to_end(tmp_path):
    count = str(tmp_path / "ends")
    assert [last_to_end(count, 4) for _ in range(4)] == [False, False, False, True]


def test_hosts_ending_together_leave_at_least_one_to_wake_the_notebook(tmp_path):
    for cell in range(50):
        count = str(tmp_path / f"ends-{cell}")
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            said = list(pool.map(last_to_end, [count] * 8, [8] * 8))
        assert any(said), cell
        assert (tmp_path / f"ends-{cell}").stat().st_size == 8  # every byte landed: none wrote over another's


def test_a_count_that_cannot_be_kept_wakes_rather_than_waits(tmp_path):
    assert last_to_end(str(tmp_path / "no" / "such" / "folder" / "ends"), 4) is True
