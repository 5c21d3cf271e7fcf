"""``file://`` storage: a directory, atomic writes by rename, and no write another user can redirect.

Host-safe: the standard library only.

A storage opens its directory once (its *anchor*), checks its owner and mode
once, and holds the descriptor: every later open, create, rename, link and
unlink is made relative to it, one path component at a time with
``O_NOFOLLOW``. Holding the descriptor (rather than re-checking the
directory's ``st_dev``/``st_ino`` before each use) closes the window between a
check and a use, and costs no stat per operation: a directory renamed away, or
a link planted where a directory was, cannot redirect a write or a read.
Children (a job below the root, a cell below a session) share their parent's
anchor. Links in the path the user names as the root are followed (that path
is the user's own setting); nothing below it is.

Shared roots: a root this user does not own, or one others may write, holds
this user's objects in ``{root}/uid-{uid}/``, a 0700 directory this user owns;
one owned by anyone else is refused in one line. The fixed names below it
(``sessions/``) are then this user's alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
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
#: This user's directory in a shared root: named by uid, since a uid needs no name on this machine.
USER_DIRECTORY_PREFIX = "uid-"
#: Mode bits that let other users create, rename or remove entries in a directory.
_OTHERS_MAY_WRITE = stat.S_IWGRP | stat.S_IWOTH
#: Every directory below the anchor: a link or a file in its place is refused, never followed.
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Every object read: a link is refused, and a FIFO put in an object's place cannot block the open.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: Errors of ``copy_file_range`` that mean "not between these two files": copy through user space instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}


def _open_directory(parent: int, name: str, create: bool) -> int | None:
    """A descriptor of directory ``name`` in ``parent`` (made 0700 if missing and ``create``), else None."""
    try:
        return os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)
    except (FileNotFoundError, NotADirectoryError):
        if not create:  # nothing below it exists (a file where a directory would be holds no object either)
            return None
    try:
        os.mkdir(name, DIRECTORY_MODE, dir_fd=parent)
        created = True
    except FileExistsError:
        created = False
    fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)
    if created:
        os.fchmod(fd, DIRECTORY_MODE)  # whatever the umask
    return fd


def _make_directories(path: Path) -> None:
    """Create the named root ``path`` and its missing parents with :data:`DIRECTORY_MODE` (whatever the umask)."""
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
        fd = os.open(directory, _DIRECTORY_FLAGS)
        try:
            os.fchmod(fd, DIRECTORY_MODE)
        finally:
            os.close(fd)


def _nobody_else_can_rename(fd: int, path: str) -> bool:
    """Whether only this user and root can rename a directory on the way to the open directory ``fd``.

    True when every directory above it is owned by root or this user, and
    others may not write it or it is sticky: then its plain path leads to it
    for as long as it lives, and may be handed to code that opens paths.
    """
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        real = os.path.realpath(path)
    me = os.geteuid()
    directory = Path(real)
    for above in directory.parents:
        try:
            info = os.lstat(above)
        except OSError:
            return False
        if info.st_uid not in (0, me) or (info.st_mode & _OTHERS_MAY_WRITE and not info.st_mode & stat.S_ISVTX):
            return False
    return True


class _Anchor:
    """The directory a storage and its children work below: opened, checked and held once."""

    def __init__(self, path: str):
        self.named = path
        #: The anchor's own path: the named root, or this user's directory in it.
        self.path = path
        self.fd: int | None = None
        #: Whether :attr:`path` can be given to code that opens paths (see :func:`_nobody_else_can_rename`).
        self.stable = True
        self._lock = threading.Lock()

    def open(self, create: bool) -> int | None:
        """The held descriptor; None while the directory does not exist and ``create`` is false."""
        if self.fd is None:
            with self._lock:
                if self.fd is None:
                    self._open(create)
        return self.fd

    def _open(self, create: bool) -> None:
        try:
            fd = os.open(self.named, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                return
            _make_directories(Path(self.named))
            fd = os.open(self.named, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if info.st_uid != os.geteuid() or info.st_mode & _OTHERS_MAY_WRITE:
                shared, fd = fd, None  # closed below, whatever happens: never closed twice
                name = f"{USER_DIRECTORY_PREFIX}{os.geteuid()}"
                self.path = os.path.join(self.named, name)
                try:
                    fd = _open_user_directory(shared, name, self.path, create)
                finally:
                    os.close(shared)
                if fd is None:
                    return
                _check_private(fd, self.path)
            self.stable = _nobody_else_can_rename(fd, self.path)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        self.fd = fd

    def __del__(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)


def _open_user_directory(shared: int, name: str, path: str, create: bool) -> int | None:
    """This user's directory ``name`` in the shared root ``shared`` (see :func:`_open_directory`); a link, or
    anything else that is not a directory, in its place is refused in one line naming it and its owner."""
    try:
        return _open_directory(shared, name, create)
    except OSError as error:
        if error.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        info = os.stat(name, dir_fd=shared, follow_symlinks=False)
    if stat.S_ISLNK(info.st_mode):
        what = f"a symbolic link (to {os.readlink(name, dir_fd=shared)!r})"
    else:
        what = "not a directory"
    raise StorageError(f"{path} is {what}, owned by uid {info.st_uid}, in place of this user's directory: it is "
                       f"refused, never followed; have it removed, or use another --storage (or $KINETIC_STORAGE)")


def _check_private(fd: int, path: str) -> None:
    """Refuse this user's directory in a shared root unless this user owns it and only they may write it."""
    info = os.fstat(fd)
    me = os.geteuid()
    if info.st_uid != me:
        raise StorageError(f"{path} is owned by uid {info.st_uid}, not by this user (uid {me}): its owner could "
                           f"redirect every write there; have it removed, or use another --storage "
                           f"(or $KINETIC_STORAGE)")
    if info.st_mode & _OTHERS_MAY_WRITE:
        raise StorageError(f"{path} may be written by other users (mode {stat.S_IMODE(info.st_mode):o}): "
                           f"run chmod 700 {path}, or use another --storage (or $KINETIC_STORAGE)")


