"""``gs://`` storage: objects in a Cloud Storage bucket, on the official client.

Host-safe: this module imports only the standard library; the
``google-cloud-storage`` client (the ``gcs`` extra) is imported when a ``gs://``
storage is first opened. ``STORAGE_EMULATOR_HOST`` points the client at an
emulator (fake-gcs-server), with anonymous credentials.

Every request retries transient errors (429, 408, 5xx, refused or dropped
connections) with exponential backoff, long enough to ride out a restarted
server: for up to ``RETRY_DEADLINE_S`` counted from the first failure since
the storage last answered; once a request has given up, every request is tried
once until one succeeds (an agent's loop, its idle timeout and its last
records are not held up a minute per request by a bucket that is gone), but a
record that decides a job's outcome, stored ``patiently()``, rides out the
deadline from its own start until one such record has given up; a
permanent error (403, a missing bucket) is one line naming the bucket and the
object. Single-writer objects
are created with ``if_generation_match=0``. Large values move in
``TRANSFER_CHUNK_BYTES`` pieces (resumable uploads, ranged reads), so a
transfer never holds a second whole copy in memory.
"""

from __future__ import annotations

import collections
import datetime
import io
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable
from typing import IO, Any, TypeVar

from kinetic_nb.errors import ObjectExistsError, ObjectNotFoundError, StorageError
from kinetic_nb.storage.base import ObjectInfo, Storage, is_patient, object_too_large

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Points the client at an emulator (the official client honours it too).
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
#: The project named to an emulator, which needs one and checks nothing.
EMULATOR_PROJECT = "kinetic-emulator"
#: Give up on transient errors after this long: a restarted server, a brief
#: outage or throttling is ridden out; a dead endpoint fails within a minute.
RETRY_DEADLINE_S = 60.0
#: Seconds to ride out an outage instead of ``RETRY_DEADLINE_S``, for every
#: process that inherits it (a notebook's agents and hosts).
RETRY_DEADLINE_ENV = "KINETIC_GCS_RETRY_S"
#: First pause between attempts; it doubles (with jitter) up to the maximum.
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 4.0
#: One request may take this long before it counts as a dropped connection.
REQUEST_TIMEOUT_S = 60.0
#: The most objects Cloud Storage returns in one listing page.
LIST_PAGE_SIZE = 1000
#: Resumable upload chunk and ranged-read size: all a transfer holds in memory
#: at once. Cloud Storage needs a multiple of 256 KiB.
TRANSFER_CHUNK_BYTES = 16 * 1024 * 1024
#: Metadata key of a per-write token: a create-if-absent that is retried after
#: a dropped response recognises its own earlier, successful attempt.
WRITER_TOKEN_KEY = "kinetic-writer"
#: HTTP statuses that say "try again".
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})

_clients: dict[tuple[int, str | None], Any] = {}
_clients_lock = threading.Lock()


def _google() -> Any:
    """The ``google.cloud.storage`` module, or a clear error naming the extra."""
    try:
        from google.cloud import storage
    except ImportError as error:
        raise StorageError(
            f"gs:// storage needs the google-cloud-storage package: pip install 'google-cloud-storage>=3.2' ({error})"
        ) from error
    return storage


def _client() -> Any:
    """This process's client (one per process: a forked host must not share its parent's connections)."""
    emulator = os.environ.get(EMULATOR_ENV) or None
    key = (os.getpid(), emulator)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            storage = _google()
            if emulator:
                from google.auth.credentials import AnonymousCredentials

                project = os.environ.get("GOOGLE_CLOUD_PROJECT", EMULATOR_PROJECT)
                client = storage.Client(project=project, credentials=AnonymousCredentials())
            else:
                client = _authenticated_client(storage)
            # google-cloud-storage 3.17 keeps bucket metadata for its OpenTelemetry spans: it fetches the bucket
            # in the background on its first request and looks it up again after every 404, each a billed
            # request that needs storage.buckets.get. Lookups that find nothing are routine here (the next
            # cell's payload, a verdict not yet written), so this client goes without (the library's own
            # switch is a process-wide variable that would also change the notebook's other clients).
            if getattr(client, "_bucket_metadata_cache", None) is not None:
                client._bucket_metadata_cache = None
            _clients[key] = client
        return client


