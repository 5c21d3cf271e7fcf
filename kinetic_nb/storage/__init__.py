"""Job storage behind one small interface: ``file://`` and ``gs://``.

Host-safe: the standard library (and the Cloud Storage client, imported lazily
when a ``gs://`` storage is opened).
"""

from kinetic_nb.storage.base import ObjectInfo, Storage, patiently
from kinetic_nb.storage.defaults import default_root
from kinetic_nb.storage.gcs import GcsStorage
from kinetic_nb.storage.local import LocalStorage


def open_storage(uri: str) -> Storage:
    """The storage for ``uri``: ``file://`` or a plain path, or ``gs://bucket/prefix``.

    ``gs://`` needs the ``gcs`` extra (google-cloud-storage), imported only now.
    """
    if uri.startswith("file://") or "://" not in uri:
        return LocalStorage(uri)
    if uri.startswith("gs://"):
        return GcsStorage(uri)
    scheme = uri.split("://", 1)[0]
    raise ValueError(f"unsupported storage URI {uri!r}: scheme {scheme}:// is not supported (use file:// or gs://)")


__all__ = ["GcsStorage", "LocalStorage", "ObjectInfo", "Storage", "default_root", "open_storage", "patiently"]
