"""The matplotlib backend of a host (``MPLBACKEND=module://kinetic_nb.runner.figures``).

Figures are drawn by Agg, as on any headless machine; showing one
(``plt.show()``, or the end of the cell for a figure still open, as the
notebook's inline backend does) writes it as a PNG display record and
closes it. Imported by matplotlib itself, never by the runner.
"""

from __future__ import annotations

import io
from typing import Any

from matplotlib._pylab_helpers import Gcf
from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from kinetic_nb.runner.host_display import publish_display_data

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def figure_bundle(figure: Any) -> dict[str, Any]:
    """The figure as the inline backend shows it: a PNG cut to what is drawn, and its text."""
    png = io.BytesIO()
    figure.savefig(png, format="png", bbox_inches="tight")
    return {"image/png": png.getvalue(), "text/plain": repr(figure)}


def show(*, block: Any = None, skip: Any = None) -> None:
    """Show every open figure as a display record, then close them all (``skip``: close without showing)."""
    for manager in Gcf.get_all_fig_managers():
        figure = manager.canvas.figure
        if figure is not skip and figure.axes:
            publish_display_data(figure_bundle(figure))
    Gcf.destroy_all()