def _authenticated_client(storage: Any) -> Any:
    """A client on Application Default Credentials, or one line that says how to get them."""
    from google.auth.exceptions import DefaultCredentialsError

    try:
        return storage.Client()
    except DefaultCredentialsError as error:
        raise StorageError(
            "gs:// storage needs Google Cloud credentials and none were found: run "
            "`gcloud auth application-default login` (or set GOOGLE_APPLICATION_CREDENTIALS to a key file), "
            f"or set {EMULATOR_ENV} to use an emulator"
        ) from error


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is worth retrying: throttling, a server error, a refused or dropped connection."""
    import http.client

    code = getattr(error, "code", None)
    if isinstance(code, int) and code in _TRANSIENT_STATUS:
        return True
    response = getattr(error, "response", None)
    if isinstance(getattr(response, "status_code", None), int) and response.status_code in _TRANSIENT_STATUS:
        return True
    if isinstance(error, (ConnectionError, TimeoutError, http.client.HTTPException)):
        return True
    try:
        import requests
        import urllib3
        from google.auth import exceptions as auth_exceptions
    except ImportError:
        return False
    if isinstance(error, (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                          urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError,
                          urllib3.exceptions.PoolError)):
        return True
    if isinstance(error, auth_exceptions.TransportError) and error.args and isinstance(error.args[0], BaseException):
        return is_transient(error.args[0])
    return False


def _status(error: BaseException) -> int | None:
    code = getattr(error, "code", None)
    if isinstance(code, int):
        return code
    status = getattr(getattr(error, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _first_line(error: BaseException) -> str:
    text = str(getattr(error, "message", "") or error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line if len(line) <= 300 else line[:300] + "..."


_ERRNO_TEXT = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")


def _cause(error: BaseException) -> str:
    """What a transport error comes down to, in a few words ("Connection refused"), else its first line."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            return str(cause.strerror)
        cause = cause.__cause__ or cause.__context__
    line = _first_line(error)
    match = _ERRNO_TEXT.search(line)
    return match.group(1).strip() if match else line


