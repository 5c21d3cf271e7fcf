"""How a handle is shown without the client importing the display: a registry of views.

The client never imports the display (DESIGN, "Dependency rule"): a
``CellHandle`` asks this registry by name instead, ``views.render("text",
snapshot)``, and ``kinetic_nb.notebook.display`` fills the registry when it is
imported (its ``__init__`` calls ``register`` for each of its views). The
package root wires the two together: ``load_ipython_extension`` and the first
use of the public API (``kinetic_nb.submit``, ``start``, ``attach``, ...)
import the display, so a handle is shown however it was made.

The views ``kinetic_nb.notebook.display`` registers:

``text``      ``JobSnapshot -> str``: the plain-text table (``CellHandle.summary``)
``html``      ``JobSnapshot -> str``: the static HTML snapshot (``_repr_html_``)
``watch``     ``SnapshotSource -> Thread``: the live panel kept current (``watch``)
``timeline``  ``JobSnapshot -> Figure``: the phase plot (``timeline``)

This module imports nothing of the package, so a view provider other than the
display (a test's, a future one) can register into it too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["register", "render"]

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
    """Call the view registered as ``name``.

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
        When no view of that name is registered (nothing imported the display).
    """
    view = _views.get(name)
    if view is None:
        raise LookupError(f"no view {name!r} is registered (known: {', '.join(sorted(_views)) or 'none'}): "
                          "import kinetic_nb.notebook.display, as kinetic_nb's public API does")
    return view(*args, **kwargs)
