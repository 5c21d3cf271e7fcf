"""The notebook's folder, packed for hosts that do not share its disk (a pod, a Ray node): its modules and
small files, so that ``import mylib`` from the notebook's folder works on them as it does here.

What is left out:

- kinetic_nb's own keys and jobs (``~/.cache/kinetic_nb``, ``$XDG_CACHE_HOME/kinetic_nb``, a local storage
  root), wherever they lie: always, whatever any file says;
- what holds credentials (:data:`CREDENTIALS`: ``.ssh/``, ``.aws/``, ``.env*``, ``*.pem``, ``*.key``, ...),
  named in the notice; a file ships anyway when ``.kineticinclude`` in the folder names it, or names the
  credential-like folder it lies in (a pattern naming a folder above that, such as ``proj/``, does not);
- what ``.kineticignore`` names, the usual caches and environments (:data:`ALWAYS_IGNORED`), symbolic links and
  anything else that is not a regular file, and any file larger than :data:`MAX_FILE_BYTES` (named in the
  notice).

Patterns (both files): one a line, ``#`` comments; a pattern with a ``/`` matches a path from the folder, one
without matches a name at any depth, one ending in ``/`` only directories. Each file is read only when it is a
regular file (never through a link) of at most :data:`MAX_PATTERN_FILE_BYTES`; otherwise it is ignored and the
notice says so.

A home directory (or a folder above one, such as ``/``, or a credentials folder such as ``~/.aws``) ships only
what ``.kineticinclude`` names, nothing by default: a home directory is where credentials live, a list of what
to leave out always misses some, and refusing would stop the many notebooks that need no files at all. The cell
still runs; the notice says how to ship files.

Files are read as they were walked: opened relative to their directory without following a link, without
blocking (a FIFO cannot hang the notebook), shipped only when the open file is a regular one, and read up to
the cap (a file that grew is left out for its size). A folder with more than :data:`MAX_TOTAL_BYTES` or
:data:`MAX_FILES` to ship is refused in one line naming its largest files. The archive is the same bytes for the
same files (sorted names, fixed times), so an unchanged folder costs the same object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fnmatch
import io
import os
import pwd
import re
import stat
import zipfile
from collections.abc import Iterable
from pathlib import Path

from kinetic_nb.runner.workdir import MAX_FILE_BYTES, MAX_FILES, MAX_TOTAL_BYTES
from kinetic_nb.storage.defaults import STORAGE_ENV, user_directory_path

__all__ = ["ALWAYS_IGNORED", "CREDENTIALS", "IGNORE_FILE", "INCLUDE_FILE", "MAX_FILES", "MAX_FILE_BYTES",
           "MAX_PATTERN_FILE_BYTES", "MAX_TOTAL_BYTES", "PackedFolder", "Unread", "pack_folder", "read_regular_file"]

IGNORE_FILE = ".kineticignore"
INCLUDE_FILE = ".kineticinclude"
#: Never shipped: version control, caches, virtual environments, notebook checkpoints.
ALWAYS_IGNORED = (".git/", ".hg/", ".svn/", "__pycache__/", ".ipynb_checkpoints/", ".venv/", "venv/",
                  "node_modules/", ".mypy_cache/", ".pytest_cache/", ".ruff_cache/", "*.egg-info/", "*.pyc",
                  ".DS_Store")
#: What holds credentials: the usual tools' folders and files, matched at any depth. Left out unless
#: ``.kineticinclude`` names them; a denylist misses some, which is why a home directory ships nothing unnamed.
CREDENTIALS = (
    # folders of tools that keep keys and tokens
    ".ssh/", ".gnupg/", ".aws/", ".azure/", ".config/gcloud/", ".kube/", ".docker/", ".config/gh/",
    ".config/hub", ".password-store/", ".local/share/keyrings/", ".terraform.d/", ".kaggle/", ".gsutil/",
    ".minikube/", ".vault-token", "huggingface/token", ".config/rclone/",
    # files of tools that keep passwords and tokens
    ".netrc", "_netrc", ".git-credentials", ".pypirc", ".npmrc", ".yarnrc", ".yarnrc.yml", ".pgpass", ".my.cnf",
    ".boto", ".s3cfg", ".dockercfg", ".databrickscfg", ".htpasswd", ".env", ".env.*", "*.env", ".envrc",
    # keys, certificates and keystores
    "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", "*.ppk", "*.kdbx", "*.gpg", "*.asc",
    "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*",
    # service-account and OAuth files
    "credentials", "credentials.json", "application_default_credentials.json", "client_secret*.json",
    "*service-account*.json", "*service_account*.json", "*.tfstate", "*.tfstate.backup",
)
#: ``.kineticignore`` and ``.kineticinclude`` are read only up to this size: patterns, not data.
MAX_PATTERN_FILE_BYTES = 64 << 10
#: How many names the notice shows before it counts the rest.
_NAMES_SHOWN = 3
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)
#: How a walked file is opened: never through a link, never waiting on a FIFO, never as a controlling terminal.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


class Unread(Exception):
    """A walked name that was not read: why, and its size when it was too large."""

    def __init__(self, why: str, size: int | None = None):
        super().__init__(why)
        self.why = why
        self.size = size


@dataclasses.dataclass(frozen=True)
class PackedFolder:
    """The archive, how many files and bytes it holds, and what was left out and why."""

    data: bytes
    files: int
    size: int
    too_large: tuple[str, ...] = ()
    #: Left out as credentials, or as kinetic_nb's own keys and jobs (a folder's name ends with ``/``).
    credentials: tuple[str, ...] = ()
    #: The folder is a home directory, above one, or a credentials folder: only what ``.kineticinclude`` names
    #: was shipped.
    home: bool = False
    #: ``.kineticignore`` or ``.kineticinclude`` not read, and why.
    unread: tuple[str, ...] = ()

    def notice(self, folder: str) -> str:
        include = os.path.join(folder, INCLUDE_FILE)
        if self.home:
            text = (f"this notebook's folder {folder} is where credentials live (a home directory, a folder above one, "
                    f"or a credentials folder): the hosts get only what {include} names, one pattern a line "
                    + (f"({self.files} files, {_size(self.size)})" if self.files else "(nothing now)"))
        else:
            text = f"the hosts run in a copy of this notebook's folder {folder} ({self.files} files, {_size(self.size)})"
        if self.too_large:
            text += f"; left out for being over {_size(MAX_FILE_BYTES)}: {_some(self.too_large)}"
        if self.credentials:
            text += (f"; left out as credentials: {_some(self.credentials)} (to ship one on purpose, name it in "
                     f"{include})")
        for why in self.unread:
            text += f"; {why}"
        return text


def pack_folder(folder: str | os.PathLike[str], *, leave_out: Iterable[str | os.PathLike[str]] = ()) -> PackedFolder:
    """``folder``'s files as the hosts get them.

    Parameters
    ----------
    folder : str or path
        The notebook's folder.
    leave_out : iterable of paths
        More of kinetic_nb's own directories never to ship, wherever they lie (a local storage root).

    Raises
    ------
    ValueError
        One line: what would be shipped is over :data:`MAX_TOTAL_BYTES` or :data:`MAX_FILES`, with its
        largest files.
    """
    root = os.path.realpath(folder)
    own = _identities([*_kinetic_directories(), *leave_out])
    if any(identity in own for identity in _identities([root, *Path(root).parents])):
        return PackedFolder(_archive([]), 0, 0, credentials=(f"{root}/ (kinetic_nb's own keys and jobs)",))
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        unread: list[str] = []
        ignored = [*ALWAYS_IGNORED, *_pattern_file(root_fd, root, IGNORE_FILE, unread)]
        included = _pattern_file(root_fd, root, INCLUDE_FILE, unread)
        credentials_folder = bool(_CREDENTIALS.depths(root.strip("/"), is_dir=True, anywhere=True))
        walk = _Walk(root, _Patterns(ignored), _Patterns(included), own, _is_home(root) or credentials_folder)
    finally:
        os.close(root_fd)
    walk.run()
    return PackedFolder(_archive(walk.chosen), len(walk.chosen), walk.total, tuple(walk.too_large),
                        tuple(walk.credentials), walk.home, tuple(unread))


class _Walk:
    """One walk of the folder: what it chose (read), and what it left out."""

    def __init__(self, root: str, ignored: _Patterns, included: _Patterns, own: set[tuple[int, int]], home: bool):
        self.root, self.ignored, self.included, self.own, self.home = root, ignored, included, own, home
        self.chosen: list[tuple[str, bytes, int]] = []
        self.too_large: list[str] = []
        self.credentials: list[str] = []
        self.total = 0

    def run(self) -> None:
        for directory, dirnames, filenames, dir_fd in os.fwalk(self.root):
            here = _relative(self.root, directory)
            dirnames[:] = [name for name in sorted(dirnames) if self._enters(dir_fd, name, _join(here, name))]
            for name in sorted(filenames):
                self._consider(dir_fd, name, _join(here, name))

    def _enters(self, dir_fd: int, name: str, relative: str) -> bool:
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        if not stat.S_ISDIR(info.st_mode) or self.ignored.match(relative, is_dir=True):
            return False  # a link to a directory is never followed
        if (info.st_dev, info.st_ino) in self.own:
            self.credentials.append(relative + "/")
            return False
        if self._may_include_below(relative):
            return True
        if self.home:
            return False
        if _CREDENTIALS.match(relative, is_dir=True, anywhere=True):
            self.credentials.append(relative + "/")
            return False
        return True

    def _consider(self, dir_fd: int, name: str, relative: str) -> None:
        if self.ignored.match(relative, is_dir=False):
            return
        included = self.included.depths(relative, is_dir=False)
        if self.home and not included:
            return
        credential = _CREDENTIALS.depths(relative, is_dir=False, anywhere=True)
        if credential and (not included or max(included) < min(credential)):
            self.credentials.append(relative)
            return
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode):
                return  # links, FIFOs, sockets, devices
            data = read_regular_file(name, MAX_FILE_BYTES, dir_fd=dir_fd)
        except Unread as unread:
            if unread.size is not None:
                self.too_large.append(f"{relative} ({_size(unread.size)})")
            return
        except OSError:
            return
        self.chosen.append((relative, data, info.st_mode))
        self.total += len(data)
        if self.total > MAX_TOTAL_BYTES or len(self.chosen) > MAX_FILES:
            _refuse(self.root, self.chosen, self.total)

    def _may_include_below(self, directory: str) -> bool:
        """Whether ``.kineticinclude`` may name something below ``directory``: a name pattern (any depth), a
        pattern for the directory or one above it, or a path pattern whose fixed start leads into it."""
        for pattern in self.included.raw:
            path = pattern.rstrip("/")
            if "/" not in path:
                return True
            path = path.lstrip("/")
            fixed = path[:min((path.index(c) for c in "*?[" if c in path), default=len(path))]
            if (directory + "/").startswith(fixed) or fixed.startswith(directory + "/"):
                return True
        return False


def read_regular_file(name: str | os.PathLike[str], limit: int, *, dir_fd: int | None = None) -> bytes:
    """The bytes of ``name`` (relative to ``dir_fd``), read only as the regular file it is when opened: never
    through a link, never waiting on a FIFO, never more than ``limit`` bytes (a file that grew past it, too).

    Raises
    ------
    Unread
        Why it was not read: a link, not a regular file, gone, or over ``limit`` (then with its size).
    """
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise Unread("missing") from None
    except OSError as error:
        raise Unread("a symbolic link" if error.errno == errno.ELOOP else f"not readable ({error.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unread("not a regular file")
        if info.st_size > limit:
            raise Unread(f"over {_size(limit)}", info.st_size)
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise Unread(f"over {_size(limit)}", max(len(data), os.fstat(fd).st_size))
        return data
    finally:
        os.close(fd)


def _pattern_file(root_fd: int, root: str, name: str, unread: list[str]) -> list[str]:
    """The patterns of ``name`` in the folder; none, with the reason added to ``unread``, when it cannot be
    read as a small regular text file."""
    try:
        text = read_regular_file(name, MAX_PATTERN_FILE_BYTES, dir_fd=root_fd).decode()
    except Unread as error:
        if error.why != "missing":
            unread.append(f"{os.path.join(root, name)} was not read ({error.why}): ignored")
        return []
    except UnicodeDecodeError:
        unread.append(f"{os.path.join(root, name)} was not read (not UTF-8 text): ignored")
        return []
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _kinetic_directories() -> list[Path]:
    """Where kinetic_nb keeps this user's keys and jobs: under ``$XDG_CACHE_HOME`` and ``~/.cache`` (either
    may hold them, from a kernel started with the other), and a local ``$KINETIC_STORAGE``."""
    found = [user_directory_path(""), Path.home() / ".cache" / "kinetic_nb"]
    configured = os.environ.get(STORAGE_ENV, "")
    if configured.startswith(("file://", "/")):
        found.append(Path(configured.removeprefix("file://")))
    return found


def _identities(paths: Iterable[str | os.PathLike[str]]) -> set[tuple[int, int]]:
    found = set()
    for path in paths:
        with contextlib.suppress(OSError):
            info = os.stat(path)
            found.add((info.st_dev, info.st_ino))
    return found


def _is_home(root: str) -> bool:
    """Whether ``root`` is this user's home directory or a folder above it."""
    homes = [os.environ.get("HOME", "")]
    with contextlib.suppress(KeyError):
        homes.append(pwd.getpwuid(os.getuid()).pw_dir)
    return any(home and Path(os.path.realpath(home)).is_relative_to(root) for home in homes)


