"""Job storage behind one small interface: ``file://`` and ``gs://``.

Host-safe: the standard library (and the Cloud Storage client, imported lazily
when a ``gs://`` storage is opened).
"""

from kinetic_nb.storage.base import ObjectInfo, Storage, open_storage
from kinetic_nb.storage.defaults import default_root
from kinetic_nb.storage.gcs import GcsStorage
from kinetic_nb.storage.local import LocalStorage

__all__ = ["GcsStorage", "LocalStorage", "ObjectInfo", "Storage", "default_root", "open_storage"]
