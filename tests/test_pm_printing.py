"""``%kinetic pm`` prints a host's repr as text: a control character in it cannot clear the notebook's output, hide
what came before, or ring a bell (issue #38: replaced as ``%kinetic jobs`` replaces them, its lines kept)."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

from .magic_shell import magic_shell

#: A value whose repr, made on the host, clears the screen, returns to the line's start and rings the bell.
HOSTILE_CELL = """
import os
class Hostile:
    def __repr__(self):
        return 'before\\x1b[2J\\rafter\\x07\\nsecond line'
value = Hostile()
if os.environ['KINETIC_HOST_INDEX'] == '1':
    raise RuntimeError('host 1 fails')
"""


def test_the_pm_magic_replaces_control_characters_of_a_remote_repr_and_keeps_its_lines():
    with magic_shell() as shell:
        shell.run_line_magic("kinetic", "start -n 2 --framework none --idle-timeout 600")
        failed = shell.run_cell(f"%%kinetic --quiet\n{HOSTILE_CELL}")
        assert "host 1 fails" in str(failed.error_in_exec)
        printed = io.StringIO()
        with redirect_stdout(printed):
            answered = shell.run_cell("%kinetic pm --cell 1 value")
        assert answered.error_in_exec is None
        text = printed.getvalue()
        assert not any(char in text for char in "\x1b\r\x07")
        assert text == "before?[2J?after?\nsecond line\n"
