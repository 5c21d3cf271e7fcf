"""Before the host agent, in a pod of the prebuilt-image mode: install the job's environment, verified, then run.

A stock Python image has no kinetic_nb: the pod runs this file's text as
``python3 -c TEXT [--no-requirements] -- COMMAND...``, with the standard library
only. It reads the job's signed ``environment/install.json`` from the job's
storage (``$KINETIC_JOB_URI``: ``file://`` or ``gs://``, the latter over the
JSON API with the pod's own token from the metadata server, or through
``$STORAGE_EMULATOR_HOST``), verifies it and each object it names (the
notebook's kinetic_nb wheel, the user's requirements) under the job's key
(in the file ``$KINETIC_JOB_KEY_FILE`` names: the job's Secret, mounted) before anything is installed, then
installs them into a virtual environment under ``$KINETIC_ENVIRONMENT_DIR``
(the pod's scratch volume, so a restarted container finds it installed) and
``exec``\\s COMMAND with that environment's ``bin`` first on ``PATH``.

The MAC is the envelope's (``kinetic_nb.runner.envelope``), written out again
here because kinetic_nb is what is being installed; a test checks that both
agree. Everything pip prints goes to the container's output and to a log that
the host agent copies into the host's log; the install's start and end go to
a record the runner puts first in the host's timeline (``environment install``).
Any failure prints one line and exits 1: the pod's termination message carries
it to the cell. A host pod's container that the kubelet keeps restarting after
a failed install (a LeaderWorkerSet's ``restartPolicy: Always``) is a crash
loop: it counts its starts on the pod's scratch volume, and on the start after
:data:`MAX_STARTS` failed ones it records the host's end, sealed, with the last
error (so the job ends without a notebook) and parks instead of failing again.

On an ssh host the bootstrap also keeps the host's cache bounded: after making a
new environment it removes the oldest of its interpreter's beyond
:data:`KEEP_ENVIRONMENTS` (by last use) that no process runs, and at every run
the agent logs older than :data:`LOG_RETENTION_S`; ``%kinetic gc`` runs the same
pruning over ssh (``--prune-cache``). Whether an environment is in use is
known from a lock: every process that runs its Python holds its folder's
:data:`IN_USE` file locked shared (a ``.pth`` hook the install adds), as does
the bootstrap from choosing it to ``exec``; the pruning removes only a folder
it can lock exclusively, renaming it aside under that lock before deleting it,
so a job starting at that moment finds the whole environment or none (and then
installs it again), never half of one.
"""

import hashlib
import hmac
import json
import os
import subprocess
import sys
import time

