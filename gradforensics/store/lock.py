"""One writer per store: a sidecar lock file ``<store>.lock``.

The lock is an exclusive ``flock`` held on ``<store>.lock`` for the writer's
lifetime, and the file names its holder (host, pid, start, lease).  The kernel
drops the ``flock`` when the holder dies, however it dies, so a lock file that
can be locked again is *stale*: the next writer takes it over with a warning
naming the old holder.  Where the file system has no working ``flock`` (some
network file systems), the file's content decides instead: a holder on this host
whose pid is gone, or any holder whose heartbeat (the file's modification time,
touched at every commit) is older than its lease, is stale.

Readers never take the lock.  The lock is a sidecar rather than a file inside the
store so that creating it is atomic before the store exists, and so that a store
copied elsewhere never carries a lock with it.

For a store at a URL (``s3://bucket/dump.zarr``) the lock is the object
``<store>.lock`` (:class:`~gradforensics.store.remote_lock.RemoteLock`), created with a conditional write (S3
``PUT`` with ``If-None-Match: *``; moto 5.2.5 honours it, measured in
``tests/test_remote_stores.py``): of two writers starting at once, exactly one
creates it.  Object storage has no ``flock`` and no pids of other hosts, so the
lease decides: the holder rewrites the object's heartbeat while it writes, and
a lock whose heartbeat is older than its lease (or whose holder ran on this
host and is gone) is stale and taken over with a warning.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
import warnings
from collections.abc import Mapping
from typing import Any

from gradforensics.errors import StoreLockedError
from gradforensics.store import remote
from gradforensics.store.holder import LEASE_SECONDS, Holder
from gradforensics.store.location import Location

__all__ = ["StoreLock", "current_writer", "lock_path"]


_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
def lock_path(store_path: str) -> str:
    """The sidecar lock file of the store at *store_path*."""
    return os.path.normpath(os.path.abspath(store_path)) + ".lock"


def current_writer(store: str | Location, storage_options: Mapping[str, Any] | None = None) -> Holder | None:
    """The live writer of the store at *store* (path, URL or :class:`Location`), or None.

    Read without taking the lock and without changing it: a local lock file is
    opened read-only, and only when it names a holder that may be alive (another
    host, or a live pid here) is its ``flock`` probed, with a shared non-blocking
    ``flock`` on a separate descriptor released at once.  A lock nobody holds (its
    writer died) is stale: None.  Where ``flock`` does not work the lease decides,
    as for a writer (the holder's pid, the file's heartbeat).  A lock object at a
    URL is live while its heartbeat is within its lease.  A lock that cannot be
    read at all is reported as no writer: readers never fail on it.
    """
    if isinstance(store, Location):
        storage_options = {**store.storage_options, **(storage_options or {})}
        store = store.path
    try:
        if remote.is_url(store):
            from gradforensics.store.remote_lock import RemoteLock

            return RemoteLock(store, storage_options=storage_options).live_holder()
        return _local_writer(lock_path(store))
    except Exception:   # a reader's courtesy line: an unreadable lock is no writer
        return None


def _local_writer(path: str) -> Holder | None:
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, 4096, 0)
        holder = Holder.parse(raw) if raw else None
        if holder is not None and not holder.alive_here():
            return None                     # its pid is gone: stale, whatever the flock says
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder or Holder("?", 0, os.fstat(fd).st_mtime, LEASE_SECONDS)
        except OSError as exc:
            if exc.errno not in _NO_FLOCK or holder is None:
                return None
            return holder if time.time() - os.fstat(fd).st_mtime < holder.lease_s else None
        fcntl.flock(fd, fcntl.LOCK_UN)      # nobody holds it: a stale lock file
        return None
    finally:
        os.close(fd)                        # closing drops any flock of this descriptor


class StoreLock:
    """The exclusive writer lock of one store; ``acquire()`` or :class:`StoreLockedError`."""

    def __init__(self, store_path: str | Location, lease_s: float = LEASE_SECONDS,
                 storage_options: Mapping[str, Any] | None = None, *, writing: str = "records") -> None:
        if isinstance(store_path, Location):     # the store's own options reach its lock
            storage_options = {**store_path.storage_options, **(storage_options or {})}
            store_path = store_path.path
        self.store_path = store_path
        self.lease_s = lease_s
        self.writing = writing
        self._fd: int | None = None
        from gradforensics.store.remote_lock import RemoteLock

        self._remote = RemoteLock(store_path, lease_s, storage_options, writing=writing) \
            if remote.is_url(store_path) else None
        self.path = self._remote.url if self._remote else lock_path(store_path)

    def acquire(self) -> StoreLock:
        if self._remote is not None:
            self._remote.acquire()
            return self
        for _ in range(10):   # retried only when the file was replaced under us
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                old = self._take(fd)
            except BaseException:
                os.close(fd)
                raise
            if old is _REPLACED:
                os.close(fd)
                continue
            self._fd = fd
            self._write_holder()
            if isinstance(old, Holder):
                warnings.warn(f"{self.store_path}: took over a stale writer lock ({old.describe()}); "
                              f"{old.lost()}.", stacklevel=4)
            return self
        raise StoreLockedError(f"{self.store_path}: the lock file {self.path} keeps being replaced; "
                               "another writer is starting here.")

    def _take(self, fd: int) -> Holder | object | None:
        """Lock *fd*; return the stale holder (or None when the file was fresh)."""
        import fcntl

        raw = os.pread(fd, 4096, 0)
        holder = Holder.parse(raw) if raw else None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._locked(holder) from None
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
            if holder is not None and self._live_without_flock(fd, holder):
                raise self._locked(holder) from None
        try:
            if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                return _REPLACED
        except FileNotFoundError:
            return _REPLACED
        raw = os.pread(fd, 4096, 0)     # re-read: a holder may have released it between the reads
        return Holder.parse(raw) if raw else None

    def _live_without_flock(self, fd: int, holder: Holder) -> bool:
        age = time.time() - os.fstat(fd).st_mtime
        return holder.alive_here() and age < holder.lease_s

    def _locked(self, holder: Holder | None) -> StoreLockedError:
        who = holder.describe() if holder else "a writer that has not yet named itself"
        return StoreLockedError(
            f"{self.store_path} is being written by another process ({who}; lock file {self.path}); "
            "one writer per store: wait for it, or write to another path."
        )

    def _write_holder(self) -> None:
        assert self._fd is not None
        doc = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "lease_s": self.lease_s,
               "store": os.path.basename(self.store_path), "writing": self.writing}
        data = json.dumps(doc).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def check(self) -> None:
        """:class:`StoreLockedError` if this writer no longer owns the store (a lock at a URL was taken over).

        A local lock is an ``flock`` held for the writer's whole life: nothing can take it over.
        """
        if self._remote is not None:
            self._remote.check()

    def heartbeat(self) -> None:
        """Touch the lock file (the lease clock for file systems without flock)."""
        if self._remote is not None:
            self._remote.heartbeat()
        if self._fd is not None:
            os.utime(self._fd)

    def release(self) -> None:
        if self._remote is not None:
            self._remote.release()
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                os.unlink(self.path)
        finally:
            os.close(fd)   # closing drops the flock

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


_REPLACED = object()
