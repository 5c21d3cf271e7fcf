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
it to the cell.
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
DOMAIN = b"kinetic-nb/envelope/v2\0"
TRAILER_PREFIX = b"\n#kinetic-mac-v2:"
TRAILER_BYTES = len(TRAILER_PREFIX) + 64 + 1
BLOCK_BYTES = 8 * 1024 * 1024
#: How the container's output marks this script's lines.
PREFIX = "[kinetic environment install] "
#: GKE's metadata server gives the pod's service account a token (Workload Identity).
TOKEN_URL = "http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token"
#: A download is tried this many times (429, 5xx, a dropped connection), a second apart and more.
ATTEMPTS = 5


class Refused(Exception):
    """An input that must not be installed, or could not be had: one line."""


def unseal(key, name, data):
    """The body of ``data`` (object ``name``) once its trailer verifies under ``key``; Refused otherwise."""
    if len(data) < TRAILER_BYTES or not data[-TRAILER_BYTES:].startswith(TRAILER_PREFIX):
        raise Refused(f"{name} carries no signature: it was not stored by this job's notebook")
    body = memoryview(data)[:-TRAILER_BYTES]
    prefix = DOMAIN + name.encode() + b"\0"
    final = hmac.new(key, prefix + b"final\0" + len(body).to_bytes(8, "big"), hashlib.sha256)
    for index, start in enumerate(range(0, len(body), BLOCK_BYTES)):
        block = hmac.new(key, prefix + index.to_bytes(8, "big"), hashlib.sha256)
        block.update(body[start:start + BLOCK_BYTES])
        final.update(block.digest())
    expected = TRAILER_PREFIX + final.hexdigest().encode() + b"\n"
    if not hmac.compare_digest(expected, bytes(data[-TRAILER_BYTES:])):
        raise Refused(f"{name} failed verification: it was not stored by this job's notebook; nothing installed")
    return bytes(body)


def _get(url, headers):
    # Imported here: the agent imports this module for its constants, and urllib costs every job ~10 ms.
    import urllib.error
    import urllib.request

    for attempt in range(ATTEMPTS):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as answer:
                return answer.read()
        except urllib.error.HTTPError as error:
            if (error.code != 429 and error.code < 500) or attempt == ATTEMPTS - 1:
                raise Refused(f"could not read {url.split('?')[0]}: HTTP {error.code} {error.reason}") from None
        except (urllib.error.URLError, OSError) as error:
            if attempt == ATTEMPTS - 1:
                raise Refused(f"could not read {url.split('?')[0]}: {error}") from None
        time.sleep(1 + attempt)
    raise AssertionError("unreachable")


def fetch(job_uri, name):
    """The bytes of ``{job_uri}/{name}``."""
    if job_uri.startswith(("file://", "/")):
        path = os.path.join(job_uri[len("file://"):] if job_uri.startswith("file://") else job_uri, name)
        try:
            with open(path, "rb") as file:
                return file.read()
        except OSError as error:
            raise Refused(f"could not read {path}: {error.strerror}") from None
    if not job_uri.startswith("gs://"):
        raise Refused(f"cannot read job storage {job_uri}: only file:// and gs:// are supported")
    bucket, _, prefix = job_uri[len("gs://"):].partition("/")
    object_name = f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").rstrip("/")
    if emulator:
        base, headers = emulator if "://" in emulator else f"http://{emulator}", {}
    else:
        token = json.loads(_get(TOKEN_URL, {"Metadata-Flavor": "Google"}))["access_token"]
        base, headers = "https://storage.googleapis.com", {"Authorization": f"Bearer {token}"}
    import urllib.parse

    quoted = urllib.parse.quote(bucket, safe="") + "/o/" + urllib.parse.quote(object_name, safe="")
    return _get(f"{base}/storage/v1/b/{quoted}?alt=media", headers)


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


def install(record, job_uri, key, directory, log, *, requirements):
    """Verify every input ``record`` names, then create the environment and pip-install them into it."""
    inputs = os.path.join(directory, "inputs")
    os.makedirs(inputs, exist_ok=True)
    wheel = os.path.join(inputs, os.path.basename(record["wheel"]))
    verified = {wheel: unseal(key, record["wheel"], fetch(job_uri, record["wheel"]))}
    requirements_file = None
    if requirements and record.get("requirements"):
        requirements_file = os.path.join(inputs, "requirements.txt")
        verified[requirements_file] = unseal(key, record["requirements"], fetch(job_uri, record["requirements"]))
    for path, body in verified.items():  # written only once all of them verified
        with open(path, "wb") as file:
            file.write(body)
    venv = os.path.join(directory, "venv")
    # The image's own packages stay visible (a base image with jax keeps it), and its pip installs here.
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], log)
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


def main(argv):
    requirements = "--no-requirements" not in argv[: argv.index("--")] if "--" in argv else True
    command = argv[argv.index("--") + 1:] if "--" in argv else argv
    if not command:
        print("kinetic_nb: the environment bootstrap needs a command to run after it", file=sys.stderr)
        return 2
    try:
        with open(os.environ[KEY_FILE_ENV], "rb") as file:
            key = bytes.fromhex(file.read(4 * KEY_BYTES).decode("ascii", errors="replace").strip())
        job_uri = os.environ[JOB_URI_ENV]
        if len(key) != KEY_BYTES:
            raise ValueError
    except (KeyError, ValueError, OSError):
        print(f"kinetic_nb: no job key file or job URI ({KEY_FILE_ENV}, {JOB_URI_ENV})", file=sys.stderr)
        return 2
    directory = os.environ.get(DIRECTORY_ENV) or os.path.join("/tmp", "kinetic-environment")
    os.makedirs(directory, exist_ok=True)
    record_path = os.path.join(directory, "record.json")
    try:
        body = unseal(key, INSTALL_OBJECT, fetch(job_uri, INSTALL_OBJECT))
        digest = hashlib.sha256(body).hexdigest()
        try:
            with open(record_path) as file:
                done = json.load(file)
        except (OSError, ValueError):
            done = {}
        if done.get("digest") != digest or not done.get("ok"):  # a restarted container finds it installed
            started = time.time()
            with open(os.path.join(directory, "install.log"), "wb") as log:
                venv = install(json.loads(body), job_uri, key, directory, log, requirements=requirements)
            done = {"digest": digest, "ok": True, "started_at": started, "ended_at": time.time(), "venv": venv,
                    "log": os.path.join(directory, "install.log")}
            with open(record_path + ".tmp", "w") as file:
                json.dump(done, file)
            os.replace(record_path + ".tmp", record_path)
    except Refused as error:
        print(f"kinetic_nb: environment install failed: {error}", file=sys.stderr)
        return 1
    env = dict(os.environ)
    env["PATH"] = os.path.join(done["venv"], "bin") + os.pathsep + env.get("PATH", "/usr/bin:/bin")
    env["VIRTUAL_ENV"] = done["venv"]
    env[RECORD_ENV] = record_path
    sys.stdout.flush()
    os.execvpe(command[0], command, env)
    return 127  # pragma: no cover - execvpe does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
