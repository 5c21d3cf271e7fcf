"""Rich output on a host: ``display(...)`` and matplotlib figures become display records in its log.

A cell in a notebook shows rich output through IPython; a host runs plain
Python. Here the same calls work on every host: ``display`` is put in the
cell's namespace (IPython's own ``display`` and ``publish_display_data`` are
routed here too once the cell imports IPython), and matplotlib draws with
the ``kinetic_nb.runner.figures`` backend, which shows each figure on
``plt.show()`` and, as the notebook's inline backend does, every figure
still open when the cell ends. Each output becomes one record sent to the
host's agent on its marks pipe (``runner.marks``), never on stdout, so that
nothing the cell prints can pass for one; it keeps its place among the lines
printed around it, and the client publishes the leader's records as rich
output. A worker's records carry only their text. With no agent to read them
(``python -m kinetic_nb.runner`` run by hand), a record is printed as its text.

Host-safe: IPython and matplotlib are imported only when the cell does.
"""

from __future__ import annotations

import base64
import importlib.abc
import importlib.machinery
import json
import os
import sys
from typing import Any

from kinetic_nb.runner import marks

__all__ = ["FIGURE_BACKEND", "display", "install", "publish_display_data", "show_open_figures"]

#: The matplotlib backend hosts draw with, unless the user chose one (``MPLBACKEND``).
FIGURE_BACKEND = "module://kinetic_nb.runner.figures"
#: Backends that draw into a notebook's kernel: a host inherits one from the kernel
#: that started it (ipykernel sets ``MPLBACKEND``) but has no kernel to draw into.
_NOTEBOOK_BACKENDS = frozenset({"inline", "module://matplotlib_inline.backend_inline",
                                "module://ipykernel.pylab.backend_inline", "nbagg", "widget", "ipympl",
                                "module://ipympl.backend_nbagg"})
#: Where IPython defines the functions routed here; patched when the cell first imports it.
_IPYTHON_DISPLAY_MODULES = ("IPython.core.display_functions", "IPython.core.display", "IPython.display")
#: The ``_repr_*_`` methods a value may offer, by the MIME type each returns (IPython's own list).
_REPR_METHODS = {
    "text/html": "_repr_html_",
    "text/markdown": "_repr_markdown_",
    "image/svg+xml": "_repr_svg_",
    "image/png": "_repr_png_",
    "image/jpeg": "_repr_jpeg_",
    "text/latex": "_repr_latex_",
    "application/json": "_repr_json_",
    "application/javascript": "_repr_javascript_",
    "application/pdf": "_repr_pdf_",
}

#: Whether this host's records carry rich data (the leader's) or only their text (a worker's).
_rich = True


def publish_display_data(data: dict[str, Any], metadata: dict[str, Any] | None = None, **_: Any) -> None:
    """Send one display record to the host's agent (IPython's ``publish_display_data``, on a host).

    Parameters
    ----------
    data : dict
        MIME type to content; bytes (a PNG) are sent base64-encoded, as Jupyter does.
    metadata : dict, optional
        MIME type to its metadata.
    """
    data = {mime: _jsonable(value) for mime, value in data.items()}
    if not _rich:
        data = {"text/plain": data.get("text/plain", "<display>")}
    record = json.dumps({"data": data, "metadata": metadata or {}}, default=str)
    if not marks.send_display(record):  # no agent reads this host's marks, or too large to travel: its text
        text = str(data.get("text/plain", "<display>"))
        print(text if text.endswith("\n") else text + "\n", end="", flush=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return value


def mime_bundle(obj: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``obj``'s MIME bundle and metadata: IPython's formatters when it is loaded, its ``_repr_*_`` methods else."""
    if "IPython" in sys.modules:
        from IPython.core.formatters import DisplayFormatter

        return DisplayFormatter().format(obj)
    data: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    bundle = _call_repr(obj, "_repr_mimebundle_")
    if isinstance(bundle, tuple):
        bundle, metadata = bundle
    data.update(bundle or {})
    for mime, method in _REPR_METHODS.items():
        if mime not in data:
            value = _call_repr(obj, method)
            if isinstance(value, tuple):
                value, metadata[mime] = value
            if value is not None:
                data[mime] = value
    data.setdefault("text/plain", repr(obj))
    return data, metadata


def _call_repr(obj: Any, method: str) -> Any:
    if isinstance(obj, type):
        return None  # a class's _repr_*_ methods are its instances'
    function = getattr(obj, method, None)
    return function() if callable(function) else None


def display(*objs: Any, include: Any = None, exclude: Any = None, metadata: dict[str, Any] | None = None,
            transient: Any = None, display_id: Any = None, raw: bool = False, clear: bool = False,
            **kwargs: Any) -> None:
    """Show each object as rich output in the cell (IPython's ``display``, on a host).

    ``raw=True`` takes each object as a MIME bundle already. Display ids and
    ``clear`` are not supported on a host: each call adds its outputs.
    """
    for obj in objs:
        if raw:
            data, meta = dict(obj), {}
        else:
            data, meta = mime_bundle(obj)
            if include is not None:
                data = {mime: value for mime, value in data.items() if mime in include}
            if exclude is not None:
                data = {mime: value for mime, value in data.items() if mime not in exclude}
        if data:
            publish_display_data(data, {**meta, **(metadata or {})})


def _route_ipython(module: Any) -> None:
    """Point an IPython display module's functions here (a host has no IPython shell to publish through)."""
    for name, function in (("display", display), ("publish_display_data", publish_display_data)):
        if hasattr(module, name):
            setattr(module, name, function)


class _RoutingLoader(importlib.abc.Loader):
    """Runs a module as its own loader would, then routes its display functions here."""

    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _route_ipython(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)  # get_source and the rest: tracebacks read the module's lines


class _RouteWhenImported(importlib.abc.MetaPathFinder):
    """Routes IPython's display functions here as each of its display modules is first imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _IPYTHON_DISPLAY_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RoutingLoader(spec.loader)
        return spec


def install(namespace: dict[str, Any], *, leader: bool) -> None:
    """Make ``display`` and figures work in the cell about to run in ``namespace``.

    Parameters
    ----------
    namespace : dict
        The cell's globals: ``display`` is added unless the notebook sent one.
    leader : bool
        A worker's records carry only their text: only the leader's reach the cell.
    """
    global _rich
    _rich = leader
    namespace.setdefault("display", display)
    if os.environ.get("MPLBACKEND", "").lower() in {"", *_NOTEBOOK_BACKENDS}:
        os.environ["MPLBACKEND"] = FIGURE_BACKEND
    for name in _IPYTHON_DISPLAY_MODULES:
        if name in sys.modules:
            _route_ipython(sys.modules[name])
    if not any(isinstance(finder, _RouteWhenImported) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RouteWhenImported())


def show_open_figures(value: Any = None) -> None:
    """Show every figure still open when the cell ends, as the inline backend does (not the cell's value)."""
    figures = sys.modules.get("kinetic_nb.runner.figures")
    if figures is not None:
        figures.show(skip=value)
