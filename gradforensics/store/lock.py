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
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Any

from gradforensics.errors import StoreLockedError

#: Seconds without a heartbeat after which a lock that cannot be checked by flock is stale.
LEASE_SECONDS = 900.0
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def lock_path(store_path: str) -> str:
    """The sidecar lock file of the store at *store_path*."""
    return os.path.normpath(os.path.abspath(store_path)) + ".lock"


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock, as written in the lock file."""

    host: str
    pid: int
    started: float
    lease_s: float

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        try:
            d = json.loads(raw.decode())
            return cls(str(d["host"]), int(d["pid"]), float(d["started"]), float(d["lease_s"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}, since {since}"

    def alive_here(self) -> bool:
        """False when the holder ran on this host and its pid is gone."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class StoreLock:
    """The exclusive writer lock of one store; ``acquire()`` or :class:`StoreLockedError`."""

    def __init__(self, store_path: str, lease_s: float = LEASE_SECONDS) -> None:
        self.store_path = store_path
        self.path = lock_path(store_path)
        self.lease_s = lease_s
        self._fd: int | None = None

    def acquire(self) -> StoreLock:
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
                              "its records in flight were lost, committed records are kept.", stacklevel=4)
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
               "store": os.path.basename(self.store_path)}
        data = json.dumps(doc).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def heartbeat(self) -> None:
        """Touch the lock file (the lease clock for file systems without flock)."""
        if self._fd is not None:
            os.utime(self._fd)

    def release(self) -> None:
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
