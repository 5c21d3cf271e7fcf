"""The notebook's folder, packed for hosts that do not share its disk (a pod, a Ray node): its modules and
small files, so that ``import mylib`` from the notebook's folder works on them as it does here.

What is left out: what ``.kineticignore`` in the folder names (one pattern a line, ``#`` comments; a pattern
with a ``/`` matches a path from the folder, one without matches a name at any depth, one ending in ``/`` only
directories), the usual caches and environments (:data:`ALWAYS_IGNORED`), symbolic links, and any file larger
than :data:`MAX_FILE_BYTES` (named in the notice). A folder with more than :data:`MAX_TOTAL_BYTES` left is
refused in one line naming its largest files. The archive is the same bytes for the same files (sorted
names, fixed times), so an unchanged folder costs the same object.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import io
import os
import zipfile
from pathlib import Path

__all__ = ["ALWAYS_IGNORED", "IGNORE_FILE", "MAX_FILES", "MAX_FILE_BYTES", "MAX_TOTAL_BYTES", "PackedFolder",
           "pack_folder"]

IGNORE_FILE = ".kineticignore"
#: Never shipped: version control, caches, virtual environments, notebook checkpoints.
ALWAYS_IGNORED = (".git/", ".hg/", ".svn/", "__pycache__/", ".ipynb_checkpoints/", ".venv/", "venv/",
                  "node_modules/", ".mypy_cache/", ".pytest_cache/", ".ruff_cache/", "*.egg-info/", "*.pyc",
                  ".DS_Store")
#: A file larger than this stays behind (data belongs in storage the hosts read, not in the folder shipped).
MAX_FILE_BYTES = 10 << 20
#: The most a folder may ship in all, in bytes and in files (a notebook started in a home directory is
#: refused at once, not walked to the end).
MAX_TOTAL_BYTES = 64 << 20
MAX_FILES = 5000
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


@dataclasses.dataclass(frozen=True)
class PackedFolder:
    """The archive, how many files and bytes it holds, and the files left out for their size."""

    data: bytes
    files: int
    size: int
    too_large: tuple[str, ...] = ()

    def notice(self, folder: str) -> str:
        text = f"the hosts run in a copy of this notebook's folder {folder} ({self.files} files, {_size(self.size)})"
        if self.too_large:
            shown = ", ".join(self.too_large[:3]) + (", ..." if len(self.too_large) > 3 else "")
            text += f"; left out for being over {_size(MAX_FILE_BYTES)}: {shown}"
        return text


def pack_folder(folder: str | os.PathLike[str]) -> PackedFolder:
    """``folder``'s files as the hosts get them.

    Raises
    ------
    ValueError
        One line: what would be shipped is over :data:`MAX_TOTAL_BYTES` or :data:`MAX_FILES`, with its
        largest files.
    """
    root = Path(folder)
    patterns = [*ALWAYS_IGNORED, *_ignore_file(root / IGNORE_FILE)]
    chosen: list[tuple[str, Path, int]] = []
    too_large: list[str] = []
    total = 0
    for directory, dirnames, filenames in os.walk(root):
        here = Path(directory)
        dirnames[:] = sorted(name for name in dirnames if not (here / name).is_symlink()
                             and not _ignored(_relative(root, here / name), patterns, is_dir=True))
        for name in sorted(filenames):
            path = here / name
            relative = _relative(root, path)
            if path.is_symlink() or not path.is_file() or _ignored(relative, patterns, is_dir=False):
                continue
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                too_large.append(f"{relative} ({_size(size)})")
                continue
            chosen.append((relative, path, size))
            total += size
            if total > MAX_TOTAL_BYTES or len(chosen) > MAX_FILES:
                _refuse(root, chosen, total)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for relative, path, _ in sorted(chosen):
            info = zipfile.ZipInfo(relative, date_time=_FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = (path.stat().st_mode & 0o777) << 16
            archive.writestr(info, path.read_bytes())
    return PackedFolder(buffer.getvalue(), len(chosen), total, tuple(too_large))


def _refuse(root: Path, chosen: list[tuple[str, Path, int]], total: int) -> None:
    largest = ", ".join(f"{name} ({_size(size)})" for name, _, size in sorted(chosen, key=lambda c: -c[2])[:3])
    over = (f"{_size(total)} to send to the hosts, over {_size(MAX_TOTAL_BYTES)}" if total > MAX_TOTAL_BYTES
            else f"more than {MAX_FILES} files to send to the hosts")
    raise ValueError(f"this notebook's folder {root} has {over}: name what they need not get in "
                     f"{root / IGNORE_FILE} (the largest: {largest})")


def _ignore_file(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def _relative(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _ignored(relative: str, patterns: list[str], *, is_dir: bool) -> bool:
    name = relative.rsplit("/", 1)[-1]
    for pattern in patterns:
        directory_only = pattern.endswith("/")
        pattern = pattern.rstrip("/")
        if directory_only and not is_dir:
            continue
        if "/" in pattern:
            if fnmatch.fnmatchcase(relative, pattern.lstrip("/")):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def _size(count: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