def parse_gs_uri(uri: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` -> ``("bucket", "some/prefix/")`` (the prefix is empty or ends in ``/``)."""
    if not uri.startswith("gs://"):
        raise ValueError(f"not a gs:// URI: {uri!r}")
    bucket, _, prefix = uri[len("gs://"):].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}: use gs://BUCKET/PREFIX")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def _retry_deadline() -> float:
    text = os.environ.get(RETRY_DEADLINE_ENV, "").strip()
    if not text:
        return RETRY_DEADLINE_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise StorageError(f"{RETRY_DEADLINE_ENV} must be a number of seconds (0 or more), got {text!r}")
    return seconds


class _Shared:
    """What a storage and its children share: the bucket's state, request counts, and how long it has failed."""

    def __init__(self) -> None:
        self.bucket_seen = False
        #: Requests made, by kind ("list", "read", "write", "delete", "metadata"), retries included.
        self.requests: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        #: The first failed attempt since the storage last answered, and the latest (monotonic), or None.
        self.failing_since: float | None = None
        self.failed_at = 0.0
        #: A request gave up in this outage: the others try once until the storage answers (a patient one, see
        #: ``base.patiently``, rides it out from its own start, until one of those too has given up).
        self.gave_up = False
        self.patience_spent = False

    def count(self, kind: str) -> None:
        with self.lock:
            self.requests[kind] += 1

    def answered(self) -> None:
        self.failing_since, self.gave_up, self.patience_spent = None, False, False

    def failed(self, deadline_s: float) -> float:
        """Note a failed attempt; returns when the outage it belongs to began. Attempts that fail with no
        attempt between them for longer than ``deadline_s`` are separate outages (nobody knows what came
        between)."""
        now = time.monotonic()
        with self.lock:
            if self.failing_since is None or now - self.failed_at > deadline_s:
                self.failing_since, self.gave_up, self.patience_spent = now, False, False
            self.failed_at = now
            return self.failing_since


class GcsStorage(Storage):
    """Objects below ``gs://bucket/prefix``.

    Parameters
    ----------
    uri : str
        ``gs://BUCKET`` or ``gs://BUCKET/PREFIX``.
    retry_deadline_s : float, optional
        How long an outage is ridden out (transient errors retried) before a ``StorageError``: by default
        ``$KINETIC_GCS_RETRY_S``, else ``RETRY_DEADLINE_S``.
    """

    def __init__(self, uri: str, *, retry_deadline_s: float | None = None, _shared: _Shared | None = None):
        self.bucket_name, self.prefix = parse_gs_uri(uri)
        self.uri = f"gs://{self.bucket_name}/{self.prefix}".rstrip("/")
        self.retry_deadline_s = _retry_deadline() if retry_deadline_s is None else retry_deadline_s
        self._shared = _shared or _Shared()
        _google()  # fail now, with the extra's name, if the client is missing

    @property
    def requests(self) -> collections.Counter[str]:
        """Requests made so far through this storage and its children, by kind (retries included)."""
        return self._shared.requests

    def child(self, name: str) -> GcsStorage:
        return GcsStorage(f"{self.uri}/{self._check(name)}", retry_deadline_s=self.retry_deadline_s,
                          _shared=self._shared)

    # -- names -------------------------------------------------------------------

    def _check(self, name: str) -> str:
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise StorageError(f"invalid object name {name!r} in {self.uri}")
        return name

    def _key(self, name: str) -> str:
        return self.prefix + self._check(name)

    def _target(self, name: str) -> str:
        return f"{self.uri}/{name}" if name else self.uri

    def _blob(self, name: str) -> Any:
        blob = _client().bucket(self.bucket_name).blob(self._key(name))
        blob.chunk_size = TRANSFER_CHUNK_BYTES
        return blob

    # -- retries and errors ------------------------------------------------------------

    def unreachable_for(self) -> float:
        """Seconds this storage has failed without answering (0 while it answers)."""
        since = self._shared.failing_since
        return 0.0 if since is None else time.monotonic() - since

    def _call(self, kind: str, op: str, name: str, action: Callable[[int], T]) -> T:
        """``action(attempt)``, retried on transient errors until ``retry_deadline_s`` after the outage began
        (see the module's docstring); permanent ones become storage errors."""
        pause = FIRST_BACKOFF_S
        attempt = 0
        patient, started = is_patient(), time.monotonic()
        while True:
            attempt += 1
            self._shared.count(kind)
            try:
                result = action(attempt)
            except StorageError:
                raise
            except Exception as error:
                if not is_transient(error):
                    mapped = self._permanent(kind, op, name, error)
                    if isinstance(mapped, (ObjectNotFoundError, ObjectExistsError)):
                        self._shared.answered()  # a routine answer: the storage is there
                    elif isinstance(mapped, StorageError):
                        self._shared.failed(self.retry_deadline_s)  # a missing bucket, a denial: it fails
                    if mapped is error:
                        raise
                    raise mapped from error
                began = self._shared.failed(self.retry_deadline_s)
                shared = self._shared
                if patient:
                    left = 0.0 if shared.patience_spent else started + self.retry_deadline_s - time.monotonic()
                else:
                    left = 0.0 if shared.gave_up else began + self.retry_deadline_s - time.monotonic()
                if left <= 0:
                    shared.gave_up = True
                    shared.patience_spent = shared.patience_spent or patient
                    waited = (f"its storage has not answered for {time.monotonic() - began:.1f} s (an outage is "
                              f"ridden out for {self.retry_deadline_s:g} s)")
                    raise StorageError(
                        f"cannot {op} {self._target(name)}: still failing after {attempt} "
                        f"attempt{'s' if attempt > 1 else ''}; {waited}: {_first_line(error)}"
                    ).asked(kind, name, self.uri, f"{waited}: {_cause(error)}") from error
                logger.info("retrying %s of %s (attempt %d): %s", op, self._target(name), attempt, _first_line(error))
                time.sleep(min(pause * random.uniform(0.5, 1.0), left))  # the last attempt at the deadline
                pause = min(pause * 2, MAX_BACKOFF_S)
            else:
                self._shared.answered()
                return result

    def _permanent(self, kind: str, op: str, name: str, error: Exception) -> Exception:
        """The storage error a permanent failure means (``error`` itself when it is no HTTP error)."""
        status = _status(error)
        target = self._target(name)
        if status == 404:
            if op in ("write", "list") or not self._bucket_exists():
                return StorageError(f"bucket {self.bucket_name!r} does not exist (cannot {op} {target})").asked(
                    kind, name, self.uri, f"its bucket {self.bucket_name!r} does not exist")
            return ObjectNotFoundError(f"{target} does not exist")
        if status == 412:
            return ObjectExistsError(f"{target} already exists")
        if status in (401, 403):
            return StorageError(f"permission denied: cannot {op} {target} in bucket {self.bucket_name!r} "
                                f"(HTTP {status}: {_first_line(error)})").asked(
                kind, name, self.uri, f"permission denied (HTTP {status}: {_first_line(error)})")
        if status is not None:
            return StorageError(f"cannot {op} {target}: HTTP {status}: {_first_line(error)}").asked(
                kind, name, self.uri, f"HTTP {status}: {_first_line(error)}")
        return error

    def _bucket_exists(self) -> bool:
        """Whether the bucket exists: asked once per storage family, only after a 404, by listing one object.
        A listing needs only what the hosts have (``roles/storage.objectUser``); a look at the bucket itself
        needs ``storage.buckets.get``, and without it a missing object would read as a denied one."""
        if self._shared.bucket_seen:
            return True

        def look(_: int) -> bool:
            try:
                pages = _client().list_blobs(self.bucket_name, prefix=self.prefix or None, max_results=1,
                                             fields="items(name)", retry=None, timeout=REQUEST_TIMEOUT_S).pages
                next(pages, None)
            except Exception as error:
                if _status(error) == 404:
                    return False
                raise
            return True

        exists = self._call("list", "check the bucket of", "", look)
        self._shared.bucket_seen = exists
        return exists

    # -- the interface ----------------------------------------------------------------

    def write_bytes(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        self._upload(name, io.BytesIO(data), 0, len(data), exclusive)  # BytesIO shares the bytes: no copy

    def write_file(self, name: str, source: str | os.PathLike | IO[bytes], *, exclusive: bool = False) -> None:
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as file:
                self._upload(name, file, 0, os.fstat(file.fileno()).st_size, exclusive)
            return
        if source.seekable():
            start = source.tell()
            size = source.seek(0, io.SEEK_END) - start
            source.seek(start)
            self._upload(name, source, start, size, exclusive)
        else:
            self._upload(name, source, None, None, exclusive)

    def _upload(self, name: str, stream: IO[bytes], start: int | None, size: int | None, exclusive: bool) -> None:
        """Upload ``stream`` from ``start`` (None: not rewindable, so only one attempt can read it)."""
        blob = self._blob(name)
        token = os.urandom(12).hex()
        if exclusive:
            blob.metadata = {WRITER_TOKEN_KEY: token}

        def attempt(number: int) -> None:
            if number > 1:
                if start is None:
                    raise StorageError(f"cannot write {self._target(name)}: the upload failed and its "
                                       f"source cannot be rewound to try again")
                stream.seek(start)
            try:
                blob.upload_from_file(stream, size=size, if_generation_match=0 if exclusive else None,
                                      retry=None, timeout=REQUEST_TIMEOUT_S)
            except Exception as error:
                if exclusive and number > 1 and _status(error) == 412 and self._written_by(name, token):
                    return  # an earlier attempt succeeded; only its response was lost
                raise

        self._call("write", "write", name, attempt)
        self._shared.bucket_seen = True

    def _written_by(self, name: str, token: str) -> bool:
        blob = self._call("metadata", "read", name,
                          lambda _: _client().bucket(self.bucket_name).get_blob(self._key(name), retry=None,
                                                                               timeout=REQUEST_TIMEOUT_S))
        return blob is not None and (blob.metadata or {}).get(WRITER_TOKEN_KEY) == token

    def read_bytes(self, name: str) -> bytes:
        from google.api_core.exceptions import RequestRangeNotSatisfiable

        blob = self._blob(name)

        def download(_: int) -> bytes:
            try:
                return blob.download_as_bytes(retry=None, timeout=REQUEST_TIMEOUT_S)
            except RequestRangeNotSatisfiable:  # an empty object: no range of it exists (RFC 9110, 416)
                return b""

        return self._call("read", "read", name, download)

    def read_bounded(self, name: str, max_bytes: int) -> bytes:
        """One ranged request for the object's first ``max_bytes + 1`` bytes: however large the object is, no
        more than that is downloaded (``ObjectTooLargeError`` when it holds more)."""
        from google.api_core.exceptions import RequestRangeNotSatisfiable

        blob = self._blob(name)

        def first_bytes(_: int) -> bytes:
            sink = _Sink()
            try:
                blob.download_to_file(sink, start=0, end=max_bytes, checksum=None, retry=None,
                                      timeout=REQUEST_TIMEOUT_S, single_shot_download=True)
            except RequestRangeNotSatisfiable:  # an empty object: no range of it exists (RFC 9110, 416)
                return b""
            return sink.value()

        data = self._call("read", "read", name, first_bytes)
        if len(data) > max_bytes:
            raise object_too_large(self, name, max_bytes, blob.size)
        return data

    def open_read(self, name: str) -> IO[bytes]:
        """The object's first chunk is the first request (a record, a cell's payload or value, is one request
        whole); a larger object is read on in ranges pinned to the generation that chunk came from."""
        from google.api_core.exceptions import RequestRangeNotSatisfiable

        blob = self._blob(name)

        def first_chunk(_: int) -> bytes:
            sink = _Sink()
            try:
                blob.download_to_file(sink, start=0, end=TRANSFER_CHUNK_BYTES - 1, checksum=None, retry=None,
                                      timeout=REQUEST_TIMEOUT_S, single_shot_download=True)
            except RequestRangeNotSatisfiable:  # an empty object: no range of it exists (RFC 9110, 416)
                return b""
            return sink.value()

        head = self._call("read", "read", name, first_chunk)
        if len(head) < TRANSFER_CHUNK_BYTES:
            return io.BufferedReader(_RangeReader(self, name, None, len(head), head=head))
        # Pinned to the generation the first chunk came from (fake-gcs-server ignores ifGenerationMatch on
        # downloads, but honours an explicit generation, as Cloud Storage does): its size, then its other ranges.
        if blob.generation is None:  # a store that did not say which generation it sent: learn one, start again
            self._call("metadata", "read", name, lambda _: blob.reload(retry=None, timeout=REQUEST_TIMEOUT_S))
            head = b""
        pinned = _client().bucket(self.bucket_name).blob(self._key(name), generation=blob.generation)
        try:
            self._call("metadata", "read", name, lambda _: pinned.reload(retry=None, timeout=REQUEST_TIMEOUT_S))
        except ObjectNotFoundError:
            raise StorageError(f"{self._target(name)} was replaced or deleted while it was being read") from None
        return io.BufferedReader(_RangeReader(self, name, pinned, pinned.size or 0, head=head))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        key_prefix = self.prefix + prefix
        found: list[ObjectInfo] = []
        token: str | None = None
        while True:
            page, token = self._call("list", "list", prefix,
                                     lambda _, after=token: self._list_page(key_prefix, after))
            for item in page:
                updated = item.get("updated")
                found.append(ObjectInfo(
                    item["name"][len(self.prefix):],
                    int(item.get("size") or 0),
                    str(item.get("generation", "")),
                    datetime.datetime.fromisoformat(updated).timestamp() if updated else 0.0,
                ))
            if not token:
                break
        self._shared.bucket_seen = True
        found.sort(key=lambda info: info.name)
        return found

    def _list_page(self, key_prefix: str, token: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """One page of the listing, as the API's JSON items (building a Blob per item costs more than the request)."""
        iterator = _client().list_blobs(
            self.bucket_name, prefix=key_prefix or None, page_size=LIST_PAGE_SIZE, page_token=token,
            fields="items(name,size,generation,updated),nextPageToken", retry=None, timeout=REQUEST_TIMEOUT_S,
        )
        iterator.item_to_value = lambda _iterator, item: item
        page = next(iterator.pages, None)
        return (list(page) if page is not None else []), iterator.next_page_token

    def exists(self, name: str) -> bool:
        blob = self._blob(name)
        return self._call("metadata", "look up", name, lambda _: blob.exists(retry=None, timeout=REQUEST_TIMEOUT_S))

    def delete(self, name: str) -> None:
        blob = self._blob(name)

        def attempt(number: int) -> None:
            try:
                blob.delete(retry=None, timeout=REQUEST_TIMEOUT_S)
            except Exception as error:
                if number > 1 and _status(error) == 404:
                    return  # an earlier attempt deleted it; only its response was lost
                raise

        self._call("delete", "delete", name, attempt)


class _Sink:
    """Keeps what one download writes, without copying it (a single-shot download writes once)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(data)
        return len(data)

    def value(self) -> bytes:
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)


class _RangeReader(io.RawIOBase):
    """One generation of an object, fetched in ranged requests of at most ``TRANSFER_CHUNK_BYTES``.

    The chunk last fetched is all it holds; ``readinto`` copies from it into the caller's buffer.
    """

    def __init__(self, storage: GcsStorage, name: str, blob: Any, size: int, *, head: bytes = b""):
        super().__init__()
        self._storage = storage
        self._name = name
        self._blob = blob
        self._size = size
        self._fetched = len(head)  # bytes of the object fetched so far (its first chunk, fetched on opening)
        self._chunk = memoryview(head)

    def readable(self) -> bool:
        return True

    def _fetch(self, count: int) -> bytes:
        start, end = self._fetched, self._fetched + count - 1

        def attempt(_: int) -> bytes:
            sink = _Sink()
            try:
                self._blob.download_to_file(sink, start=start, end=end, checksum=None, retry=None,
                                            timeout=REQUEST_TIMEOUT_S, single_shot_download=True)
            except Exception as error:
                if _status(error) in (404, 412, 416):
                    raise StorageError(f"{self._storage._target(self._name)} was replaced or deleted "
                                       f"while it was being read") from error
                raise
            data = sink.value()
            if len(data) != count:
                raise ConnectionError(f"a ranged read returned {len(data)} of {count} bytes")  # retried
            return data

        data = self._storage._call("read", "read", self._name, attempt)
        self._fetched += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        if not self._chunk:
            count = min(TRANSFER_CHUNK_BYTES, self._size - self._fetched)
            if count <= 0:
                return 0
            self._chunk = memoryview(self._fetch(count))
        count = min(len(buffer), len(self._chunk))
        buffer[:count] = self._chunk[:count]
        self._chunk = self._chunk[count:]
        return count

    def readall(self) -> bytes:
        rest = self._size - self._fetched
        if not self._chunk:
            return self._fetch(rest) if rest > 0 else b""  # one request, one copy of the rest
        head, self._chunk = bytes(self._chunk), memoryview(b"")
        return head + self._fetch(rest) if rest > 0 else head