KEY_FILE_ENV = "KINETIC_JOB_KEY_FILE"
KEY_BYTES = 32
JOB_URI_ENV = "KINETIC_JOB_URI"
#: Where the environment is installed (default: a fresh directory under /tmp).
DIRECTORY_ENV = "KINETIC_ENVIRONMENT_DIR"
#: Set for COMMAND: the path of the install's record (``kinetic_nb.runner.environment_install`` reads it).
RECORD_ENV = "KINETIC_ENVIRONMENT_RECORD"
INSTALL_OBJECT = "environment/install.json"
#: A host's exit record (``protocol.host_exit``): written here only for a crash loop.
EXIT_RECORD = "hosts/{host}/exit.json"
DOMAIN = b"kinetic-nb/envelope/v2\0"
TRAILER_PREFIX = b"\n#kinetic-mac-v2:"
TRAILER_BYTES = len(TRAILER_PREFIX) + 64 + 1
BLOCK_BYTES = 8 * 1024 * 1024
#: How the container's output marks this script's lines.
PREFIX = "[kinetic environment install] "
#: GKE's metadata server gives the pod's service account a token (Workload Identity).
TOKEN_URL = "http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token"
#: The most bytes read of each object before it is verified (the job's storage is not trusted: a planted giant
#: must not take the pod's memory): the install record is a few hundred bytes, a requirements file a few KiB, the
#: kinetic_nb wheel about a MiB. Anything larger was not stored by the notebook, and is refused unread.
MAX_RECORD_BYTES = 64 * 1024
MAX_REQUIREMENTS_BYTES = 1024 * 1024
MAX_WHEEL_BYTES = 64 * 1024 * 1024
#: A download is tried this many times (429, 5xx, a dropped connection), a second apart and more.
ATTEMPTS = 5
#: A host pod's index (set on every host pod, not the root's).
HOST_INDEX_ENV = "KINETIC_HOST_INDEX"
#: How many processes a host runs (torchrun's name, set on every host pod): host h's are ranks h*N .. h*N+N-1.
PROCS_PER_HOST_ENV = "LOCAL_WORLD_SIZE"
#: A host whose environment install failed on this many container starts in a row is in a crash loop: at the
#: next start its end is recorded and the container parks (kinetic_nb.agent.watch then ends the job).
MAX_STARTS = 3
#: Files in the environment directory (the pod's scratch volume, which outlives a restarted container).
STARTS = "starts"
LAST_ERROR = "last-error.txt"
#: In an ssh host's environments folder (``--environments``): the path of the interpreter its environments are
#: made with, when that is not the Python running this (the notebook's version, installed on the host for
#: kinetic_nb: ``kinetic_nb.backends.ssh.python_install``).
INTERPRETER_RECORD = "interpreter"
#: How many environments an ssh host keeps per interpreter (the newest by last use, plus any a process runs): each
#: is about 1 GB with ``jax[tpu]``, and every kinetic_nb or requirements change makes a new one.
KEEP_ENVIRONMENTS = 3
#: Agent logs (``--output``) older than this are removed from an ssh host: kinetic_nb keeps no job retention of its
#: own (``%kinetic gc --older-than`` is the user's), and a log this old is of a job long over.
LOG_RETENTION_S = 14 * 86400
#: In an environment's folder: locked shared by each process using it, and its modification time the last use.
IN_USE = "in-use.lock"
#: The hook every process of an environment runs at its start (``site`` imports it from a ``.pth`` file): it holds
#: the environment's :data:`IN_USE` lock shared until the process ends, and marks the environment used now.
IN_USE_HOOK = "_kinetic_nb_in_use"
_IN_USE_SOURCE = f"""\
'''Held by every process running this environment's Python: a shared lock on its folder's {IN_USE}, so that an
ssh host's kinetic_nb cache pruning never removes an environment in use; its modification time is the last use.'''
import os
import sys

try:
    import fcntl

    _held = os.open(os.path.join(os.path.dirname(sys.prefix), "{IN_USE}"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                    0o600)
    fcntl.flock(_held, fcntl.LOCK_SH)
    os.utime(_held)
except Exception:  # a folder it cannot write to: the process runs regardless
    pass
"""
#: Where an environment goes while it is removed: renamed aside first, so it is whole under its name or not there.
TRASH_PREFIX = ".removing-"
#: The option that makes this file prune an ssh host's cache instead (``%kinetic gc``), and what it is given.
PRUNE_OPTION = "--prune-cache"


class Refused(Exception):
    """An input that must not be installed, or could not be had: one line."""


def _trailer(key, name, body):
    prefix = DOMAIN + name.encode() + b"\0"
    final = hmac.new(key, prefix + b"final\0" + len(body).to_bytes(8, "big"), hashlib.sha256)
    for index, start in enumerate(range(0, len(body), BLOCK_BYTES)):
        block = hmac.new(key, prefix + index.to_bytes(8, "big"), hashlib.sha256)
        block.update(body[start:start + BLOCK_BYTES])
        final.update(block.digest())
    return TRAILER_PREFIX + final.hexdigest().encode() + b"\n"


def unseal(key, name, data):
    """The body of ``data`` (object ``name``) once its trailer verifies under ``key``; Refused otherwise."""
    if len(data) < TRAILER_BYTES or not data[-TRAILER_BYTES:].startswith(TRAILER_PREFIX):
        raise Refused(f"{name} carries no signature: it was not stored by this job's notebook")
    body = memoryview(data)[:-TRAILER_BYTES]
    if not hmac.compare_digest(_trailer(key, name, body), bytes(data[-TRAILER_BYTES:])):
        raise Refused(f"{name} failed verification: it was not stored by this job's notebook; nothing installed")
    return bytes(body)


def seal(key, name, body):
    """``body`` with its trailer, as the envelope seals the object ``name`` (``runner.envelope.seal``)."""
    return body + _trailer(key, name, body)


