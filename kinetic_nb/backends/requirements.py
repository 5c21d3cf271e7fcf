"""A ``--requirements`` file as the hosts install it: lines naming this machine's files refused, ``-r`` inlined.

The hosts run pip on the file's copy stored with the job (GKE's prebuilt
mode, an ssh host), or Cloud Build runs it on the copy sent with the build
(GKE's build mode): none of them sees this machine's disk. So a line that names a local file can only
fail there, minutes later, in a host's log. :func:`host_requirements` refuses
it before anything is stored, in one line naming the file, the line number
and why: a local path (``./pkg``, ``/abs/path``, ``~/x``, ``dist/x.whl``), a
``file:`` URL, an editable install of a directory (``-e ./x``), a local
constraints file (``-c constraints.txt``: its pins cannot be inlined without
turning them into installs) or a local wheel directory (``--find-links``).

A local ``-r other.txt`` is inlined (its path relative to the including
file, as pip reads it) and checked line by line the same way: pip reads an
included file as if its lines stood in place of the ``-r`` line. Includes by
URL (``-r https://...``), VCS and https requirements stay as written. A file
with no local include is returned byte for byte, so the build mode's image
tag (a hash of these bytes) does not change.

Comments and line continuations are read as pip reads them. Standard library only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from pathlib import Path

from kinetic_nb.errors import KineticError

__all__ = ["framework_requirement", "host_requirements", "with_framework"]

#: pip's own comment rule: ``#`` at a line's start or after whitespace.
_COMMENT = re.compile(r"(^|\s+)#.*$")
#: Schemes a host reaches over the network (VCS URLs as pip spells them).
_REMOTE = re.compile(r"^(https?|ftp)://|^(git|hg|svn|bzr)\+", re.IGNORECASE)
_FILE_URL = re.compile(r"(^|[\s@=])file:", re.IGNORECASE)
#: What an archive or wheel named by its file name looks like.
_ARCHIVE = re.compile(r"\.(whl|zip|tar|tar\.gz|tgz|tar\.bz2|tbz|tar\.xz|txz)$", re.IGNORECASE)
_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")
#: Includes nest at most this deep: deeper is a cycle pip would also refuse, or a mistake.
MAX_INCLUDE_DEPTH = 10

_INCLUDE = ("-r", "--requirement")
_CONSTRAINT = ("-c", "--constraint")
_EDITABLE = ("-e", "--editable")
_FIND_LINKS = ("-f", "--find-links")
#: What a host cannot reach, and what to do instead (the end of each refusal).
_INSTEAD = ("publish it to an index, install it from a URL (git+https://...), "
            "or use hosts that have it (on GKE, an image: --image-mode custom)")


@dataclasses.dataclass(frozen=True)
class _Line:
    number: int  # the first physical line's number, as pip and editors count
    text: str  # the logical line, continuations joined, comment removed
    physical: str  # the physical lines as written, newlines included


def _logical_lines(text: str) -> list[_Line]:
    lines, pending, start, raw = [], "", 0, ""
    for number, physical in enumerate(text.splitlines(keepends=True), start=1):
        if not pending and not raw:
            start = number
        raw += physical
        stripped = physical.rstrip("\r\n")
        if stripped.endswith("\\") and not _COMMENT.search(stripped):
            pending += stripped[:-1]
            continue
        lines.append(_Line(start, _COMMENT.sub("", pending + stripped).strip(), raw))
        pending, raw = "", ""
    if raw:
        lines.append(_Line(start, _COMMENT.sub("", pending).strip(), raw))
    return lines


def _option(tokens: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the first of ``names`` in ``tokens`` (``-r x``, ``-rx``, ``--requirement=x``), else None."""
    for position, token in enumerate(tokens):
        for name in names:
            if token == name:
                return tokens[position + 1] if position + 1 < len(tokens) else ""
            if name.startswith("--") and token.startswith(name + "="):
                return token[len(name) + 1:]
            if not name.startswith("--") and token.startswith(name) and len(token) > len(name):
                return token[len(name):]
    return None


