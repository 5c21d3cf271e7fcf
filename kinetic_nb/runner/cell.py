"""Running the cell on a host the way IPython runs a notebook cell.

The last expression is the cell's value, unless a ``;`` ends it;
``display(...)`` and matplotlib figures become rich output
(``runner.display``); ``sys.exit(0)`` or ``sys.exit()`` ends the cell
successfully, and any other ``SystemExit`` fails the host as a
``HostExitError`` with the cell's traceback, so the notebook never receives
a ``SystemExit`` (which IPython would show without its traceback, and which
would end a script that called ``result()``).
"""

from __future__ import annotations

import ast
import io
import linecache
import tokenize
from typing import Any

import cloudpickle

from kinetic_nb.errors import HostExitError
from kinetic_nb.runner import host_display as display
from kinetic_nb.runner import protocol

__all__ = ["ends_with_semicolon", "execute_cell", "load_notebook_values", "run_cell"]

#: Tokens that end a cell without being part of its last statement.
_TRAILING_TOKENS = frozenset({tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT, tokenize.ENDMARKER,
                              tokenize.INDENT, tokenize.DEDENT})


def ends_with_semicolon(source: str) -> bool:
    """Whether the cell's last statement ends with ``;``, which hides the value in IPython.

    Parameters
    ----------
    source : str
        The cell's source.

    Returns
    -------
    bool
        True for ``plt.plot(x);`` or ``model.fit(data);  # quiet``.
    """
    last = None
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type not in _TRAILING_TOKENS:
                last = token
    except (tokenize.TokenError, SyntaxError):
        return False
    return last is not None and last.type == tokenize.OP and last.string == ";"


def remember_source(source: str, filename: str) -> None:
    """Register the cell's ``source`` with ``linecache`` under ``filename``: tracebacks (on a host) and a quiet
    host's stacks (in the notebook) show the cell's own lines."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)


def run_cell(source: str, filename: str, namespace: dict[str, Any]) -> Any:
    """Execute the cell in ``namespace``; return its last expression's value (or None).

    The source is registered with ``linecache`` under ``filename``, so
    tracebacks show the cell's own lines. A last expression followed by
    ``;`` runs as a statement: the cell has no value.
    """
    remember_source(source, filename)
    tree = ast.parse(source, filename)
    last_expression = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not ends_with_semicolon(source):
        last_expression = ast.Expression(tree.body.pop().value)
    # dont_inherit: the cell must not pick up this module's __future__ imports.
    exec(compile(tree, filename, "exec", dont_inherit=True), namespace)  # noqa: S102 - running the user's cell is the point
    if last_expression is None:
        return None
    return eval(compile(last_expression, filename, "eval", dont_inherit=True), namespace)  # noqa: S307


def execute_cell(source: str, filename: str, namespace: dict[str, Any], *, host_index: int, leader: bool) -> Any:
    """Run the cell with rich output routed to the log; return its value.

    Parameters
    ----------
    source, filename : str
        The cell and the name its frames carry.
    namespace : dict
        The cell's globals.
    host_index : int
        This host, for the message of a failing ``SystemExit``.
    leader : bool
        Only the leader's rich output reaches the cell.

    Raises
    ------
    HostExitError
        The cell raised ``SystemExit`` with a code other than 0 or None;
        the error carries the ``SystemExit``'s traceback (the cell's frames).
    """
    display.install(namespace, leader=leader)
    try:
        value = run_cell(source, filename, namespace)
    except SystemExit as exit_:
        if exit_.code is None or exit_.code == 0:
            value = None  # the cell ended itself successfully, as a script does
        else:
            error = HostExitError(f"the cell on host {host_index} exited with SystemExit({exit_.code!r}); "
                                  "only sys.exit(0) or sys.exit() ends a host successfully")
            error.code = exit_.code
            raise error.with_traceback(exit_.__traceback__) from None
    display.show_open_figures(value)
    return value


def load_notebook_values(cell: dict[str, Any], host_index: int) -> dict[str, Any]:
    """The notebook values a cell's payload ships, unpickled one by one (a failure names the variable)."""
    values = {}
    for name, pickled in cell[protocol.CELL_NAMESPACE].items():
        try:
            values[name] = cloudpickle.loads(pickled)
        except Exception as error:
            error.add_note(f"while loading the notebook variable {name!r} on host {host_index}")
            raise
    return values
