"""Running the cell on a host (kinetic_nb.runner.cell): the value, a trailing `;`, SystemExit."""

from __future__ import annotations

import sys

import pytest

from kinetic_nb.errors import HostExitError, KineticError
from kinetic_nb.runner import host_display as display
from kinetic_nb.runner.cell import ends_with_semicolon, execute_cell, run_cell

CELL = "<kinetic cell>"


@pytest.fixture(autouse=True)
def host_process_settings(monkeypatch):
    """execute_cell sets a host process up (MPLBACKEND, an import hook); this process is given them back.

    Left behind, MPLBACKEND would reach every kernel a later test starts, and
    their figures would go to the hosts' display records instead of the cell.
    """
    monkeypatch.setenv("MPLBACKEND", "agg")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(display, "_rich", display._rich)


@pytest.mark.parametrize(
    ("source", "quiet"),
    [("1 + 1;", True), ("1 + 1;  # quiet\n\n", True), ("x = 1\nf(x);", True), ("1 + 1", False),
     ("print('a;')", False), ("x = [1,\n     2];", True), ("if x:\n    y;\n", True), ("# ;", False)],
)
def test_a_trailing_semicolon_is_found_as_ipython_finds_it(source, quiet):
    assert ends_with_semicolon(source) is quiet


def test_a_trailing_semicolon_hides_the_value_but_runs_the_expression():
    namespace: dict = {}
    assert run_cell("calls = []\ncalls.append(1) or 7;", CELL, namespace) is None
    assert namespace["calls"] == [1]
    assert run_cell("7", CELL, {}) == 7


@pytest.mark.parametrize("exit_call", ["sys.exit()", "sys.exit(0)", "raise SystemExit(None)", "exit(0)"])
def test_exiting_with_zero_or_none_ends_the_cell_successfully(exit_call):
    namespace: dict = {}
    value = execute_cell(f"import sys\nbefore = 1\n{exit_call}\nafter = 2\n3", CELL, namespace, host_index=1,
                         leader=False)
    assert value is None and namespace["before"] == 1 and "after" not in namespace


def test_a_nonzero_exit_fails_the_host_with_the_cells_traceback():
    import traceback

    with pytest.raises(HostExitError) as raised:
        execute_cell("import sys\nsys.exit(3)", CELL, {}, host_index=2, leader=False)
    error = raised.value
    assert isinstance(error, KineticError) and not isinstance(error, SystemExit) and error.code == 3
    assert str(error).startswith("the cell on host 2 exited with SystemExit(3)")
    frames = traceback.extract_tb(error.__traceback__)
    assert (frames[-1].filename, frames[-1].lineno, frames[-1].line) == (CELL, 2, "sys.exit(3)")