def _is_local_path(target: str) -> bool:
    if not target or _REMOTE.match(target) or "://" in target:
        return False
    return (target.startswith((".", "/", "~", "\\")) or bool(_DRIVE.match(target)) or "/" in target
            or "\\" in target or bool(_ARCHIVE.search(target)))


def _refusal(line: _Line, where: str) -> str | None:
    """Why a host cannot satisfy ``line`` (any line but a local ``-r``), or None when it can."""
    tokens = _tokens(line.text)
    if not tokens:
        return None
    if _FILE_URL.search(line.text):
        return f"names a file: URL on this machine, which the hosts cannot read: {_INSTEAD}"
    editable = _option(tokens, _EDITABLE)
    if editable is not None:
        if _REMOTE.match(editable):
            return None
        return f"is an editable install of a directory on this machine, which the hosts do not have: {_INSTEAD}"
    constraints = _option(tokens, _CONSTRAINT)
    if constraints is not None and not _REMOTE.match(constraints):
        return (f"names a constraints file on this machine, which the hosts cannot read: serve it at an "
                f"https:// URL (-c https://...), or pin the packages in {where} itself")
    links = _option(tokens, _FIND_LINKS)
    if links is not None and not _REMOTE.match(links):
        return "names a wheel directory on this machine, which the hosts cannot read: serve it at a URL, or use an index"
    if tokens[0].startswith("-"):
        return None  # another option (--pre, --index-url https://..., ...): pip's to judge
    requirement = line.text.split(" -", 1)[0].strip()  # pip's rule: a requirement ends where its options start
    _, at, reference = requirement.partition("@")
    if at and not _REMOTE.match(requirement):  # PEP 508's "name @ URL"
        if _REMOTE.match(reference.split(";", 1)[0].strip()):
            return None
        return f"is a direct reference to a path on this machine, which the hosts do not have: {_INSTEAD}"
    if _is_local_path(tokens[0]):
        return f"is a path on this machine, which the hosts do not have: {_INSTEAD}"
    return None