def _archive(chosen: list[tuple[str, bytes, int]]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for relative, data, mode in sorted(chosen):
            info = zipfile.ZipInfo(relative, date_time=_FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = (mode & 0o777) << 16
            archive.writestr(info, data)
    return buffer.getvalue()


def _refuse(root: str, chosen: list[tuple[str, bytes, int]], total: int) -> None:
    largest = ", ".join(f"{name} ({_size(len(data))})" for name, data, _ in
                        sorted(chosen, key=lambda c: -len(c[1]))[:3])
    over = (f"{_size(total)} to send to the hosts, over {_size(MAX_TOTAL_BYTES)}" if total > MAX_TOTAL_BYTES
            else f"more than {MAX_FILES} files to send to the hosts")
    raise ValueError(f"this notebook's folder {root} has {over}: name what they need not get in "
                     f"{os.path.join(root, IGNORE_FILE)} (the largest: {largest})")


def _relative(root: str, path: str) -> str:
    return "" if path == root else Path(path).relative_to(root).as_posix()


def _join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if directory else name


class _Patterns:
    """Patterns compiled once: the name patterns in one expression each for files and directories, the path
    patterns one by one."""

    def __init__(self, patterns: Iterable[str]):
        self.raw = tuple(patterns)
        names: dict[bool, list[str]] = {False: [], True: []}  # by "directories only"
        self.paths: list[tuple[str, bool]] = []
        for pattern in self.raw:
            body = pattern.rstrip("/")
            if "/" in body:
                self.paths.append((body.lstrip("/"), pattern.endswith("/")))
            elif body:
                names[pattern.endswith("/")].append(fnmatch.translate(body))
        self.names = re.compile("|".join(names[False])) if names[False] else None
        self.directory_names = re.compile("|".join(names[True])) if names[True] else None

    def match(self, relative: str, *, is_dir: bool, anywhere: bool = False) -> bool:
        """Whether a pattern matches the file or directory ``relative``: a path pattern from the folder, or with
        ``anywhere`` from any directory in it."""
        name = relative.rsplit("/", 1)[-1]
        if self.names is not None and self.names.match(name):
            return True
        if is_dir and self.directory_names is not None and self.directory_names.match(name):
            return True
        parts = relative.split("/")
        tails = ["/".join(parts[start:]) for start in range(len(parts))] if anywhere else [relative]
        return any(fnmatch.fnmatchcase(tail, pattern) for pattern, directory_only in self.paths
                   if is_dir or not directory_only for tail in tails)

    def depths(self, relative: str, *, is_dir: bool, anywhere: bool = False) -> list[int]:
        """The depths along ``relative`` (0: its first part) at which a pattern matches the path down to there."""
        parts = relative.split("/")
        return [depth for depth in range(len(parts))
                if self.match("/".join(parts[:depth + 1]), is_dir=is_dir or depth < len(parts) - 1,
                              anywhere=anywhere)]


_CREDENTIALS = _Patterns(CREDENTIALS)


def _some(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    return shown + (f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else "")


def _size(count: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
