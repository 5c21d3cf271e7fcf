"""The notebook's folder on hosts that do not share its disk: its modules and small files, as the notebook
packed them (``shipping.workdir``), unpacked into a directory of the host's own that becomes its working
directory and comes first on ``sys.path``, so ``import mylib`` and ``open("config.yaml")`` work there as they
do in the notebook.

The archive is sealed under the job's key like every record: one that does not verify is refused, and no
member may name a path outside the directory it is unpacked into. Host-safe: the standard library only.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import zipfile

from kinetic_nb.errors import PlanError
from kinetic_nb.runner import envelope
from kinetic_nb.storage import Storage

__all__ = ["enter_workdir"]


def enter_workdir(storage: Storage, key: bytes, name: str, job_id: str) -> str:
    """Unpack the sealed archive ``name`` into a new directory, make it the working directory and put it first
    on ``sys.path``; the directory.

    Raises
    ------
    IntegrityError
        The archive was not stored by this job's notebook.
    PlanError
        A member names a path outside the directory (never written by kinetic_nb's own packing).
    """
    data = envelope.read_sealed(storage, name, key)
    directory = tempfile.mkdtemp(prefix=f"kinetic-{job_id}-workdir-")
    root = os.path.realpath(directory)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for member in archive.infolist():
            target = os.path.realpath(os.path.join(root, member.filename))
            if os.path.isabs(member.filename) or not target.startswith(root + os.sep):
                raise PlanError(f"the notebook's folder names {member.filename!r}, outside the folder: refused")
        archive.extractall(root)
    os.chdir(root)
    sys.path.insert(0, root)
    return root