def _path_from_uri(uri: str) -> Path:
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return Path(path).expanduser().absolute()


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _copy_from_path(source: str | os.PathLike, fd: int) -> None:
    """Copy the file at ``source`` into ``fd``: in the kernel where it can (copy_file_range), else in chunks."""
    with open(source, "rb") as file:
        try:
            while os.copy_file_range(file.fileno(), fd, _COPY_CHUNK_BYTES):
                pass
            return
        except OSError as error:
            if error.errno not in _NO_KERNEL_COPY:
                raise
        with open(fd, "wb", closefd=False) as target:  # both offsets moved together: carry on from them
            shutil.copyfileobj(file, target, _COPY_CHUNK_BYTES)


class LocalStorage(Storage):
    """Objects as files below a directory, reached only through its held descriptor."""

    def __init__(self, uri: str):
        self._anchor = _Anchor(str(_path_from_uri(uri)))
        self._prefix: tuple[str, ...] = ()

    @property
    def uri(self) -> str:
        with contextlib.suppress(OSError, StorageError):
            self._anchor.open(create=False)
        return "file://" + "/".join((self._anchor.path, *self._prefix))

    @property
    def named_root(self) -> str:
        """The directory named as this storage's root, before this user's ``uid-UID/`` step in a shared one."""
        return self._anchor.named

    @property
    def root(self) -> Path:
        """This storage's directory (the plain path: see :meth:`local_path` for one safe to open)."""
        return Path(self.uri[len("file://"):])

    def child(self, name: str) -> LocalStorage:
        below = object.__new__(LocalStorage)
        below._anchor = self._anchor  # one held directory for a root and every job below it
        below._prefix = self._parts(name)
        return below

    def _parts(self, name: str) -> tuple[str, ...]:
        parts = name.split("/")
        if name.startswith("/") or ".." in parts:
            raise StorageError(f"invalid object name {name!r} in {self.uri}")
        return (*self._prefix, *(part for part in parts if part not in ("", ".")))

    def _leaf(self, name: str) -> tuple[tuple[str, ...], str]:
        parts = self._parts(name)
        if len(parts) == len(self._prefix):
            raise StorageError(f"invalid object name {name!r} in {self.uri}")
        return parts[:-1], parts[-1]

    @contextlib.contextmanager
    def _directory(self, parts: tuple[str, ...], create: bool) -> Iterator[int | None]:
        """A descriptor of the directory ``parts`` below the anchor, walked without following a link."""
        anchor = self._anchor.open(create)
        current = anchor
        try:
            for part in parts:
                if current is None:
                    break
                following = _open_directory(current, part, create)
                if current != anchor:
                    os.close(current)
                current = following
            yield current
        finally:
            if current is not None and current != anchor:
                os.close(current)

    @contextlib.contextmanager
    def _errors(self, op: str, name: str) -> Iterator[None]:
        """An operating-system error (a file where a directory should be, no permission, a full disk) as one line."""
        try:
            yield
        except StorageError:
            raise
        except OSError as error:
            where = f" ({error.filename})" if error.filename else ""
            target = f"{self.uri}/{name}" if name else self.uri
            hint = "use a --storage (or $KINETIC_STORAGE) directory this user can write"
            raise StorageError(f"cannot {op} {target}: {error.strerror or error}{where}; {hint}").asked(
                op, name, self.uri, f"{error.strerror or error}{where}; {hint}") from error

    def local_path(self, name: str = "") -> str:
        """A path to ``name`` that no other user can redirect while this storage lives.

        The plain path where only this user and root may rename the directories
        above; else one through this process's held descriptor
        (``/proc/{pid}/fd/{fd}/...``), which the kernel resolves to the directory
        this storage checked, wherever it has been moved.
        """
        parts = self._parts(name)
        with contextlib.suppress(OSError, StorageError):
            fd = self._anchor.open(create=False)
            if fd is not None and not self._anchor.stable:
                return "/".join((f"/proc/{os.getpid()}/fd/{fd}", *parts))
        return "/".join((self._anchor.path, *parts))

    def make_directory(self, name: str) -> None:
        """Create the directory ``name`` (and its parents), 0700, below this storage: for files a host writes."""
        with self._errors("create", name), self._directory(self._parts(name), create=True):
            pass

    def write_bytes(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        if not data:
            self._write_empty(name, exclusive)
            return
        self._write_via_temp(name, lambda fd: _write_all(fd, data), exclusive)

    def write_file(self, name: str, source: str | os.PathLike | IO[bytes], *, exclusive: bool = False) -> None:
        def fill(fd: int) -> None:
            if isinstance(source, (str, os.PathLike)):
                _copy_from_path(source, fd)
            else:
                with open(fd, "wb", closefd=False) as file:
                    shutil.copyfileobj(source, file, _COPY_CHUNK_BYTES)

        self._write_via_temp(name, fill, exclusive)

    def _write_empty(self, name: str, exclusive: bool) -> None:
        """An empty object (a marker, a heartbeat) is never seen half-written, so it is made where it lies:
        a rename less, which on some disks is most of a small write's cost. Rewriting one moves its mtime."""
        parts, leaf = self._leaf(name)
        flags = _WRITE_FLAGS | (os.O_EXCL if exclusive else os.O_TRUNC)
        with self._errors("write", name), self._directory(parts, create=True) as directory:
            try:
                os.close(os.open(leaf, flags, FILE_MODE, dir_fd=directory))
            except FileExistsError:
                raise ObjectExistsError(f"{self.uri}/{name} already exists") from None

    def _write_via_temp(self, name: str, fill: Callable[[int], None], exclusive: bool) -> None:
        """Fill a temporary file beside ``name``, then publish it whole by rename (or link, if exclusive)."""
        parts, leaf = self._leaf(name)
        with self._errors("write", name), self._directory(parts, create=True) as directory:
            temp = f"{_TEMP_PREFIX}{leaf}-{os.urandom(8).hex()}"
            fd = os.open(temp, _WRITE_FLAGS | os.O_EXCL, FILE_MODE, dir_fd=directory)
            published = False
            try:
                try:
                    fill(fd)
                finally:
                    os.close(fd)
                if exclusive:
                    try:  # fails if the name exists: atomic create-if-absent
                        os.link(temp, leaf, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
                    except FileExistsError:
                        raise ObjectExistsError(f"{self.uri}/{name} already exists") from None
                else:
                    os.replace(temp, leaf, src_dir_fd=directory, dst_dir_fd=directory)
                    published = True
            finally:
                if not published:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(temp, dir_fd=directory)

    def _open_object(self, name: str) -> tuple[int, int]:
        """A descriptor of the regular file ``name`` (and its size), opened for reading without following a link."""
        parts, leaf = self._leaf(name)
        with self._directory(parts, create=False) as directory:
            if directory is None:
                raise ObjectNotFoundError(f"{self.uri}/{name} does not exist")
            try:
                fd = os.open(leaf, _READ_FLAGS, dir_fd=directory)
            except (FileNotFoundError, NotADirectoryError):
                raise ObjectNotFoundError(f"{self.uri}/{name} does not exist") from None
        info = os.fstat(fd)
        mode = info.st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            if stat.S_ISDIR(mode):
                raise ObjectNotFoundError(f"{self.uri}/{name} does not exist")
            raise StorageError(f"{self.uri}/{name} is not a regular file: refused")
        return fd, info.st_size

    def read_bytes(self, name: str) -> bytes:
        with self._errors("read", name):
            fd, size = self._open_object(name)
            try:
                chunks = [os.read(fd, size + 1)]
                while chunks[-1]:  # grown since: read on to the end
                    chunks.append(os.read(fd, _COPY_CHUNK_BYTES))
            finally:
                os.close(fd)
        return b"".join(chunks)

    def open_read(self, name: str) -> IO[bytes]:
        # The open file keeps the version it opened: a rewrite renames a new file over the name.
        with self._errors("read", name):
            return open(self._open_object(name)[0], "rb")  # the caller closes it

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # Walk only the deepest directory the prefix names, not the whole root.
        directory, _, _ = prefix.rpartition("/")
        found: list[ObjectInfo] = []
        with self._errors("list", ""), self._directory(self._parts(directory), create=False) as start:
            if start is None:
                return found
            stack = [(os.dup(start), f"{directory}/" if directory else "")]
            while stack:
                fd, above = stack.pop()
                try:
                    self._list_one(fd, above, prefix, stack, found)
                finally:
                    os.close(fd)
        found.sort(key=lambda info: info.name)
        return found

    @staticmethod
    def _list_one(fd: int, above: str, prefix: str, stack: list[tuple[int, str]], found: list[ObjectInfo]) -> None:
        for entry in list(os.scandir(fd)):
            if entry.name.startswith(_TEMP_PREFIX):
                continue
            name = above + entry.name
            if entry.is_dir(follow_symlinks=False):
                if name.startswith(prefix) or prefix.startswith(name + "/"):
                    below = _open_directory(fd, entry.name, create=False)
                    if below is not None:
                        stack.append((below, name + "/"))
                continue
            if not name.startswith(prefix) or not entry.is_file(follow_symlinks=False):
                continue  # a link or a FIFO is no object
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            found.append(ObjectInfo(name, info.st_size, f"{info.st_mtime_ns}:{info.st_size}", info.st_mtime))

    def exists(self, name: str) -> bool:
        parts, leaf = self._leaf(name)
        try:
            with self._directory(parts, create=False) as directory:
                return directory is not None and stat.S_ISREG(
                    os.stat(leaf, dir_fd=directory, follow_symlinks=False).st_mode)
        except (OSError, StorageError):
            return False

    def delete(self, name: str) -> None:
        parts, leaf = self._leaf(name)
        with self._errors("delete", name), self._directory(parts, create=False) as directory:
            try:
                if directory is None:
                    raise FileNotFoundError
                os.unlink(leaf, dir_fd=directory)
            except (FileNotFoundError, NotADirectoryError):
                raise ObjectNotFoundError(f"{self.uri}/{name} does not exist") from None

    def delete_many(self, names: Iterable[str]) -> None:
        """Remove each of ``names`` that exists, each folder walked to once (a cell's outcome is ten names in one)."""
        by_folder: dict[tuple[str, ...], list[tuple[str, str]]] = {}
        for name in names:
            parts, leaf = self._leaf(name)
            by_folder.setdefault(parts, []).append((name, leaf))
        for parts, leaves in by_folder.items():
            with self._errors("delete", leaves[0][0]), self._directory(parts, create=False) as directory:
                if directory is None:
                    continue
                for name, leaf in leaves:
                    with self._errors("delete", name), contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        os.unlink(leaf, dir_fd=directory)

    def remove_tree(self) -> None:
        """Delete the whole directory below this root (without following a link)."""
        if not self._prefix:
            shutil.rmtree(self.local_path(), ignore_errors=True)
            return
        with contextlib.suppress(OSError, StorageError), self._directory(self._prefix[:-1], create=False) as parent:
            if parent is not None:
                shutil.rmtree(self._prefix[-1], dir_fd=parent, ignore_errors=True)
