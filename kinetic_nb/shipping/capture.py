"""What a cell reads from the notebook, and the checks done before any host starts.

The hosts run the cell in a fresh namespace, so every notebook variable the cell
may read travels with it. :func:`names_read_from_notebook` finds those names by
scope analysis of the cell's AST: top-level statements (and class bodies) are
followed in execution order, so a name the cell binds before it reads it stays
behind; function, lambda and comprehension bodies read every global name that
is not their own. Where the analysis cannot be sure, it includes the name:
shipping one value too many costs bytes, one too few breaks the cell.

:func:`pickle_namespace` pickles each value once with cloudpickle, which sends
functions and classes defined in the notebook by value and modules by
reference; a value that cannot be pickled is named, with its type and the
reason, before any host starts.

This module never imports IPython: the magic hands it the notebook namespace.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

import cloudpickle

from kinetic_nb.errors import CellSyntaxError, UnpicklableValueError
from kinetic_nb.shipping.scopes import cell_reads

__all__ = [
    "imported_modules",
    "module_roots",
    "names_read_from_notebook",
    "parse_cell",
    "pickle_namespace",
]

#: Names IPython puts in the notebook namespace for itself. The hosts have no
#: IPython; shipping these would drag the kernel's history and shell along.
IPYTHON_NAMES = frozenset(
    {"In", "Out", "get_ipython", "exit", "quit", "_oh", "_ih", "_dh", "_exit_code"}
    | {"_", "__", "___", "_i", "_ii", "_iii"}
)
#: IPython's numbered history: ``_i7`` (input 7) and ``_7`` (output 7).
_IPYTHON_HISTORY_NAME = re.compile(r"_i?\d+")
#: Module attributes of the notebook's ``__main__``; each host's namespace has its own.
MODULE_ATTRIBUTES = frozenset(
    {
        "__name__", "__doc__", "__package__", "__loader__", "__spec__", "__file__",
        "__cached__", "__builtins__", "__builtin__", "__annotations__",
    }
)  # fmt: skip
#: IPython puts wrappers of some builtins (``open``) in the notebook namespace; they are
#: IPython's, not the user's, and the hosts have the builtin itself.
_IPYTHON_PACKAGE = "IPython"
#: A pickling error longer than this is cut: the message must stay one readable line.
_MAX_REASON = 300
#: Lines only IPython runs: a shell escape or a magic at the start of a line or
#: after ``name =`` (``!ls``, ``%time f()``, ``files = !ls``), or a help query (``obj?``, ``?obj``).
_IPYTHON_LINE = re.compile(
    r"^\s*(?:[\w.]+\s*=\s*)?(?P<command>(?:!|%{1,2})\S.*)$|^\s*(?P<help>\?{1,2}[\w.]+|[\w.]+\?{1,2})\s*$"
)
#: What to write instead: for a shell escape, a magic, a help query.
_IPYTHON_ALTERNATIVE = {
    "!": "use subprocess",
    "%": "IPython magics do not run there; write the Python they stand for",
    "?": "help queries do not run there; ask in another cell",
}



# --------------------------------------------------------------------------- parsing


def parse_cell(source: str, filename: str) -> ast.Module:
    """Parse and compile-check a cell.

    The cell is compiled the way the hosts compile it (no top-level ``await``),
    so errors the compiler finds (``return`` outside a function, ``nonlocal`` at
    top level) surface here, before any host starts.

    Parameters
    ----------
    source : str
        The cell's source, without the ``%%kinetic`` line.
    filename : str
        The name tracebacks show for the cell.

    Returns
    -------
    ast.Module

    Raises
    ------
    CellSyntaxError
        Its first line names the cell line and the error, e.g.
        ``syntax error in the cell at line 3: invalid syntax``; the second line
        shows the offending source line. IPython syntax (``!ls``, ``%time``)
        is not supported in a kinetic cell and is reported the same way.
    """
    try:
        tree = ast.parse(source, filename=filename)
        compile(tree, filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes, on some 3.11 releases
        # The cell error replaces the parser's: it carries the same line, offset and text.
        raise _cell_syntax_error(source, filename, exc) from None
    return tree


def _cell_syntax_error(source: str, filename: str, exc: SyntaxError | ValueError) -> CellSyntaxError:
    reason, lineno, offset, text = str(exc), None, None, None
    if isinstance(exc, SyntaxError):
        reason, lineno, offset, text = exc.msg, exc.lineno, exc.offset, exc.text
    if lineno is None and "\0" in source:
        lineno = source.count("\n", 0, source.index("\0")) + 1
    lines = source.splitlines()
    if text is None and lineno is not None and 1 <= lineno <= len(lines):
        text = lines[lineno - 1]
    where = f"at line {lineno}" if lineno is not None else "(line unknown)"
    ipython = ipython_syntax(text or "")
    if ipython is not None:
        message = (f"line {lineno} uses `{ipython}`: %%kinetic cells run as plain Python on the hosts; "
                   f"{_IPYTHON_ALTERNATIVE.get(ipython[0], _IPYTHON_ALTERNATIVE['?'])}")
        return CellSyntaxError(message, (filename, lineno, offset, text))
    if text and text.strip():
        where += f" ({text.strip()!r})"  # repr escapes control characters such as a null byte
    message = f"syntax error in the cell {where}: {reason}"
    return CellSyntaxError(message, (filename, lineno, offset, text))


def ipython_syntax(line: str) -> str | None:
    """The IPython-only construct a line that does not parse uses (``!ls``, ``%time``, ``x = !ls``, ``obj?``).

    Parameters
    ----------
    line : str
        One source line that Python could not parse.

    Returns
    -------
    str or None
        The construct as written (a shell command or magic up to its first
        space, a help query whole), or None when the line is not IPython syntax.
    """
    match = _IPYTHON_LINE.match(line)
    if match is None:
        return None
    return match.group("help") or match.group("command").split()[0]


# --------------------------------------------------------------------------- names


def names_read_from_notebook(tree: ast.Module, user_ns: Mapping[str, Any]) -> list[str]:
    """The notebook names the cell may read before (or without) binding them itself.

    Parameters
    ----------
    tree : ast.Module
        The cell, from :func:`parse_cell`.
    user_ns : Mapping
        The notebook namespace.

    Returns
    -------
    list of str
        Sorted names that exist in ``user_ns`` and the cell may read from it.
        Builtins (unless the notebook rebound them), IPython's own names and
        module attributes such as ``__name__`` are left out.
    """
    candidates = cell_reads(tree)
    return sorted(name for name in candidates if name in user_ns and _is_user_variable(name, user_ns[name]))


def _is_user_variable(name: str, value: Any) -> bool:
    if name in IPYTHON_NAMES or name in MODULE_ATTRIBUTES or _IPYTHON_HISTORY_NAME.fullmatch(name):
        return False
    if hasattr(builtins, name):
        # Shipped only when the notebook rebound the builtin to a value of its own.
        builtin = getattr(builtins, name)
        wraps_the_builtin = getattr(value, "__wrapped__", None) is builtin
        from_ipython = str(getattr(value, "__module__", "")).partition(".")[0] == _IPYTHON_PACKAGE
        return not (value is builtin or wraps_the_builtin or from_ipython)
    return True


# --------------------------------------------------------------------------- modules


def imported_modules(tree: ast.Module) -> set[str]:
    """Top-level packages the cell imports, anywhere in it.

    Parameters
    ----------
    tree : ast.Module

    Returns
    -------
    set of str
        ``import jax.numpy as jnp`` gives ``jax``; ``from torch import nn`` gives
        ``torch``. Relative imports are ignored. Modules among the shipped
        values are found by :func:`module_roots`.
    """
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.partition(".")[0])
    return roots


def module_roots(values: Iterable[Any]) -> set[str]:
    """Top-level package names of the modules among ``values``.

    Parameters
    ----------
    values : iterable
        Notebook values the cell reads (a module travels by reference and is
        re-imported by name on each host).

    Returns
    -------
    set of str
        e.g. ``{"numpy"}`` for ``[numpy.linalg, 3]``.
    """
    return {value.__name__.partition(".")[0] for value in values if isinstance(value, ModuleType)}


# --------------------------------------------------------------------------- pickling


def pickle_namespace(names: Iterable[str], user_ns: Mapping[str, Any]) -> dict[str, bytes]:
    """Pickle each named notebook value once, with cloudpickle.

    Functions and classes defined in the notebook travel by value, modules by
    reference (each host imports them by name).

    Parameters
    ----------
    names : iterable of str
        Names in ``user_ns``, usually from :func:`names_read_from_notebook`.
    user_ns : Mapping
        The notebook namespace.

    Returns
    -------
    dict
        name -> pickled bytes, in the order of ``names``.

    Raises
    ------
    UnpicklableValueError
        One line naming the variable, its type and the reason, raised from the
        pickling error.
    """
    pickled: dict[str, bytes] = {}
    for name in names:
        value = user_ns[name]
        try:
            pickled[name] = cloudpickle.dumps(value)
        except Exception as exc:
            error = UnpicklableValueError(
                f"cannot ship variable {name!r} (a {_type_name(value)}) to the hosts: {_one_line(exc)}"
            )
            error.add_note(f"Create {name!r} inside the cell instead, so that each host builds its own.")
            raise error from exc
    return pickled


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _one_line(exc: Exception) -> str:
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."
