"""Stores at fsspec URLs: ``s3://bucket/dump.zarr``, ``gs://``, ``az://``, ``memory://``, ``file://``.

A store path is either a local path or a URL with a scheme (``scheme://...``).
For a URL, the Zarr store is zarr's :class:`~zarr.storage.FsspecStore` over the
fsspec file system of the scheme (s3fs for ``s3://``); obstore is an opt-in layer
for the pass's chunk reads (:func:`gradforensics.store.url_reads.read_store`; measured by ``benchmarks/analyze.py
--url``, the choice argued in ``docs/cluster.md``).  HDF5 files at
a URL are refused (one line saying to use Zarr): h5py reads a remote file through
many small, dependent range requests, and cannot write one at all.

Credentials and endpoints come from the standard environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ...,
read by the file system itself) or from ``storage_options``
(``Recorder(..., storage_options=)``, ``Store(..., storage_options=)``,
``--storage-option KEY=VALUE``), which travel inside the store's
:class:`~gradforensics.store.location.Location` to every open of it - the
lock, results written back, and each dask task, which opens the store on its
worker.  Nothing is remembered per URL in the process.

Transient failures (connection resets, timeouts, HTTP 5xx, throttling: judged by
status code and exception type, :func:`is_transient`) are
retried with exponential backoff (:func:`with_retries`); a missing bucket or
refused credentials is one :class:`~gradforensics.errors.GradforensicsError`
line (:func:`describe_error`).

An endpoint that keeps failing is given up on in bounded time: each store
operation has a total deadline (``GRADFORENSICS_REMOTE_DEADLINE_S``, default
:data:`DEADLINE_S`): no retry is started that would end past it, and an attempt still
unanswered when it comes is given up on there (it runs on a helper thread, left to end
on its own when the client's timeouts end it: a stalled request never holds the caller
past the deadline, issue 42); and the process
has a retry budget (``GRADFORENSICS_REMOTE_RETRY_BUDGET``, default
:data:`RETRY_BUDGET`: each retry spends one, each operation that succeeds gives
back a tenth), so that operations failing one after the other stop retrying once
it is spent.  One request cannot stall an attempt for long either: the s3://
defaults bound botocore's connect and read timeouts and its own attempts, and
s3fs's own retry loop is turned off (:func:`_bounded`), so that one attempt takes
at most ``(1 + max_attempts) * read_timeout`` and botocore's backoff (about 50 s
with the defaults: two fit inside the deadline).  Giving up is one
:class:`~gradforensics.errors.StoreUnreachableError` line naming the URL, the
attempts and the time they took.
"""

from __future__ import annotations

import contextvars
import errno
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gradforensics.errors import (
    GradforensicsError,
    NoAnswerError,
    NotAStoreError,
    SpecError,
    StorePermissionError,
    StoreUnreachableError,
)
from gradforensics.store.answers import exception_chain, status_of

T = TypeVar("T")

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+)://")
#: attempts of one operation before a transient error is final, and the first backoff in seconds.
ATTEMPTS = 6
BACKOFF_S = 0.1
#: the total time in seconds one store operation may take with its retries (``GRADFORENSICS_REMOTE_DEADLINE_S``)
DEADLINE_S = 120.0
#: retries one process may make before failures are final at once (``GRADFORENSICS_REMOTE_RETRY_BUDGET``);
#: each operation that succeeds gives back :data:`_REFUND` of one
RETRY_BUDGET = 100.0
_REFUND = 0.1
#: s3:// requests: botocore's timeouts (s3fs's values) and its own retries (standard mode: 5xx, throttling and
#: dropped connections; ``max_attempts`` counts the retries after the first request, measured: 2 -> 3 requests,
#: with backoff of at most 1 s then 2 s), so that one attempt of an operation, at most 3 * 15 s + 3 s, fits
#: twice inside :data:`DEADLINE_S`.  s3fs's own retry loop (5 tries) is turned off on the instance
#: (:func:`_bounded`): its tries would multiply botocore's.
_S3_DEFAULTS: dict[str, Any] = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 15,
                                                  "retries": {"max_attempts": 2, "mode": "standard"}}}
