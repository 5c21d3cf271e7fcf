"""The tests' HTTP and TCP doubles serve from a thread, and are stopped at every test's end."""

from __future__ import annotations

import socketserver
import threading

#: How often a double's serving loop looks for its stop: ``shutdown()`` waits for the next look, and at the
#: standard library's 0.5 s every double's stop took half a second (69 tests of the suite were that wait alone).
STOP_POLL_S = 0.02


def serve_in_background(server: socketserver.BaseServer, name: str) -> threading.Thread:
    """Serve ``server`` from a daemon thread (started); ``server.shutdown()`` then returns within ``STOP_POLL_S``."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": STOP_POLL_S}, name=name,
                              daemon=True)
    thread.start()
    return thread