def _get(url, headers, limit=MAX_RECORD_BYTES):
    # Imported here: the agent imports this module for its constants, and urllib costs every job ~10 ms.
    import urllib.error
    import urllib.request

    for attempt in range(ATTEMPTS):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as answer:
                return _at_most(answer, limit, url.split("?")[0])
        except urllib.error.HTTPError as error:
            if (error.code != 429 and error.code < 500) or attempt == ATTEMPTS - 1:
                raise Refused(f"could not read {url.split('?')[0]}: HTTP {error.code} {error.reason}") from None
        except (urllib.error.URLError, OSError) as error:
            if attempt == ATTEMPTS - 1:
                raise Refused(f"could not read {url.split('?')[0]}: {error}") from None
        time.sleep(1 + attempt)
    raise AssertionError("unreachable")


def _at_most(file, limit, where):
    """What ``file`` holds, read up to ``limit`` bytes; ``Refused`` (nothing kept) when it holds more."""
    data = file.read(limit + 1)
    if len(data) > limit:
        raise Refused(f"{where} is over the {limit} bytes such an object may hold: refused, not read; nothing "
                      "installed")
    return data


def fetch(job_uri, name, limit=MAX_RECORD_BYTES):
    """The bytes of ``{job_uri}/{name}``, at most ``limit`` of them (``Refused`` for a larger object)."""
    if job_uri.startswith(("file://", "/")):
        path = os.path.join(job_uri[len("file://"):] if job_uri.startswith("file://") else job_uri, name)
        try:
            with open(path, "rb") as file:
                return _at_most(file, limit, path)
        except OSError as error:
            raise Refused(f"could not read {path}: {error.strerror}") from None
    if not job_uri.startswith("gs://"):
        raise Refused(f"cannot read job storage {job_uri}: only file:// and gs:// are supported")
    bucket, prefix, base, headers = _storage_base(job_uri)
    object_name = f"{prefix}/{name}" if prefix else name
    import urllib.parse

    quoted = urllib.parse.quote(bucket, safe="") + "/o/" + urllib.parse.quote(object_name, safe="")
    return _get(f"{base}/storage/v1/b/{quoted}?alt=media", headers, limit)


def _storage_base(job_uri):
    """The bucket, the object prefix, the API's base URL and its headers for a ``gs://`` job."""
    bucket, _, prefix = job_uri[len("gs://"):].partition("/")
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").rstrip("/")
    if emulator:
        return bucket, prefix.strip("/"), emulator if "://" in emulator else f"http://{emulator}", {}
    token = json.loads(_get(TOKEN_URL, {"Metadata-Flavor": "Google"}))["access_token"]
    return bucket, prefix.strip("/"), "https://storage.googleapis.com", {"Authorization": f"Bearer {token}"}