_S3FS_RETRIES = 1
#: default options per scheme (file://: create directories as zarr writes into them)
_DEFAULTS: dict[str, dict[str, Any]] = {"s3": _S3_DEFAULTS, "s3a": _S3_DEFAULTS, "file": {"auto_mkdir": True}}
#: HTTP statuses of an answer worth retrying: request timeout, too many requests, the server's own failures
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: S3 (and other AWS-style) error codes of throttling and of the service's own failures, whatever the status
_TRANSIENT_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                              "ThrottlingException", "ThrottledException", "RequestThrottled", "TooManyRequests",
                              "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
                              "ProvisionedThroughputExceededException", "OperationAborted"})
#: errnos s3fs gives the OSError it turns a 503 / SlowDown / ServiceUnavailable / 409 (EBUSY) or a
#: 500 / InternalError (EREMOTEIO) into (``s3fs.errors``); the botocore error is its cause only sometimes
_TRANSIENT_ERRNOS = frozenset({errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO)})


def scheme(path: Any) -> str | None:
    """The URL scheme of *path* (``"s3"``, ``"memory"``, ...), or None for a local path."""
    m = _SCHEME.match(str(path))
    return m.group(1).lower() if m else None


def is_url(path: Any) -> bool:
    """Whether *path* is an fsspec URL rather than a local path (``file://`` counts as a URL)."""
    return scheme(path) is not None


def normalize(url: str) -> str:
    """*url* without trailing slashes."""
    return str(url).rstrip("/")


