"""An IPython shell of a test's own with the extension loaded: a session the test starts in it ends with it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from IPython.core.interactiveshell import InteractiveShell


@contextmanager
def magic_shell() -> Iterator[InteractiveShell]:
    """The shell; at the end, its session stopped (if it started one) and the shell cleared."""
    InteractiveShell.clear_instance()
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "kinetic_nb")
    try:
        yield shell
    finally:
        magics = shell.magics_manager.registry["KineticMagics"]
        if magics.session is not None:
            shell.run_line_magic("kinetic", "stop")
        InteractiveShell.clear_instance()
