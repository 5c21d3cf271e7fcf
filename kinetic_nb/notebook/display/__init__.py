"""The display: the live panel, its text twin, the static summaries and the phase timeline.

Fed by values only: a ``JobSnapshot`` or a ``SnapshotSource`` (anything with a
``plan`` and a ``snapshot()``, see ``kinetic_nb.state``), never a backend, the
poller or a ``CellHandle``'s other methods. Importing this package registers its
views in ``kinetic_nb.views``, which is how a ``CellHandle`` is shown
(``summary``, ``_repr_html_``, ``watch``, ``timeline``) without the client
importing the display.
"""

from __future__ import annotations

import logging

from kinetic_nb import views
from kinetic_nb.notebook.display.panel import (
    HostPanel,
    TextStatus,
    WidgetView,
    failure_lines,
    html_summary,
    live_view,
    text_summary,
    watch_in_background,
)
from kinetic_nb.notebook.display.timeline import plot_timeline

logger = logging.getLogger(__name__)

__all__ = [
    "HostPanel",
    "TextStatus",
    "WidgetView",
    "failure_lines",
    "html_summary",
    "live_view",
    "plot_timeline",
    "text_summary",
    "watch_in_background",
]


views.register("text", text_summary)
views.register("html", html_summary)
views.register("watch", watch_in_background)
views.register("timeline", plot_timeline)