def options_for(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The storage options an open of *url* uses: the scheme's defaults, then *storage_options*.

    Nested options merge key by key (``config_kwargs={"read_timeout": 5}`` keeps the
    default retries); a value given wins over the default.
    """
    return _merged(_DEFAULTS.get(scheme(url) or "", {}), storage_options or {})


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: _merged(v, {}) if isinstance(v, Mapping) else v for k, v in base.items()}
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def _bounded(fs: Any) -> Any:
    """*fs* with s3fs's own retry loop off (botocore's attempts and :func:`with_retries` retry instead)."""
    if type(fs).__module__.split(".")[0] == "s3fs" and isinstance(getattr(fs, "retries", None), int):
        fs.retries = _S3FS_RETRIES
    return fs


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--storage-option`` (VALUE as JSON if it parses: numbers, booleans, objects).

    ``client_kwargs.endpoint_url=http://...`` sets a nested key.
    """
    import json

    key, sep, raw = text.partition("=")
    if not sep or not key or not all(key.split(".")):
        raise SpecError(f"--storage-option {text!r}: expected KEY=VALUE (e.g. anon=true, "
                                 "endpoint_url=http://127.0.0.1:9000).")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def parse_options(items: list[str] | None) -> dict[str, Any]:
    """The ``--storage-option`` flags as a storage_options dict (dotted keys nest)."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, value = parse_option(item)
        *parents, leaf = key.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise SpecError(f"--storage-option {item!r}: {p} was given a value and a key below it.")
        d[leaf] = value
    return out


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(fsspec file system, path inside it)`` of *url*."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(normalize(url), **options_for(url, storage_options))
    except (ImportError, ValueError) as exc:
        raise GradforensicsError(f"{url}: no file system for this URL ({exc}); for s3:// install s3fs "
                                 "(pip install 'gradforensics[remote]'), for gs:// gcsfs, for az:// adlfs.") from exc
    return _bounded(fs), str(path).rstrip("/")


def zarr_store(url: str, read_only: bool, storage_options: Mapping[str, Any] | None = None,
               fenced: bool = False) -> Any:
    """zarr's FsspecStore for the store at *url*.

    ``fenced=True`` (a writer, ``s3://``): every write a conditional PUT, armed by the writer's lock
    (:mod:`gradforensics.store.fenced`).
    """
    from zarr.storage import FsspecStore

    from gradforensics.store.fenced import FENCED_SCHEMES, fenced_store_class

    cls: Any = fenced_store_class() if fenced and not read_only and scheme(url) in FENCED_SCHEMES else FsspecStore
    try:
        store = cls.from_url(normalize(url), storage_options=options_for(url, storage_options),
                                     read_only=read_only)
    except (ImportError, ValueError, TypeError) as exc:
        raise GradforensicsError(f"{url}: zarr cannot open this URL ({type(exc).__name__}: {exc}).") from exc
    _bounded(store.fs)
    return store


#: Exception types (by name, anywhere in the class's ancestry: botocore, aiohttp and s3fs are optional) of a
#: request that got no usable answer: dropped, timed out, cut short (what s3fs itself retried).
_TRANSIENT_TYPES = frozenset({"HTTPClientError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
                              "EndpointConnectionError", "IncompleteRead", "ResponseParserError", "FSTimeoutError",
                              "ClientPayloadError", "ServerDisconnectedError", "ClientConnectorError",
                              "ClientOSError", "ServerTimeoutError"})


def is_transient(exc: BaseException) -> bool:
    """A failure worth retrying: a request with no usable answer, or an answer that says "try again".

    Judged by type and by status, never by the words of the message: the exception or
    any in its chain of causes is a connection / timeout error (:data:`_TRANSIENT_TYPES`),
    or carries an HTTP status of :data:`_TRANSIENT_STATUS` or an error code of
    :data:`_TRANSIENT_CODES` (botocore's ``response``, aiohttp's ``status``, gcsfs's
    ``code``, azure's ``status_code``), or is the ``OSError`` s3fs makes of a 503 or a 500
    (errno ``EBUSY`` / ``EREMOTEIO``).  A missing object, a refusal or a damaged chunk is not.
    """
    for e in exception_chain(exc):
        if isinstance(e, (FileNotFoundError, PermissionError, FileExistsError, GradforensicsError)):
            return False
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if any(c.__name__ in _TRANSIENT_TYPES for c in type(e).__mro__):
            return True
        status, code = status_of(e)
        if status in _TRANSIENT_STATUS or code in _TRANSIENT_CODES:
            return True
        if status is not None or code is not None:
            return False                 # an answer that is not "try again": 4xx, a refusal
        if type(e) is OSError and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise SpecError(f"{name}={raw!r}: expected a positive number (e.g. {name}={default:g}).")
    return value


def deadline_s() -> float:
    """The total time one store operation may take with its retries: ``GRADFORENSICS_REMOTE_DEADLINE_S``."""
    return _env_seconds("GRADFORENSICS_REMOTE_DEADLINE_S", DEADLINE_S)


class _RetryBudget:
    """The retries this process may still make (a token bucket: a retry spends one, a success refunds a tenth)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spent = 0.0

    def take(self) -> bool:
        """Spend one retry; False (nothing spent) when the budget is gone."""
        cap = _env_seconds("GRADFORENSICS_REMOTE_RETRY_BUDGET", RETRY_BUDGET)
        with self._lock:
            if self._spent + 1 > cap:
                return False
            self._spent += 1
            return True

    def refund(self) -> None:
        with self._lock:
            self._spent = max(0.0, self._spent - _REFUND)

    def reset(self) -> None:
        with self._lock:
            self._spent = 0.0


_BUDGET = _RetryBudget()


def reset_retry_budget() -> None:
    """Give this process its whole retry budget back (``GRADFORENSICS_REMOTE_RETRY_BUDGET`` retries)."""
    _BUDGET.reset()


def with_retries(fn: Callable[[], T], what: str, attempts: int | None = None, backoff_s: float = BACKOFF_S,
                 deadline: float | None = None, op: str | None = None) -> T:
    """``fn()``, retried with exponential backoff (and jitter) while it fails transiently.

    Retrying stops at *attempts* (:data:`ATTEMPTS`), when the next attempt (the backoff, then as long as
    the last attempt took) would end past *deadline* seconds from the start
    (:func:`deadline_s` by default), or when the process's retry budget is spent;
    then the last transient error becomes one
    :class:`~gradforensics.errors.StoreUnreachableError` naming *what* (the URL) and the
    operation (*op*, e.g. ``"reading batches/step"``, else botocore's operation name).
    Any other error is raised as it is.
    """
    attempts = ATTEMPTS if attempts is None else attempts
    limit = deadline_s() if deadline is None else deadline
    start = time.monotonic()
    answered: BaseException | None = None        # the last failure the service did answer (a 503 ...)
    for i in range(attempts):
        begun = time.monotonic()
        try:
            out = _answered_within(fn, start + limit - begun)
        except NoAnswerError as exc:
            raise _gave_up(what, answered or exc, i + 1, time.monotonic() - start,
                           f"the last one unanswered at the deadline of {limit:g} s "
                           "(GRADFORENSICS_REMOTE_DEADLINE_S)", op) from answered
        except Exception as exc:
            if not is_transient(exc):
                raise
            if _answer_of(exc) != (None, None):
                answered = exc
            now = time.monotonic()
            pause = backoff_s * (2 ** i) * (0.5 + random.random())
            if i == attempts - 1:
                why = f"all {attempts} attempts failed"
            elif now + pause + (now - begun) - start > limit:
                why = (f"another attempt would pass the deadline of {limit:g} s "
                       "(GRADFORENSICS_REMOTE_DEADLINE_S)")
            elif not _BUDGET.take():
                why = "this process has spent its retry budget (GRADFORENSICS_REMOTE_RETRY_BUDGET)"
            else:
                time.sleep(pause)
                continue
            raise _gave_up(what, exc, i + 1, now - start, why, op) from exc
        _BUDGET.refund()
        return out
    raise AssertionError(what)   # pragma: no cover  (the loop returns or raises)


def _answered_within(fn: Callable[[], T], seconds: float) -> T:
    """``fn()``, or :class:`NoAnswerError` when it has not returned within *seconds*.

    ``fn`` runs on a daemon helper thread (in a copy of the caller's context): a request
    that the service accepts and never answers holds that thread until the client's own
    timeouts end it, never the caller.  What it raises is raised here.
    """
    if seconds <= 0:
        raise NoAnswerError("the deadline had passed before the attempt")
    box: dict[str, Any] = {}
    done = threading.Event()
    ctx = contextvars.copy_context()

    def run() -> None:
        try:
            box["out"] = ctx.run(fn)
        except BaseException as exc:     # handed to the caller
            box["exc"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="gradforensics-store-request", daemon=True).start()
    if not done.wait(seconds):
        raise NoAnswerError(f"no answer in {seconds:.1f} s")
    if "exc" in box:
        raise box["exc"]
    return box["out"]  # type: ignore[no-any-return]


def _gave_up(what: str, exc: BaseException, tries: int, took: float, why: str,
             op: str | None = None) -> StoreUnreachableError:
    status, code = _answer_of(exc)
    op = op or _operation_of(exc)
    attempts = f"{tries} attempt{'s' if tries > 1 else ''} in {took:.1f} s, {why}"
    last = ("last request: still unanswered" if isinstance(exc, NoAnswerError)
            else f"last error: {type(exc).__name__}: {_short(str(exc), 120)}")
    if status is not None or code is not None:          # the service answered, every time "try again"
        answer = " ".join(str(x) for x in (status, code) if x is not None)
        return StoreUnreachableError(
            f"{what}: {op or 'a request'} failed: the storage service kept answering {answer} (throttled or "
            f"failing): {attempts} ({last}); retry later, or ask less of it at once (fewer --workers).")
    return StoreUnreachableError(
        f"{what}: the storage service could not be reached: {attempts}{f' while {op}' if op else ''} ({last}); "
        "check the endpoint (AWS_ENDPOINT_URL or --storage-option endpoint_url=...), the network and the "
        "service's status.")


def _answer_of(exc: BaseException) -> tuple[int | str | None, str | None]:
    """The HTTP status and error code a failure in *exc*'s chain carries (an s3fs errno: its status class)."""
    for e in exception_chain(exc):
        status, code = status_of(e)
        if status is not None or code is not None:
            return status, code
    for e in exception_chain(exc):
        if type(e) is OSError and e.errno in _TRANSIENT_ERRNOS:
            return ("HTTP 503-class (busy)" if e.errno == errno.EBUSY else "HTTP 500-class (internal error)"), None
    return None, None


def _operation_of(exc: BaseException) -> str | None:
    """botocore's name of the request that failed (``GetObject``, ``PutObject``...), if the chain has it."""
    for e in exception_chain(exc):
        name = getattr(e, "operation_name", None)
        if isinstance(name, str) and name:
            return name
    return None


def describe_error(url: str, exc: BaseException) -> GradforensicsError | None:
    """One line for a missing bucket, refused credentials or an unreachable service at *url*, or None."""
    text = str(exc)
    low = text.lower()
    if isinstance(exc, FileNotFoundError) and ("bucket" in low or "nosuchbucket" in low):
        return NotAStoreError(f"{url}: the bucket does not exist ({_short(text)}); check the URL, or create it.")
    if isinstance(exc, PermissionError) or any(w in low for w in ("invalidaccesskeyid", "signaturedoesnotmatch",
                                                                   "accessdenied", "access denied", "forbidden",
                                                                   "expiredtoken", "nocredentials",
                                                                   "unable to locate credentials")):
        return StorePermissionError(f"{url}: the storage service refused the credentials ({_short(text)}); set "
                                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or --storage-option key=... "
                                    "secret=...) and, for a non-AWS service, AWS_ENDPOINT_URL.")
    if (isinstance(exc, ConnectionError) or type(exc).__name__ in _UNREACHABLE
            or "could not connect to the endpoint" in low):
        return StoreUnreachableError(f"{url}: the storage service could not be reached after retries "
                                     f"({_short(text)}); check the endpoint (AWS_ENDPOINT_URL or --storage-option "
                                     "endpoint_url=...) and the network.")
    return None


#: Exception types (by name: botocore and aiohttp are optional) of a service that cannot be reached.
_UNREACHABLE = frozenset({"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                          "ClientConnectorError", "ServerDisconnectedError"})


def _short(text: str, n: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


def translated(url: str, fn: Callable[[], T], what: str = "", op: str | None = None) -> T:
    """``with_retries(fn)``, a missing bucket, refused credentials or a service that keeps failing turned into one line.

    *op* names the operation in that line (``"listing the store"``, ``"writing analysis/..."``).
    """
    try:
        return with_retries(fn, what or url, op=op)
    except GradforensicsError:
        raise
    except Exception as exc:
        err = describe_error(url, exc)
        if err is not None:
            raise err from exc
        raise


__all__ = ["ATTEMPTS", "BACKOFF_S", "DEADLINE_S", "RETRY_BUDGET", "deadline_s",
           "describe_error", "filesystem", "is_transient", "is_url", "normalize", "options_for", "parse_options",
           "reset_retry_budget", "scheme", "translated", "with_retries", "zarr_store"]


def clear_url(url: str, overwrite: bool, storage_options: Mapping[str, Any] | None = None) -> None:
    """Make room for a new store at *url*: refuse, or delete an old gradforensics store there.

    The rule of a local path, on object storage: an existing prefix is replaced only
    with ``overwrite=True``, and only when it is a gradforensics store (root
    ``zarr.json`` with the ``gradforensics`` attribute, and nothing but ``zarr.json``
    files and chunk trees); anything else there is never deleted.
    """
    import json

    from gradforensics.errors import StoreExistsError

    fs, root = filesystem(url, storage_options)
    keys = translated(url, lambda: fs.find(root, withdirs=False))
    keys = [str(k)[len(root) + 1:] for k in keys if str(k).startswith(root + "/")]
    if not keys:
        return
    if not overwrite:
        raise StoreExistsError(f"{url} already exists; pass overwrite=True to replace a gradforensics store, "
                               "or choose another URL.",
                               cli=f"{url} already exists; pass --overwrite to replace a gradforensics store, "
                                   "or choose another --out.")
    problem = None
    try:
        doc = json.loads(translated(url, lambda: fs.cat_file(f"{root}/zarr.json")))
        if not isinstance(doc.get("attributes", {}).get("gradforensics"), dict):
            problem = "is a Zarr group but not a gradforensics store"
    except (FileNotFoundError, ValueError, AttributeError):
        problem = "is not a Zarr group (no readable zarr.json)"
    for k in keys:
        parts = k.split("/")
        if problem is None and parts[-1] != "zarr.json" and "c" not in parts[:-1]:
            problem = f"holds {k}, which no gradforensics store holds"
    if problem:
        raise StoreExistsError(f"{url} {problem}; refusing to delete it, even with overwrite=True. "
                               "Choose another URL, or remove it yourself.",
                               cli=f"{url} {problem}; refusing to delete it, even with --overwrite. "
                                   "Choose another --out, or remove it yourself.")
    translated(url, lambda: fs.rm([f"{root}/{k}" for k in keys]))
