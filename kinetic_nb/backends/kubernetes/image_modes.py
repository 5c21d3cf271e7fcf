"""How a job's pods get their Python environment: the kubernetes backend's image modes.

- ``custom``: the image you name has kinetic_nb and everything your cells
  import (the mode whenever ``--image`` is given without another mode).
- ``prebuilt``: a stock Python image of the notebook's minor version
  (:func:`stock_image`) or the ``--image`` you name; each pod first runs the
  bootstrap (:mod:`kinetic_nb.agent.bootstrap`), which installs the notebook's
  own kinetic_nb (a wheel of the installed package, development installs
  included: :func:`~kinetic_nb.backends.host_environment.package_wheel`) and your ``--requirements`` file, both
  stored with the job and signed under its key, verified before pip runs.
- ``build``: an image with your requirements installed, built once by Cloud
  Build and reused while the requirements are the same
  (:mod:`kinetic_nb.backends.kubernetes.cloud_build`); each pod then installs only
  the notebook's kinetic_nb, as in ``prebuilt``.

No ``kubernetes`` import; the standard library only. What the hosts install, and how it is stored, is
:mod:`kinetic_nb.backends.host_environment`'s (ssh hosts install the same).
"""

from __future__ import annotations

import enum
import sys

__all__ = ["ImageMode", "stock_image"]


class ImageMode(str, enum.Enum):
    """Where a pod's kinetic_nb and packages come from (see the module's docstring)."""

    PREBUILT = "prebuilt"
    BUILD = "build"
    CUSTOM = "custom"

    def __str__(self) -> str:
        return self.value


#: The stock image of the prebuilt mode: the official Python image of the notebook's
#: minor version (a host refuses a plan from another Python: cloudpickle's functions
#: do not travel between minor versions), slim: pip, venv and nothing else.
STOCK_IMAGE = "python:{major}.{minor}-slim"


def stock_image(version: tuple[int, ...] = tuple(sys.version_info)) -> str:
    """``python:3.11-slim`` for Python 3.11: the notebook's minor version."""
    return STOCK_IMAGE.format(major=version[0], minor=version[1])