def _tokens(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote: pip will say so; split on whitespace to judge the rest
        return text.split()


def _read(path: Path, shown: str, included_by: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ValueError(f"{included_by}cannot read the requirements file {shown}: {error.strerror}") from None


def _decode(data: bytes, shown: str, included_by: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ValueError(f"{included_by}the requirements file {shown} is not UTF-8 text") from None


def _inline(text: str, path: Path, shown: str, chain: tuple[Path, ...]) -> tuple[str, bool]:
    """``text`` (of the file ``path``) with its local includes inlined, and whether there were any."""
    pieces, inlined = [], False
    for line in _logical_lines(text):
        where = f"{shown}, line {line.number}"
        tokens = _tokens(line.text)
        include = _option(tokens, _INCLUDE) if tokens and tokens[0].startswith("-") else None
        if include is None or _REMOTE.match(include):
            why = _refusal(line, shown)
            if why:
                raise ValueError(f"{where}: {line.text!r} {why}")
            pieces.append(line.physical)
            continue
        if not include or _FILE_URL.search(include):
            raise ValueError(f"{where}: {line.text!r} names a file: URL on this machine, which the hosts cannot "
                             "read: give the included file as a path (it is then inlined)")
        shown_target = include if os.path.isabs(include) else os.path.join(os.path.dirname(shown), include)
        target = (path.parent / Path(include).expanduser()).resolve()
        if target in chain:
            raise ValueError(f"{where}: {line.text!r} includes {shown_target} again: the includes go round in a circle")
        if len(chain) > MAX_INCLUDE_DEPTH:
            raise ValueError(f"{where}: {line.text!r} nests includes more than {MAX_INCLUDE_DEPTH} deep")
        body, _ = _inline(_decode(_read(target, shown_target, f"{where}: "), shown_target, f"{where}: "),
                          target, shown_target, (*chain, target))
        pieces.append(f"# {line.text}: inlined by kinetic_nb (the hosts have no {shown_target})\n")
        pieces.append(body if not body or body.endswith("\n") else body + "\n")
        inlined = True
    return "".join(pieces), inlined


def host_requirements(path: str | os.PathLike[str]) -> bytes:
    """The bytes the hosts install from the requirements file at ``path``: local ``-r`` includes inlined.

    A file with nothing to inline comes back byte for byte.

    Raises
    ------
    ValueError
        One line naming the file, the line number and why a host cannot
        satisfy that line (see the module's docstring), or why the file cannot be read.
    """
    shown = os.fspath(path)
    file = Path(shown).expanduser()
    data = _read(file, shown, "")
    text, inlined = _inline(_decode(data, shown, ""), file, shown, (file.resolve(),))
    return text.encode() if inlined else data


#: What a host installs for a cell's framework on an accelerator, at the notebook's own version. Torch on TPUs
#: needs torch_xla, which has no version to match the notebook's torch: it is left to --requirements.
FRAMEWORK_PACKAGES = {("tpu", "jax"): "jax[tpu]", ("gpu", "jax"): "jax[cuda12]", ("gpu", "torch"): "torch"}
#: JAX 0.4.30 to 0.5.0 pin a libtpu-nightly that only Google's own release page holds (a local version the
#: package index cannot); from 0.5.1, jax[tpu] takes libtpu from the index like any other package.
FIRST_JAX_TPU_FROM_PYPI = (0, 5, 1)
#: A requirement's project name, at a line's start (PEP 508).
_PROJECT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def framework_requirement(accelerator_kind: str, framework: str, requirements: bytes | None) -> str | None:
    """The line that installs the cell's ``framework`` for ``accelerator_kind`` on a host, pinned to this
    notebook's version (without its local build tag: ``2.13.0+cpu`` is this machine's build); None when the
    requirements name the framework already, or there is nothing to add (CPU hosts, no framework). A session
    whose framework the first cell picks (``auto``) gets JAX on TPUs, the framework TPUs are used with."""
    from kinetic_nb.runner.versions import installed_version

    if framework == "auto" and accelerator_kind == "tpu":
        framework = "jax"
    package = FRAMEWORK_PACKAGES.get((accelerator_kind, framework))
    if package is None or framework in _named_projects(requirements or b""):
        return None
    version = installed_version(framework)
    if package == "jax[tpu]" and version and _release(version) < FIRST_JAX_TPU_FROM_PYPI:
        raise KineticError(
            f"this notebook's JAX {version} cannot be installed on TPU hosts from the package index alone: "
            f"jax[tpu]=={version.split('+')[0]} needs a libtpu-nightly published only on Google's own JAX release "
            f"page; use JAX {'.'.join(map(str, FIRST_JAX_TPU_FROM_PYPI))} or later in this notebook, or name "
            "jax[tpu] and where its libtpu comes from in --requirements")
    return f"{package}=={version.split('+')[0]}" if version else package


def _release(version: str) -> tuple[int, ...]:
    """``0.4.30`` -> (0, 4, 30); a pre-release or build tag ends the numbers (``0.5.0rc1`` -> (0, 5, 0))."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group(0)))
        if digits.group(0) != part:
            break
    return tuple(numbers)


def with_framework(requirements: bytes | None, line: str | None) -> bytes | None:
    """``requirements`` with the framework's ``line`` after them (either may be None)."""
    if line is None:
        return requirements
    base = (requirements or b"").rstrip(b"\n")
    return (base + b"\n" if base else b"") + line.encode() + b"\n"


def _named_projects(requirements: bytes) -> set[str]:
    """The projects ``requirements`` install, by their normalized names (``jax[tpu]==x`` names jax)."""
    names = set()
    for line in _logical_lines(requirements.decode(errors="replace")):
        match = _PROJECT.match(line.text)
        if match and not line.text.startswith("-"):
            names.add(re.sub(r"[-_.]+", "-", match.group(0)).lower())
    return names
