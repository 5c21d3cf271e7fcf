"""Job storage behind one small interface: ``file://`` (and ``gs://`` later).

Host-safe: the standard library (and the Cloud Storage client, lazily).
"""

from kinetic_nb.storage.base import ObjectInfo, Storage, open_storage
from kinetic_nb.storage.local import LocalStorage
from kinetic_nb.storage.defaults import default_root

__all__ = ["LocalStorage", "ObjectInfo", "Storage", "default_root", "open_storage"]