def store_new(job_uri, name, data):
    """Store ``{job_uri}/{name}`` unless it exists (a record written once); whether this call stored it."""
    if job_uri.startswith(("file://", "/")):
        path = os.path.join(job_uri[len("file://"):] if job_uri.startswith("file://") else job_uri, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path, "xb") as file:
                file.write(data)
        except FileExistsError:
            return False
        return True
    import urllib.error
    import urllib.parse
    import urllib.request

    bucket, prefix, base, headers = _storage_base(job_uri)
    query = urllib.parse.urlencode({"uploadType": "media", "name": f"{prefix}/{name}" if prefix else name,
                                    "ifGenerationMatch": "0"})
    request = urllib.request.Request(f"{base}/upload/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o?{query}",
                                     data=data, method="POST",
                                     headers={**headers, "Content-Type": "application/octet-stream"})
    try:
        with urllib.request.urlopen(request, timeout=60):
            return True
    except urllib.error.HTTPError as error:
        if error.code == 412:  # stored already
            return False
        raise Refused(f"could not store {name}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        raise Refused(f"could not store {name}: {error}") from None


def _run(command, log):
    """Run ``command``, its output to the container's and to ``log``, line by line; Refused if it fails."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    for line in process.stdout:
        log.write(line)
        log.flush()
        sys.stdout.write(PREFIX + line.decode(errors="replace"))
        sys.stdout.flush()
    if process.wait() != 0:
        raise Refused(f"{os.path.basename(command[0])} {' '.join(command[1:4])} ... exited with code {process.returncode}"
                      " (its output is above)")


def install(record, job_uri, key, directory, log, *, requirements, interpreter=None):
    """Verify every input ``record`` names, then create the environment with ``interpreter`` (default: the one
    running this) and pip-install them into it."""
    interpreter = interpreter or sys.executable
    inputs = os.path.join(directory, "inputs")
    os.makedirs(inputs, exist_ok=True)
    wheel = os.path.join(inputs, os.path.basename(record["wheel"]))
    verified = {wheel: unseal(key, record["wheel"], fetch(job_uri, record["wheel"], MAX_WHEEL_BYTES))}
    requirements_file = None
    if requirements and record.get("requirements"):
        requirements_file = os.path.join(inputs, "requirements.txt")
        verified[requirements_file] = unseal(key, record["requirements"],
                                                 fetch(job_uri, record["requirements"], MAX_REQUIREMENTS_BYTES))
    for path, body in verified.items():  # written only once all of them verified
        with open(path, "wb") as file:
            file.write(body)
    venv = os.path.join(directory, "venv")
    # The image's own packages stay visible (a base image with jax keeps it), and its pip installs here.
    _run([interpreter, "-m", "venv", "--system-site-packages", "--without-pip", venv], log)
    if interpreter == sys.executable and sys.prefix != sys.base_prefix:  # a virtual environment's: its packages too
        _see_outer_environment(venv)
    _hold_in_use_from_every_process(venv)
    python = os.path.join(venv, "bin", "python")
    if subprocess.run([python, "-c", "import pip"], capture_output=True).returncode != 0:
        _run([python, "-m", "ensurepip", "--default-pip"], log)
    pip = [python, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "--progress-bar", "off"]
    _run([*pip, "--no-deps", wheel], log)  # the notebook's own kinetic_nb, whatever its version says
    packages = list(record.get("packages") or ())
    if requirements_file:
        packages += ["-r", requirements_file]
    if packages:
        _run([*pip, *packages], log)
    return venv


def _see_outer_environment(venv):
    """Make the packages of the virtual environment this bootstrap runs in (an ssh host's ``--ssh-python
    ~/venv/bin/python``) visible in ``venv``, after its own: ``--system-site-packages`` reaches only the base
    interpreter's. Each of its site directories is added as ``site`` adds one (its own ``.pth`` files read, so
    its editable installs come too)."""
    import site

    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    lines = [f"import site; site.addsitedir({path!r})" for path in site.getsitepackages() if os.path.isdir(path)]
    with open(os.path.join(venv, "lib", version, "site-packages", "kinetic-outer-environment.pth"), "w") as file:
        file.write("\n".join(lines) + "\n")


def _hold_in_use_from_every_process(venv):
    """Make every process that runs ``venv``'s Python hold its folder's :data:`IN_USE` lock (a ``.pth`` hook in its
    site-packages: ``site`` runs it at every start, whatever starts the process)."""
    lib = os.path.join(venv, "lib")
    for version in (name for name in os.listdir(lib) if name.startswith("python")):
        site_packages = os.path.join(lib, version, "site-packages")
        with open(os.path.join(site_packages, IN_USE_HOOK + ".py"), "w") as file:
            file.write(_IN_USE_SOURCE)
        with open(os.path.join(site_packages, "kinetic-in-use.pth"), "w") as file:
            file.write(f"import {IN_USE_HOOK}\n")


def hold_in_use(directory):
    """Lock the environment folder ``directory``'s :data:`IN_USE` shared (made, or made again when a pruning put it
    aside meanwhile), marked used now, for this process and the command it ``exec``\\s: its file descriptor."""
    import fcntl

    path = os.path.join(directory, IN_USE)
    for _ in range(ATTEMPTS):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        held = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(held, fcntl.LOCK_SH)
        try:
            still_there = os.path.samestat(os.fstat(held), os.stat(path))
        except OSError:
            still_there = False
        if still_there:
            os.set_inheritable(held, True)
            os.utime(held)
            return held
        os.close(held)  # renamed aside while this waited: the folder is made anew
    raise Refused(f"{directory} was removed {ATTEMPTS} times while this job chose it; run the cell again")


def prune_environments(folder, keep, current=None):
    """Remove the environments in ``folder`` (one interpreter's) beyond the ``keep`` newest by last use that no
    process uses, never ``current``; each renamed aside under its exclusive :data:`IN_USE` lock, then deleted.
    Returns how many were removed and the bytes they held."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0, 0
    removed, freed = 0, 0
    for name in names:  # what a pruning killed midway left
        if name.startswith(TRASH_PREFIX):
            freed += _delete(os.path.join(folder, name))
    found = [os.path.join(folder, name) for name in names if _is_environment(os.path.join(folder, name))]
    found.sort(key=_last_use, reverse=True)
    for directory in found[keep:]:
        if current is not None and os.path.realpath(directory) == os.path.realpath(current):
            continue
        trash = _put_aside_unless_used(directory)
        if trash is not None:
            removed, freed = removed + 1, freed + _delete(trash)
    return removed, freed


def _is_environment(path):
    """Whether ``path`` is an environment's folder: named by its content's digest (16 hex digits), a directory."""
    name = os.path.basename(path)
    return len(name) == 16 and all(char in "0123456789abcdef" for char in name) and os.path.isdir(path)


def _last_use(directory):
    """When an environment was last used: its :data:`IN_USE` file's time (each process's start), else (made before
    in-use locks) its install record's, else its folder's."""
    for path in (os.path.join(directory, IN_USE), os.path.join(directory, "record.json"), directory):
        try:
            return os.stat(path).st_mtime
        except OSError:
            continue
    return 0.0


def _put_aside_unless_used(directory):
    """Rename the environment ``directory`` aside, unless a process uses it; the new path, or None."""
    import fcntl

    trash = os.path.join(os.path.dirname(directory), f"{TRASH_PREFIX}{os.path.basename(directory)}-{os.getpid()}")
    try:
        held = os.open(os.path.join(directory, IN_USE), os.O_RDWR)
    except FileNotFoundError:  # made before in-use locks: a process running its Python says it is used
        if _run_by_a_process(os.path.join(directory, "venv")):
            return None
        return trash if _rename(directory, trash) else None
    except OSError:
        return None
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a process holds it: in use
        os.close(held)
        return None
    try:  # under the lock: a process starting now waits for it, then finds the folder gone (or whole)
        return trash if _rename(directory, trash) else None
    finally:
        os.close(held)


def _rename(source, target):
    try:
        os.rename(source, target)
    except OSError:
        return False
    return True


def _run_by_a_process(venv):
    """Whether one of this user's processes runs ``venv``'s Python (its program there, or its ``VIRTUAL_ENV``);
    True where processes cannot be listed (no ``/proc``)."""
    if not os.path.isdir("/proc"):
        return True
    program_prefix, variable = venv.encode() + b"/", b"VIRTUAL_ENV=" + venv.encode()
    for pid in (name for name in os.listdir("/proc") if name.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                program = file.read().split(b"\0", 1)[0]
            with open(f"/proc/{pid}/environ", "rb") as file:
                variables = file.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if program.startswith(program_prefix) or variable in variables:
            return True
    return False


def _delete(path):
    """Remove the folder ``path``, whatever is in it; the bytes it held."""
    import shutil

    size = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                size += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    shutil.rmtree(path, ignore_errors=True)
    return size


def prune_logs(folder, older_than, jobs=()):
    """Remove the agent logs in ``folder`` last written more than ``older_than`` seconds ago, and those of the
    ended ``jobs`` (``{job}-{host}.log``); how many."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    cutoff, ended, removed = time.time() - older_than, set(jobs), 0
    for name in names:
        if not name.endswith(".log"):
            continue
        path = os.path.join(folder, name)
        try:
            old = os.lstat(path).st_mtime < cutoff
            if old or name[:-len(".log")].rsplit("-", 1)[0] in ended:
                os.unlink(path)
                removed += 1
        except OSError:
            continue
    return removed


def prune_cache(options, stdin):
    """``--prune-cache --environments DIR --agent-logs DIR [--keep N] [--logs-older-than SECONDS]``, the ended jobs
    whose logs go one a line on ``stdin``: prune every interpreter's environments and the agent logs (both under the
    cache directory), printing one JSON line of what was removed."""
    environments = _cache_path(_option(options, "--environments"))
    logs = _cache_path(_option(options, "--agent-logs"))
    keep = int(_option(options, "--keep") or KEEP_ENVIRONMENTS)
    older_than = float(_option(options, "--logs-older-than") or LOG_RETENTION_S)
    removed, freed = 0, 0
    if environments is not None and os.path.isdir(environments):
        for name in sorted(os.listdir(environments)):
            if os.path.isdir(os.path.join(environments, name)):
                count, size = prune_environments(os.path.join(environments, name), keep)
                removed, freed = removed + count, freed + size
    jobs = [line.strip() for line in stdin.decode(errors="replace").splitlines() if line.strip()]
    logs_removed = prune_logs(logs, older_than, jobs) if logs is not None else 0
    print(json.dumps({"environments": removed, "bytes": freed, "logs": logs_removed}))
    return 0


def _bound_cache(environments, current, output, *, new):
    """An ssh host's cache after a job chose its environment ``current``: the interpreter's oldest environments
    pruned when ``current`` is ``new`` (just made), and old agent logs at every run. Never fails the job."""
    try:
        if new:
            prune_environments(environments, KEEP_ENVIRONMENTS, current)
        if output is not None:
            prune_logs(os.path.dirname(output), LOG_RETENTION_S)
    except OSError as error:
        print(f"kinetic_nb: the host's cache could not be pruned: {error}", file=sys.stderr)


def main(argv):
    if argv[:1] == [PRUNE_OPTION]:
        return prune_cache(argv[1:], sys.stdin.buffer.read())
    options = argv[: argv.index("--")] if "--" in argv else []
    requirements = "--no-requirements" not in options
    command = argv[argv.index("--") + 1:] if "--" in argv else argv
    if not command:
        print("kinetic_nb: the environment bootstrap needs a command to run after it", file=sys.stderr)
        return 2
    # An ssh host: the key comes first on standard input (then what else COMMAND reads there), the install is
    # kept under --environments by its content and reused, it runs once (no kubelet restarts it), and COMMAND's
    # output goes to --output, a file on the host (the ssh session it came by may end before it does).
    from_stdin = "--key-stdin" in options
    once = "--once" in options
    environments = _cache_path(_option(options, "--environments"))
    output = _cache_path(_option(options, "--output"))
    stdin = sys.stdin.buffer.read() if from_stdin else b""
    try:
        if from_stdin:
            key = bytes.fromhex(stdin.split(b"\n", 1)[0].decode("ascii", errors="replace").strip())
        else:
            with open(os.environ[KEY_FILE_ENV], "rb") as file:
                key = bytes.fromhex(file.read(4 * KEY_BYTES).decode("ascii", errors="replace").strip())
        job_uri = os.environ[JOB_URI_ENV]
        if len(key) != KEY_BYTES:
            raise ValueError
    except (KeyError, ValueError, OSError):
        where = "standard input" if from_stdin else f"a job key file ({KEY_FILE_ENV})"
        print(f"kinetic_nb: no job key on {where}, or no job URI ({JOB_URI_ENV})", file=sys.stderr)
        return 2
    directory = os.environ.get(DIRECTORY_ENV) or os.path.join("/tmp", "kinetic-environment")
    if environments is None:
        os.makedirs(directory, exist_ok=True)
    host = os.environ.get(HOST_INDEX_ENV, "")
    if not once and host.isdigit() and _crash_loop(directory, os.path.join(directory, "record.json"), job_uri, key,
                                                   int(host)):
        return _park()
    try:
        body = unseal(key, INSTALL_OBJECT, fetch(job_uri, INSTALL_OBJECT))
        digest = hashlib.sha256(body).hexdigest()
        if environments is not None:  # one environment per content, shared by the jobs that install the same
            directory = os.path.join(environments, digest[:16])
            hold_in_use(directory)  # until the command's end: no pruning removes it under the job
        record_path = os.path.join(directory, "record.json")
        with open(os.path.join(directory, ".lock"), "w") as lock:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)  # another job's install of the same environment finishes first
            try:
                with open(record_path) as file:
                    done = json.load(file)
            except (OSError, ValueError):
                done = {}
            installed_now = done.get("digest") != digest or not done.get("ok")
            if installed_now:  # a restarted container (an ssh host's next job) finds it installed
                started = time.time()
                with open(os.path.join(directory, "install.log"), "wb") as log:
                    venv = install(json.loads(body), job_uri, key, directory, log, requirements=requirements,
                                   interpreter=_interpreter_of(environments))
                done = {"digest": digest, "ok": True, "started_at": started, "ended_at": time.time(), "venv": venv,
                        "log": os.path.join(directory, "install.log")}
                with open(record_path + ".tmp", "w") as file:
                    json.dump(done, file)
                os.replace(record_path + ".tmp", record_path)
    except (Refused, OSError) as error:  # OSError: the environment's folder cannot be made or written
        print(f"kinetic_nb: environment install failed: {error}", file=sys.stderr)
        try:
            _write(os.path.join(directory, LAST_ERROR), _why(error, os.path.join(directory, "install.log")))
        except OSError:
            pass
        return 1
    if environments is not None:
        _bound_cache(environments, directory, output, new=installed_now)
    env = dict(os.environ)
    env["PATH"] = os.path.join(done["venv"], "bin") + os.pathsep + env.get("PATH", "/usr/bin:/bin")
    env["VIRTUAL_ENV"] = done["venv"]
    if installed_now or not once:  # the host's timeline starts with the install it waited for, not an old one
        env[RECORD_ENV] = record_path
    sys.stdout.flush()
    if from_stdin:  # what came on standard input, the key first, is COMMAND's standard input
        read_end, write_end = os.pipe()
        os.write(write_end, stdin)
        os.close(write_end)
        os.dup2(read_end, 0)
        os.close(read_end)
    if output is not None:
        os.makedirs(os.path.dirname(output) or ".", mode=0o700, exist_ok=True)
        target = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, 1)
        os.dup2(target, 2)
        os.close(target)
    os.execvpe(command[0], command, env)
    return 127  # pragma: no cover - execvpe does not return


def _interpreter_of(environments):
    """The interpreter an ssh host's environments folder names (:data:`INTERPRETER_RECORD`), or None: the one
    running this makes them."""
    if environments is None:
        return None
    try:
        with open(os.path.join(environments, INTERPRETER_RECORD)) as file:
            named = file.read().strip()
    except OSError:
        return None
    return named if named and os.access(named, os.X_OK) else None


def _cache_path(path):
    """``path`` under the user's cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``) unless it is absolute."""
    if path is None or os.path.isabs(os.path.expanduser(path)):
        return None if path is None else os.path.expanduser(path)
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), path)


