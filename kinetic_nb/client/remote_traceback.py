"""A host's traceback drawn as IPython draws a local one: a rule, the exception's name over "Traceback",
one block per frame (``Cell In[4], line 4`` for the cell, ``File path:line, in name`` elsewhere) with the
``---->`` marker on the line that ran, the exception in red, then its notes.

The text comes from the host (``traceback.format_exception``); it is only parsed and coloured here,
never evaluated. Lines it does not recognise (a chained exception's "During handling ..." say) are kept.
"""

from __future__ import annotations

import re

__all__ = ["render_remote_traceback"]

RULE = "-" * 75
RED, GREEN, CYAN, BOLD, RESET = "\x1b[31m", "\x1b[32m", "\x1b[36m", "\x1b[1m", "\x1b[0m"

_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$')
_CARETS = re.compile(r"^\s*[~^]+\s*$")
_CELL_FILE = re.compile(r"^<kinetic (?P<cell>[^>]*)>$")
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?P<rest>:.*)?$")


def _location(file: str, line: str, name: str) -> str:
    cell = _CELL_FILE.match(file)
    if cell:
        return f"{CYAN}Cell {cell['cell']}{RESET}, line {line}"
    return f"File {GREEN}{file}:{line}{RESET}, in {CYAN}{name}{RESET}"


def render_remote_traceback(text: str, exception_type: str, where: str, notes: list[str] = ()) -> list[str]:
    """The lines IPython shows for a host's exception (its ``_render_traceback_``).

    Parameters
    ----------
    text : str
        The host's traceback, as Python formats it.
    exception_type : str
        The exception's class name, shown over the traceback as IPython does.
    where : str
        Which host of which job, said after "Traceback".
    notes : list of str
        The exception's notes, shown after it.
    """
    head = f"{RED}{exception_type}{RESET}"
    lines = [f"{RED}{RULE}{RESET}",
             f"{head}{' ' * max(1, 42 - len(exception_type))}Traceback from {where} (most recent call last)"]
    body = text.rstrip("\n").splitlines()
    if body and body[0].startswith("Traceback (most recent call last)"):
        body = body[1:]
    index, after_frame = 0, False
    while index < len(body):
        line = body[index]
        frame = _FRAME.match(line)
        if frame:
            lines.append(_location(frame["file"], frame["line"], frame["name"]))
            code = body[index + 1] if index + 1 < len(body) and body[index + 1].startswith("    ") else None
            if code is not None and not _CARETS.match(code):
                number = frame["line"]
                lines.append(f"{GREEN}{'-' * max(1, 5 - len(number))}> {number}{RESET} {code.strip()}")  # IPython's arrow
                index += 1
            while index + 1 < len(body) and _CARETS.match(body[index + 1]):
                index += 1  # Python's ^^^^ under the expression: the marker says the line
            lines.append("")
            after_frame = True
        elif not line.startswith("Traceback (most recent call last)"):
            exception = _EXCEPTION.match(line) if after_frame else None
            # The first line after a traceback's frames is its exception (a chained one's too).
            lines.append(f"{RED}{BOLD}{exception['type']}{RESET}{exception['rest'] or ''}" if exception else line)
            after_frame = False
        index += 1
    lines.extend(notes)
    return lines
