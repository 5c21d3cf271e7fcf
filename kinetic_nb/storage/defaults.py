"""Where jobs live when the user names no storage."""

from __future__ import annotations

import os
from pathlib import Path

#: Overrides the default storage root for every job of this user.
STORAGE_ENV = "KINETIC_STORAGE"


def default_root() -> str:
    """The per-user job directory (created with mode 0700), or ``$KINETIC_STORAGE``.

    Jobs hold pickled notebook values, so other users must not read them.
    """
    configured = os.environ.get(STORAGE_ENV)
    if configured:
        return configured
    return f"file://{user_directory('jobs')}"


def user_directory_path(name: str) -> Path:
    """``~/.cache/kinetic_nb/{name}`` (or under ``$XDG_CACHE_HOME``), not created: where :func:`user_directory` is."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kinetic_nb" / name


def user_directory(name: str) -> Path:
    """``~/.cache/kinetic_nb/{name}`` (or under ``$XDG_CACHE_HOME``), created with mode 0700: this user's only."""
    directory = user_directory_path(name)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)
    return directory
