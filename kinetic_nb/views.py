"""How a handle is shown without the client importing the display: a registry of views.

The client never imports the display (DESIGN, "Dependency rule"): a
``JobHandle`` asks this registry by name instead, ``views.render("text",
snapshot)``, and ``kinetic_nb.display`` fills the registry when it is imported
(``display/__init__.py`` calls ``register`` for each of its views). The magic
and ``load_ipython_extension`` import the display, so in a notebook it is
registered before any handle exists; anywhere else (a script, a test) the
first ``render`` imports the display by its module name, here and only here.

The views ``kinetic_nb.display`` registers:

``text``      ``JobSnapshot -> str``: the plain-text table (``JobHandle.summary``)
``html``      ``JobSnapshot -> str``: the static HTML snapshot (``_repr_html_``)
``watch``     ``SnapshotSource -> Thread``: the live panel kept current (``watch``)
``timeline``  ``JobSnapshot -> Figure``: the phase plot (``timeline``)

This module imports nothing of the package, so a view provider other than the
display (a test's, a future one) can register into it too.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["DISPLAY_MODULE", "register", "render"]

#: The module that registers the package's views when it is imported.
DISPLAY_MODULE = "kinetic_nb.display"

_views: dict[str, Callable[..., Any]] = {}


def register(name: str, view: Callable[..., Any]) -> None:
    """Make ``view`` what ``render(name, ...)`` calls (a later registration replaces it).

    Parameters
    ----------
    name : str
        The view's name: ``text``, ``html``, ``watch``, ``timeline``.
    view : callable
        Called with ``render``'s arguments; what it returns, ``render`` returns.
    """
    _views[name] = view


def render(name: str, *args: Any, **kwargs: Any) -> Any:
    """Call the view registered as ``name``, importing the display first if nothing registered it.

    Parameters
    ----------
    name : str
        A registered view's name.
    *args, **kwargs
        Passed to the view (a ``JobSnapshot``, or for ``watch`` a ``SnapshotSource``).

    Returns
    -------
    Any
        What the view returns.

    Raises
    ------
    LookupError
        When no view of that name is registered, even after importing the display.
    """
    view = _views.get(name)
    if view is None:
        importlib.import_module(DISPLAY_MODULE)  # registers its views as it is imported
        view = _views.get(name)
    if view is None:
        raise LookupError(f"no view {name!r} is registered (known: {', '.join(sorted(_views)) or 'none'})")
    return view(*args, **kwargs)