def _option(options, name):
    """The value after ``name`` in ``options`` (``--output FILE``), or None."""
    return options[options.index(name) + 1] if name in options[:-1] else None


def _crash_loop(directory, record_path, job_uri, key, host):
    """Count this container's start; past :data:`MAX_STARTS` with the environment never installed (the kubelet
    restarting a failed install, a LeaderWorkerSet pod's ``restartPolicy: Always``), record the host's end,
    sealed, where the notebook, ``%kinetic jobs`` and the root's watcher read it, so that the job ends instead
    of holding the slice; whether it is such a loop."""
    starts_path = os.path.join(directory, STARTS)
    try:
        with open(starts_path) as file:
            starts = int(file.read().strip() or 0) + 1
    except (OSError, ValueError):
        starts = 1
    _write(starts_path, str(starts))
    try:
        with open(record_path) as file:
            installed = bool(json.load(file).get("ok"))
    except (OSError, ValueError):
        installed = False
    if starts <= MAX_STARTS or installed:
        return False
    try:
        with open(os.path.join(directory, LAST_ERROR)) as file:
            last = file.read().strip()
    except OSError:
        last = "(none recorded)"
    per_host = os.environ.get(PROCS_PER_HOST_ENV, "1")
    per_host = int(per_host) if per_host.isdigit() and int(per_host) > 0 else 1
    for rank in range(host * per_host, (host + 1) * per_host):  # the end of each of the host's processes
        name = EXIT_RECORD.format(host=rank)
        body = json.dumps({"host_index": rank, "exit_code": 1, "ended_at": time.time(), "stderr_tail": [last],
                           "reason": f"a crash loop: its environment install failed on each of its {starts - 1} "
                                     f"starts; the last: {last}"}, sort_keys=True, indent=1).encode()
        try:
            store_new(job_uri, name, seal(key, name, body))
        except Refused as error:
            print(f"kinetic_nb: could not record the crash loop: {error}", file=sys.stderr)
    print(f"kinetic_nb: host {host}'s environment install failed on each of its {starts - 1} starts; its end is "
          "recorded, and this container waits to be deleted with the job", file=sys.stderr)
    return True


def _park():
    """Wait, doing nothing, until the pod is deleted: an exit would be restarted by the kubelet."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


def _why(error, log_path):
    """The failure in one line: the error, and pip's own last ``ERROR:`` line when pip failed."""
    text = str(error).replace(" (its output is above)", "")
    try:
        with open(log_path, "rb") as log:
            lines = log.read()[-65536:].decode(errors="replace").splitlines()
    except OSError:
        return text
    said = [line.strip() for line in lines if line.strip().startswith("ERROR:")]
    return f"{text}: {said[-1]}" if said else text


def _write(path, text):
    with open(path + ".tmp", "w") as file:
        file.write(text)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
