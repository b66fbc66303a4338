"""S3 byte mover: concurrent multipart uploads and concurrent ranged GETs on s3fs's async client.

Every request goes through ``S3FileSystem._call_s3``, so botocore's retry modes
(``config_kwargs={"retries": ...}`` in the storage options) and s3fs's own retry wrapper
handle transient failures (503 SlowDown, 500, connection resets); nothing here swallows an
error or retries on its own. Part size and requests in flight come from s3fs's own options
``default_block_size`` and ``max_concurrency`` when the storage options set them.

Every request, retries included, must finish within ``request_timeout`` seconds (a storage
option, default 120): a server that accepts a connection and never answers fails the
operation with a ``StorageError`` naming the URL instead of hanging the job, and the engine's
collectives carry that failure to every rank. The cleanup requests that follow a timeout share
``cleanup_timeout`` seconds (default 30; ``dcpbridge.storage.backends.deadlines``), so a stalled store
fails an operation within ``request_timeout + cleanup_timeout`` (150 s by default).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import io
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import botocore.config
import s3fs.core
from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url
from fsspec.asyn import sync
from fsspec.exceptions import FSTimeoutError

from dcpbridge.storage.backends.deadlines import (
    DEFAULT_CLEANUP_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT,
    RequestBudget,
    failure_bound,
)
from dcpbridge.storage.backends.store import (
    Committed,
    Read,
    Storage,
    parts_of,
    storage_op,
)
from dcpbridge.storage.errors import ConcurrentSaveError, InvalidArgumentError

log = logging.getLogger(__name__)

# s3fs's retry loop for errors that botocore's cannot see (a body stream that breaks off).
_retrying = getattr(s3fs.core, "_error_wrapper", None)

MIN_PART_SIZE = 5 << 20  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 << 30
MAX_PARTS = 10_000
DEFAULT_PART_SIZE = 16 << 20
DEFAULT_CONCURRENCY = 8
# Parts double in size every this many parts, so a file never needs more than MAX_PARTS.
_PARTS_PER_SIZE_STEP = 1000


@dataclass(frozen=True, slots=True)
class S3Transfer:
    """How requests are sized and overlapped: one open file / one fetch keeps at most
    ``concurrency`` requests of ``part_size`` bytes in flight."""

    part_size: int = DEFAULT_PART_SIZE
    concurrency: int = DEFAULT_CONCURRENCY
    fixed_part_size: bool = False
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    """Seconds one request (with its retries) may take before the operation fails."""
    cleanup_timeout: float = DEFAULT_CLEANUP_TIMEOUT
    """Seconds all requests after a timed-out one (the failed operation's cleanup) share."""

    def __post_init__(self) -> None:
        for name, option in (
            ("part_size", "default_block_size"),
            ("concurrency", "max_concurrency"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(
                    f"S3 {option} must be an integer, got {value!r} ({type(value).__name__})"
                )
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise InvalidArgumentError(
                f"S3 part size (default_block_size) must be between 5 MiB and 5 GiB, "
                f"got {self.part_size}"
            )
        if self.concurrency < 1:
            raise InvalidArgumentError(f"S3 max_concurrency must be >= 1, got {self.concurrency}")
        for name in ("request_timeout", "cleanup_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(
                    f"S3 {name} must be > 0 seconds, got {getattr(self, name)}"
                )

    @property
    def failure_bound(self) -> float:
        """Seconds within which a stalled store fails a save or load on the stalled rank."""
        return failure_bound(self.request_timeout, self.cleanup_timeout)

    def budget(self) -> RequestBudget:
        """A fresh per-storage request budget with these timeouts."""
        return RequestBudget(self.request_timeout, self.cleanup_timeout)

    @staticmethod
    def from_fs(fs: Any, settings: dict[str, Any] | None = None) -> S3Transfer:
        """Our defaults, overridden by ``default_block_size`` / ``max_concurrency`` (s3fs's
        options) and ``request_timeout`` / ``cleanup_timeout`` (``settings``: dcpbridge's
        own) if given."""
        opts = getattr(fs, "storage_options", {}) or {}
        settings = settings or {}
        timeouts = {}
        for name, default in (
            ("request_timeout", DEFAULT_REQUEST_TIMEOUT),
            ("cleanup_timeout", DEFAULT_CLEANUP_TIMEOUT),
        ):
            value = settings.get(name, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgumentError(f"S3 {name} must be seconds, got {value!r}")
            timeouts[name] = float(value)
        return S3Transfer(
            part_size=opts.get("default_block_size") or DEFAULT_PART_SIZE,
            concurrency=opts.get("max_concurrency") or DEFAULT_CONCURRENCY,
            fixed_part_size=bool(getattr(fs, "fixed_upload_size", False)),
            **timeouts,
        )

    def part_size_for(self, part_number: int) -> int:
        """Size of 1-based part ``part_number``: grows so 10,000 parts cover any object."""
        if self.fixed_part_size:
            return self.part_size
        step = (part_number - 1) // _PARTS_PER_SIZE_STEP
        return min(self.part_size << step, MAX_PART_SIZE)


class _BoundedFS:
    """An s3fs filesystem whose blocking calls each fail at the budget's timeout (fsspec's
    ``sync`` takes the ``timeout`` and cancels the request); everything else passes through."""

    _BOUNDED = frozenset(
        {
            "ls",
            "find",
            "exists",
            "isfile",
            "info",
            "rm",
            "rm_file",
            "size",
            "cat_file",
            "cat_ranges",
            "pipe_file",
        }
    )

    def __init__(self, fs: Any, budget: RequestBudget) -> None:
        self._fs, self._budget = fs, budget

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if name not in self._BOUNDED:
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            timeout = self._budget.timeout()
            if timeout <= 0:
                raise self._budget.spent(name)
            try:
                return attr(*args, timeout=timeout, **kwargs)
            except FSTimeoutError:
                raise self._budget.timed_out(timeout, name) from None

        return call


class S3Storage(Storage):
    """S3 (s3fs): parallel multipart uploads, parallel ranged reads, one PUT per commit."""

    def __init__(self, location: Any) -> None:
        super().__init__(location)
        _check_client_options(location.url, getattr(self.fs, "storage_options", {}) or {})
        if "?versionId=" in location.root:
            # s3fs cuts every key there: all files of the checkpoint would be one object
            raise InvalidArgumentError(
                f"{location.url}: an S3 checkpoint location cannot contain '?versionId=' "
                "(s3fs reads it as an object version, so every file would land on one key)"
            )
        self.transfer = S3Transfer.from_fs(self.fs, location.settings)
        self.budget = self.transfer.budget()
        self.fs = _BoundedFS(self.fs, self.budget)

    def new_operation(self) -> None:
        """Requests get their full ``request_timeout`` again (after an earlier one's cleanup)."""
        self.budget.restart()

    @storage_op("create directory")
    def makedirs(self) -> bool:
        """Object stores have no directories (and creating buckets is not ours to do)."""
        return False

    @storage_op("open for writing")
    def open_write(self, path: str) -> MultipartWriter:
        return MultipartWriter(self.fs._fs, path, self.transfer, self.budget)

    @storage_op("read")
    def read_file(self, path: str) -> bytes:
        """One GET (no size lookup first, and empty objects read as b"")."""
        got = self.budget.bounded(self.fs._cat_file(path, max_concurrency=1), "GET")
        return _wait(self.fs.loop, got)

    def _read_committed(self, path: str) -> Committed:
        """One GET: the commit object's bytes and its ETag (for a conditional commit)."""
        got = self.budget.bounded(_get_with_etag(self.fs._fs, path), "GET")
        data, etag = _wait(self.fs.loop, got)
        return Committed(data, etag)

    def _publish(
        self, name: str, data: bytes, temp_name: str, sync: bool, replaces: Committed | None
    ) -> None:
        """One PUT: S3 replaces an object atomically, so readers see old or new, never a mix.

        With ``replaces`` the PUT is conditional (``If-None-Match: *`` for a first commit,
        else ``If-Match`` on the ETag read): if another commit landed since, the server
        refuses it and ``ConcurrentSaveError`` is raised.
        """
        path = self.location.path(name)
        fs, budget = self.fs._fs, self.budget
        condition: dict[str, str] = {}
        if replaces is not None:
            if replaces.data is None:
                condition["IfNoneMatch"] = "*"
            elif isinstance(replaces.tag, str):
                condition["IfMatch"] = replaces.tag
        try:
            try:
                _request(fs, "put_object", path, budget, Body=data, **condition)
            except OSError as e:
                if not condition or _error_code(e) not in _UNSUPPORTED_CODES:
                    raise
                log.warning(
                    "%s does not support conditional PUTs (%s): committing %s unconditionally",
                    self.location.url,
                    e,
                    name,
                )
                _request(fs, "put_object", path, budget, Body=data)
        except OSError as e:
            if not condition or _error_code(e) not in _CONFLICT_CODES:
                raise
            # A retried PUT whose first attempt landed is refused too: then the data is ours.
            if self.read_committed(name).data != data:
                raise ConcurrentSaveError(
                    f"{self.location.url}: another save committed {name} while this one was "
                    "committing; this save did not commit (the other one's checkpoint is in "
                    "place)"
                ) from e
        finally:
            self.fs.invalidate_cache(path)

    @storage_op("look up")
    def exists(self, name: str) -> bool:
        self.fs.invalidate_cache(self.location.root)
        return super().exists(name)

    @storage_op("look up")
    def info(self, path: str) -> dict[str, Any]:
        """A HEAD of the object, never a listing this process cached: another process may
        have replaced it (the commit file's ETag keys the decoded-metadata cache)."""
        self.fs.invalidate_cache(path)
        return super().info(path)

    @storage_op("look up")
    def file_size(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        return super().file_size(path)

    @storage_op("list")
    def list_names(self) -> list[str]:
        self.fs.invalidate_cache(self.location.root)  # other processes write here too
        return super().list_names()

    @storage_op("list")
    def file_sizes(self) -> dict[str, int]:
        self.fs.invalidate_cache(self.location.root)
        return super().file_sizes()

    @storage_op("remove")
    def remove(self, names: Sequence[str]) -> None:
        """Delete files ``names`` (keys taken literally), raising if S3 kept any of them."""
        _delete(self.fs._fs, [self._paths.get(n) or self._path_of(n) for n in names], self.budget)
        self.fs.invalidate_cache(self.location.root)

    @storage_op("remove")
    def remove_folder(self) -> None:
        """Delete every object under the checkpoint's prefix (``<root>/``, a listing that
        takes the root literally), raising if S3 kept any of them."""
        root = self.location.root.rstrip("/")
        self.fs.invalidate_cache(root)
        try:
            found = self.fs.find(root)
        except FileNotFoundError:
            found = []
        _delete(self.fs._fs, found, self.budget)
        self.fs.invalidate_cache(root)

    @storage_op("read")
    def fetch(self, reads: Sequence[Read], threads: int) -> None:
        """Ranged GETs of at most ``part_size`` bytes (``split_parts``; each body streamed into
        its parts), ``concurrency`` (or ``threads``) at a time. Each read's ``on_done`` runs on
        s3fs's event-loop thread as soon as its bytes landed: handing many small callbacks
        (per-block checksums) to another thread would make each wait for the busy loop
        thread's GIL slice."""
        if reads:
            limit = max(self.transfer.concurrency, threads)
            part_size = self.transfer.part_size
            sync(self.fs.loop, _fetch_all, self.fs, reads, part_size, limit, self.budget)


def _check_client_options(url: str, opts: dict[str, Any]) -> None:
    """Refuse s3fs options of the wrong type now, naming them: s3fs builds its client at the
    first request, where they would fail as a bare AttributeError or TypeError mid-save."""
    for name in ("client_kwargs", "config_kwargs", "s3_additional_kwargs"):
        value = opts.get(name)
        if value is not None and not isinstance(value, dict):
            raise InvalidArgumentError(
                f"{url}: storage option {name} must be a mapping, got {value!r}"
            )
    for name in ("key", "secret", "token", "profile"):
        value = opts.get(name)
        if value is not None and not isinstance(value, str):
            raise InvalidArgumentError(
                f"{url}: storage option {name} must be a string, got {type(value).__name__}"
            )
    client_kwargs = opts.get("client_kwargs") or {}
    for endpoint in (client_kwargs.get("endpoint_url"), opts.get("endpoint_url")):
        if endpoint is not None:
            _check_endpoint(url, endpoint)
    try:
        botocore.config.Config(**(opts.get("config_kwargs") or {}))
    except Exception as e:
        raise InvalidArgumentError(
            f"{url}: storage option config_kwargs is not a valid botocore Config: "
            f"{type(e).__name__}: {e}"
        ) from e


def _check_endpoint(url: str, endpoint: object) -> None:
    """Refuse an endpoint URL botocore would refuse at the first request, with a bare
    ValueError naming neither the option nor the checkpoint (``localhost:9000``: no scheme)."""
    if not isinstance(endpoint, str):
        raise InvalidArgumentError(
            f"{url}: storage option endpoint_url must be a string, got {type(endpoint).__name__}"
        )
    try:
        valid = bool(is_valid_endpoint_url(endpoint) or is_valid_ipv6_endpoint_url(endpoint))
    except ValueError:  # urllib's own refusal (an unclosed IPv6 bracket)
        valid = False
    if not valid:
        raise InvalidArgumentError(
            f"{url}: storage option endpoint_url {endpoint!r} is not a URL botocore accepts "
            "(scheme://host[:port], e.g. http://localhost:9000)"
        )


def _wait(loop: Any, coro: Awaitable[Any]) -> Any:
    async def run() -> Any:
        return await coro

    return sync(loop, run)


async def _fetch_all(
    fs: Any, reads: Sequence[Read], piece: int, limit: int, budget: RequestBudget
) -> None:
    gate = asyncio.Semaphore(limit)

    async def fetch_one(r: Read) -> None:
        async def get(start: int, parts: list[memoryview | int]) -> None:
            async with gate:
                await budget.bounded(_read_into(fs, r.path, start, parts), "GET")

        await asyncio.gather(*(get(*span) for span in split_parts(r.start, parts_of(r), piece)))
        if r.on_done is not None:
            r.on_done()

    tasks = [asyncio.ensure_future(fetch_one(r)) for r in reads]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def split_parts(
    start: int, parts: Sequence[memoryview | int], piece: int
) -> list[tuple[int, list[memoryview | int]]]:
    """A scatter read's ``parts`` cut into back-to-back requests of at most ``piece`` bytes
    each, as (start, parts); a buffer or skip crossing a cut is split. Together they ask for
    exactly the bytes the scatter read asks for."""
    spans: list[tuple[int, list[memoryview | int]]] = []
    pos, cur_start, fill = start, start, 0
    cur: list[memoryview | int] = []
    for p in parts:
        n = p if isinstance(p, int) else len(p)
        at = 0
        while at < n:
            if not cur:
                cur_start = pos + at
            take = min(n - at, piece - fill)
            cur.append(take if isinstance(p, int) else p[at : at + take])
            at += take
            fill += take
            if fill == piece:
                spans.append((cur_start, cur))
                cur, fill = [], 0
        pos += n
    if cur:
        spans.append((cur_start, cur))
    return spans


_SKIP_BUFFER = 1 << 20  # bytes between the parts of one GET are read through this and dropped


# What S3 answers a conditional PUT that lost: 412, or 409 for a concurrent conditional write.
_CONFLICT_CODES = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
# What a store that lacks conditional PUTs answers one (the commit then falls back to a plain PUT).
_UNSUPPORTED_CODES = ("NotImplemented", "501")


async def _get_with_etag(fs: Any, path: str) -> tuple[bytes, str]:
    bucket, key = _split(fs, path)
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    body = resp["Body"]
    try:
        return await body.read(), resp["ETag"]
    finally:
        body.close()


class ShortReadError(OSError):
    """An object ended before the bytes its checkpoint metadata points at."""


async def _read_into(fs: Any, path: str, start: int, parts: Sequence[memoryview | int]) -> None:
    """One ranged GET streamed straight into ``parts`` in order (an int part is skipped), with
    no intermediate copy of the body; a failure while streaming it is retried like s3fs's
    own ``cat_file``."""
    bucket, key = _split(fs, path)
    end = start + sum(p if isinstance(p, int) else len(p) for p in parts)
    if end == start:
        return
    gap = max((p for p in parts if isinstance(p, int)), default=0)
    skip = memoryview(bytearray(min(gap, _SKIP_BUFFER)))

    async def attempt() -> None:
        resp = await fs._call_s3(
            "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}"
        )
        body = resp["Body"]
        pos = start
        try:
            _check_range(resp, path, start, end)
            for part in parts:
                left = part if isinstance(part, int) else len(part)
                while left:
                    view = skip[: min(left, len(skip))] if isinstance(part, int) else part[-left:]
                    n = await body.readinto(view)
                    if n == 0:
                        raise ShortReadError(
                            f"short read from {path}: wanted bytes {start}..{end}, the object "
                            f"ends at {pos} (truncated?)"
                        )
                    left -= n
                    pos += n
        finally:
            body.close()

    try:
        await (_retrying(attempt, retries=fs.retries) if _retrying else attempt())
    except OSError as e:
        if _error_code(e) != "InvalidRange":
            raise
        raise ShortReadError(
            f"short read from {path}: bytes {start}..{end} lie beyond its end (truncated?)"
        ) from e


class RangeMismatchError(OSError):
    """An object store answered a ranged GET with other bytes than the range asked for."""


def _check_range(resp: dict[str, Any], path: str, start: int, end: int) -> None:
    """Raise unless the answer to a GET of bytes ``[start, end)`` begins at ``start``: a
    server (or proxy) that ignores Range answers 200 with the whole object, whose first bytes
    would otherwise land where bytes ``start...`` belong."""
    got = resp.get("ContentRange")
    if got is None:
        if start == 0:  # the whole object: its first bytes are the ones asked for
            return
    else:
        first, _, last = got.removeprefix("bytes ").split("/", 1)[0].partition("-")
        # a range cut short by the object's end is a short read, reported as one below
        if first.strip() == str(start) and last.strip().isdigit() and int(last) < end:
            return
    raise RangeMismatchError(
        f"ranged GET of {path} asked for bytes {start}..{end} but the store answered "
        f"{f'Content-Range {got!r}' if got else 'the whole object (it ignored Range)'}"
    )


def _error_code(e: BaseException) -> str | None:
    """The S3 error code behind an exception s3fs translated (None if there is none)."""
    response = getattr(e.__cause__, "response", None) or getattr(e, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


_DELETE_BATCH = 1000  # keys one DeleteObjects request may name


def _delete(fs: Any, paths: Sequence[str], budget: RequestBudget) -> None:
    """Delete objects ``paths`` with DeleteObjects requests; raise if S3 kept any. S3 answers
    200 even when it refused some keys (listed under ``Errors``), which s3fs's ``rm`` drops:
    a commit file kept while its data files went would look like a complete checkpoint."""
    by_bucket: dict[str, list[str]] = {}
    for path in paths:
        bucket, key = _split(fs, path)
        by_bucket.setdefault(bucket, []).append(key)
        fs.invalidate_cache(path)
    failed: list[str] = []
    for bucket, keys in by_bucket.items():
        for at in range(0, len(keys), _DELETE_BATCH):
            objects = [{"Key": k} for k in keys[at : at + _DELETE_BATCH]]
            call = fs._call_s3(
                "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True}
            )
            out = _wait(fs.loop, budget.bounded(call, "delete_objects"))
            failed += [
                f"{bucket}/{e.get('Key')}: {e.get('Code')}: {e.get('Message')}"
                for e in out.get("Errors") or ()
            ]
    if failed:
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        raise OSError(
            f"S3 kept {len(failed)} object(s) it was asked to delete: {'; '.join(failed[:3])}{more}"
        )


def _split(fs: Any, path: str) -> tuple[str, str]:
    bucket, key, _ = fs.split_path(path)
    return bucket, key


def _request(fs: Any, method: str, path: str, budget: RequestBudget, **kwargs: Any) -> Any:
    """One S3 request about object ``path``, waited for at most the budget's timeout (s3fs
    and botocore retry it meanwhile)."""
    bucket, key = _split(fs, path)
    call = fs._call_s3(method, Bucket=bucket, Key=key, **kwargs)
    return _wait(fs.loop, budget.bounded(call, method))


class MultipartWriter:
    """Write-only file object: a single PUT if it stays under one part, else a multipart
    upload with up to ``concurrency`` parts in flight. Leaving its ``with`` block with an
    exception (or ``abort()``) cancels the upload, so no partial object ever appears. Requests
    wait as ``budget`` allows (by default a budget of its own, from ``transfer``)."""

    def __init__(
        self, fs: Any, path: str, transfer: S3Transfer, budget: RequestBudget | None = None
    ) -> None:
        self.fs, self.path, self.transfer = fs, path, transfer
        self._budget = budget or transfer.budget()
        self.bucket, self.key = _split(fs, path)
        self._buf = io.BytesIO()  # the part being filled (botocore sends BytesIO uncopied)
        self._upload_id: str | None = None
        self._parts: dict[int, str] = {}
        self._pending: dict[concurrent.futures.Future[Any], int] = {}
        self._next_part = 1
        self._closed = False

    # -- file protocol --------------------------------------------------------------------

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self._closed:
            raise InvalidArgumentError(f"write to closed upload {self.path}")
        mv = memoryview(data).cast("B")
        n = len(mv)
        while len(mv):
            target = self.transfer.part_size_for(self._next_part)
            take = min(target - self._buf.tell(), len(mv))
            self._buf.write(mv[:take])  # the only copy a part's bytes get on our side
            mv = mv[take:]
            if self._buf.tell() == target:
                self._send(self._take_buffer())
        return n

    def flush(self) -> None:
        """Parts go up as they fill; nothing else can be made durable before ``close``."""

    def close(self) -> None:
        """Finish the object (PUT or complete the multipart upload) or raise."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._upload_id is None:
                _request(self.fs, "put_object", self.path, self._budget, Body=self._take_buffer())
            else:
                if self._buf.tell():
                    self._send(self._take_buffer())
                self._wait(0)
                self._complete()
        except BaseException:
            self._abort()
            raise
        finally:
            self._buf = io.BytesIO()
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        """Drop everything written so far; the object is not created (or left unchanged)."""
        if not self._closed:
            self._closed = True
            self._buf = io.BytesIO()
            self._abort()

    def __enter__(self) -> MultipartWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- multipart ------------------------------------------------------------------------

    def _take_buffer(self) -> io.BytesIO:
        """The filled part, rewound for sending; a fresh buffer takes its place."""
        body, self._buf = self._buf, io.BytesIO()
        body.seek(0)
        return body

    def _send(self, body: io.BytesIO) -> None:
        if self._next_part > MAX_PARTS:
            raise OSError(
                f"{self.path}: more than {MAX_PARTS} parts of {self.transfer.part_size} bytes; "
                "raise default_block_size in storage_options"
            )
        try:
            if self._upload_id is None:
                self._upload_id = _request(
                    self.fs, "create_multipart_upload", self.path, self._budget
                )["UploadId"]
            self._wait(self.transfer.concurrency - 1)
        except BaseException:
            self.abort()
            raise
        number = self._next_part
        self._next_part += 1
        call = self.fs._call_s3(
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
        )
        fut = asyncio.run_coroutine_threadsafe(
            self._budget.bounded(call, "upload_part"), self.fs.loop
        )
        self._pending[fut] = number

    def _wait(self, allowed: int) -> None:
        """Block until at most ``allowed`` parts are in flight; raise if any part failed."""
        while len(self._pending) > allowed:
            done, _ = concurrent.futures.wait(
                self._pending, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for fut in done:
                number = self._pending.pop(fut)
                try:
                    self._parts[number] = fut.result()["ETag"]
                except Exception as e:
                    raise OSError(f"uploading part {number} of {self.path} failed: {e}") from e

    def _complete(self) -> None:
        parts = [{"PartNumber": n, "ETag": self._parts[n]} for n in sorted(self._parts)]
        _request(
            self.fs,
            "complete_multipart_upload",
            self.path,
            self._budget,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": parts},
        )
        self._upload_id = None

    def _abort(self) -> None:
        for fut in self._pending:
            fut.cancel()
        for fut in self._pending:
            with contextlib.suppress(BaseException):
                fut.result()
        self._pending.clear()
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        try:
            _request(self.fs, "abort_multipart_upload", self.path, self._budget, UploadId=upload_id)
        except Exception as e:  # the bucket's lifecycle rules reap what we could not abort
            log.warning("could not abort multipart upload %s of %s: %s", upload_id, self.path, e)


def s3_storage_options(
    base: dict[str, Any] | None = None,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    key: str | None = None,
    secret: str | None = None,
    token: str | None = None,
    part_size: int | None = None,
    concurrency: int | None = None,
) -> dict[str, Any]:
    """s3fs ``storage_options`` for these settings, on top of ``base`` (the one place that
    knows s3fs's option names: endpoint and region in ``client_kwargs``, credentials as
    ``key``/``secret``/``token``, part size as ``default_block_size``)."""
    opts = dict(base or {})
    client_kwargs = dict(opts.get("client_kwargs") or {})
    if endpoint_url is not None:
        client_kwargs["endpoint_url"] = endpoint_url
    if region is not None:
        client_kwargs["region_name"] = region
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    for name, value in (("key", key), ("secret", secret), ("token", token)):
        if value is not None:
            opts[name] = value
    if part_size is not None:
        opts["default_block_size"] = part_size
    if concurrency is not None:
        opts["max_concurrency"] = concurrency
    return opts
