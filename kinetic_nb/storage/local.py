"""``file://`` storage: a directory, atomic writes by rename.

Host-safe: the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from kinetic_nb.errors import ObjectExistsError, ObjectNotFoundError, StorageError
from kinetic_nb.storage.base import ObjectInfo, Storage

#: Temporary files carry this prefix so a listing never shows a half-written object.
_TEMP_PREFIX = ".tmp-"
#: Copy buffer for file objects: large enough that a big value moves in few system calls.
_COPY_CHUNK_BYTES = 8 * 1024 * 1024
#: Jobs hold pickled notebook values and the hosts' output: this user's only, under any root.
DIRECTORY_MODE = 0o700
FILE_MODE = 0o600


def _make_directories(path: Path) -> None:
    """Create ``path`` and its missing parents with :data:`DIRECTORY_MODE` (whatever the umask)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIRECTORY_MODE)
        except FileExistsError:
            continue
        os.chmod(directory, DIRECTORY_MODE)


def _create_private(path: Path) -> IO[bytes]:
    return open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "wb")


@contextlib.contextmanager
def _os_errors_as_storage_errors(op: str, target: str) -> Iterator[None]:
    """An operating-system error (a file where a directory should be, no permission, a full disk) as one line."""
    try:
        yield
    except StorageError:
        raise
    except OSError as error:
        where = f" ({error.filename})" if error.filename else ""
        raise StorageError(f"cannot {op} {target}: {error.strerror or error}{where}; use a --storage "
                           f"(or $KINETIC_STORAGE) directory this user can write") from error


def _path_from_uri(uri: str) -> Path:
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return Path(path).expanduser().absolute()


class LocalStorage(Storage):
    """Objects as files below a directory."""

    def __init__(self, uri: str):
        self.root = _path_from_uri(uri)
        self.uri = f"file://{self.root}"

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(str(self._path(name)))

    def _path(self, name: str) -> Path:
        if name.startswith("/") or ".." in name.split("/"):
            raise StorageError(f"invalid object name {name!r} in {self.uri}")
        return self.root / name if name else self.root

    def local_path(self, name: str = "") -> str:
        return str(self._path(name))

    def write_bytes(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        if not data:
            self._write_empty(name, exclusive)
            return

        def fill(temp: Path) -> None:
            with _create_private(temp) as file:
                file.write(data)

        self._write_via_temp(name, fill, exclusive)

    def write_file(self, name: str, source: str | os.PathLike | IO[bytes], *, exclusive: bool = False) -> None:
        def fill(temp: Path) -> None:
            if isinstance(source, (str, os.PathLike)):
                _create_private(temp).close()
                shutil.copyfile(source, temp)  # the kernel copies where it can (copy_file_range, sendfile)
            else:
                with _create_private(temp) as file:
                    shutil.copyfileobj(source, file, _COPY_CHUNK_BYTES)

        self._write_via_temp(name, fill, exclusive)

    def _write_empty(self, name: str, exclusive: bool) -> None:
        """An empty object (a marker, a heartbeat) is never seen half-written, so it is made where it lies:
        a rename less, which on some disks is most of a small write's cost. Rewriting one moves its mtime."""
        path = self._path(name)
        with _os_errors_as_storage_errors("write", f"{self.uri}/{name}"):
            _make_directories(path.parent)
            flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
            try:
                os.close(os.open(path, flags, FILE_MODE))
            except FileExistsError:
                raise ObjectExistsError(f"{self.uri}/{name} already exists") from None

    def _write_via_temp(self, name: str, fill: Callable[[Path], None], exclusive: bool) -> None:
        """Fill a temporary file beside ``name``, then publish it whole by rename (or link, if exclusive)."""
        path = self._path(name)
        with _os_errors_as_storage_errors("write", f"{self.uri}/{name}"):
            _make_directories(path.parent)
            temp = path.with_name(f"{_TEMP_PREFIX}{path.name}-{os.urandom(8).hex()}")
            try:
                fill(temp)
                if exclusive:
                    try:
                        os.link(temp, path)  # fails if path exists: atomic create-if-absent
                    except FileExistsError:
                        raise ObjectExistsError(f"{self.uri}/{name} already exists") from None
                else:
                    os.replace(temp, path)
            finally:
                temp.unlink(missing_ok=True)

    def read_bytes(self, name: str) -> bytes:
        with _os_errors_as_storage_errors("read", f"{self.uri}/{name}"):
            try:
                return self._path(name).read_bytes()
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                raise ObjectNotFoundError(f"{self.uri}/{name} does not exist") from None

    def open_read(self, name: str) -> IO[bytes]:
        # The open file keeps the version it opened: a rewrite renames a new file over the name.
        try:
            return open(self._path(name), "rb")  # the caller closes it
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(f"{self.uri}/{name} does not exist") from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # Walk only the deepest directory the prefix names, not the whole root.
        directory, _, _ = prefix.rpartition("/")
        start = self._path(directory)
        found: list[ObjectInfo] = []
        stack = [start]
        while stack:
            with _os_errors_as_storage_errors("list", self.uri):
                try:
                    entries = list(os.scandir(stack.pop()))
                except (FileNotFoundError, NotADirectoryError):
                    continue
            for entry in entries:
                if entry.name.startswith(_TEMP_PREFIX):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                    continue
                name = Path(entry.path).relative_to(self.root).as_posix()
                if not name.startswith(prefix):
                    continue
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append(ObjectInfo(name, stat.st_size, f"{stat.st_mtime_ns}:{stat.st_size}", stat.st_mtime))
        found.sort(key=lambda info: info.name)
        return found

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.uri}/{name} does not exist") from None

    def remove_tree(self) -> None:
        """Delete the whole directory below this root."""
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)
