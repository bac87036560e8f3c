"""The writer lock of a store at a URL: the object ``<store>.lock``, held by lease (:mod:`gradforensics.store.lock`)."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

from gradforensics.errors import StoreLockedError
from gradforensics.store import remote
from gradforensics.store.holder import LEASE_SECONDS, Holder
from gradforensics.store.location import Location

__all__ = ["RemoteLock"]


class RemoteLock:
    """The writer lock of a store at a URL: the object ``<store>.lock``, held by lease.

    The object holds the holder's JSON (host, pid, start, lease, a random token,
    and ``heartbeat``, the holder's clock at its last heartbeat).  It is created
    with a conditional write (``mode="create"``: S3 ``If-None-Match: *``), so only
    one writer can create it; a file system without conditional writes falls back
    to write-then-read-back of the token (a race window of one round trip).
    """

    def __init__(self, store_url: str | Location, lease_s: float = LEASE_SECONDS,
                 storage_options: Mapping[str, Any] | None = None, *, writing: str = "records") -> None:
        self.writing = writing
        if isinstance(store_url, Location):
            storage_options = {**store_url.storage_options, **(storage_options or {})}
            store_url = store_url.path
        self.store_url = remote.normalize(store_url)
        self.url = self.store_url + ".lock"
        self.lease_s = lease_s
        self._fs, self._path = remote.filesystem(self.url, storage_options)
        self._token: str | None = None
        #: fencing token: one more than the lock this writer took over (0 for a fresh lock)
        self._fence = 0
        self._started = 0.0
        self._beat = 0.0

    def _doc(self) -> bytes:
        now = time.time()
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": self._started,
                           "lease_s": self.lease_s, "heartbeat": now, "token": self._token,
                           "fence": self._fence, "store": self.store_url.rsplit("/", 1)[-1],
                           "writing": self.writing}).encode()

    def _read(self) -> dict[str, Any] | None:
        try:
            raw = remote.translated(self.store_url, lambda: self._fs.cat_file(self._path),
                                    op="reading the lock object")
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw.decode())
        except (ValueError, UnicodeDecodeError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def _create(self) -> bool:
        """Create the lock object if absent; True when this call created it."""
        data = self._doc()
        if remote.scheme(self.url) == "file":       # a local file system has directories to make first
            self._fs.makedirs(self._path.rsplit("/", 1)[0], exist_ok=True)
        try:
            remote.translated(self.store_url, lambda: self._fs.pipe_file(self._path, data, mode="create"),
                              op="creating the lock object")
            return True
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError):   # no conditional write here: write, then read back
            if self._fs.exists(self._path):
                return False
            self._fs.pipe_file(self._path, data)
            got = self._read()
            return got is not None and got.get("token") == self._token

    def acquire(self) -> RemoteLock:
        self._token = uuid.uuid4().hex
        self._started = time.time()
        for _ in range(5):
            if self._create():
                self._beat = time.time()
                return self
            doc = self._read()
            if doc is None:
                continue                  # released between our create and read: try again
            if doc.get("token") == self._token:
                self._beat = time.time()  # our own create, whose response was lost: a retry saw it exist
                return self
            holder = Holder.parse(json.dumps(doc).encode())
            if holder is not None and not self._stale(holder, doc):
                raise StoreLockedError(
                    f"{self.store_url} is being written by another process ({holder.describe()}; lock object "
                    f"{self.url}); one writer per store: wait for it, or write to another URL.")
            fence = doc.get("fence")
            self._fence = (fence if isinstance(fence, int) and not isinstance(fence, bool) and fence >= 0 else 0) + 1
            remote.translated(self.store_url, lambda: self._fs.rm_file(self._path), op="deleting the lock object")
            who = holder.describe() if holder else "an unreadable holder"
            lost = holder.lost() if holder else Holder("", 0, 0.0, 0.0).lost()
            warnings.warn(f"{self.store_url}: took over a stale writer lock ({who}); {lost}.", stacklevel=5)
        raise StoreLockedError(f"{self.store_url}: the lock object {self.url} keeps being replaced; another writer "
                               "is starting here.")

    def live_holder(self) -> Holder | None:
        """The holder the lock object names while its lease runs (None: no lock object, or a stale one)."""
        doc = self._read()
        if not doc:
            return None
        holder = Holder.parse(json.dumps(doc).encode())
        return holder if holder is not None and not self._stale(holder, doc) else None

    def _stale(self, holder: Holder, doc: dict[str, Any]) -> bool:
        beat = doc.get("heartbeat", holder.started)
        age = time.time() - (float(beat) if isinstance(beat, (int, float)) else holder.started)
        return not holder.alive_here() or age > holder.lease_s

    def check(self) -> dict[str, Any]:
        """Read the lock object; :class:`StoreLockedError` unless it still holds this writer's token.

        Called before every flush writes a chunk and again right before its commit: a
        writer whose lease ran out and whose lock was taken over stops there, before it
        writes a byte into the new owner's store.  A writer frozen *inside* a flush, past
        its lease, is stopped by its PUTs themselves on ``s3://``: each is conditional on
        the object being what this writer last left there (:mod:`gradforensics.store.fenced`),
        and a failed condition calls this check.
        """
        doc = self._read()
        if self._token is None or not doc or doc.get("token") != self._token:
            raise StoreLockedError(f"{self.store_url}: this writer's lock object {self.url} was taken over "
                                   "(its lease ran out); stop writing: another writer owns the store now.")
        return doc

    def heartbeat(self) -> None:
        """Rewrite the heartbeat (at most every tenth of the lease), if the lock is still ours."""
        if self._token is None or time.time() - self._beat < self.lease_s / 10:
            return
        self.check()
        data = self._doc()
        remote.translated(self.store_url, lambda: self._fs.pipe_file(self._path, data),
                          op="writing the lock object")
        self._beat = time.time()

    def release(self) -> None:
        if self._token is None:
            return
        token, self._token = self._token, None
        doc = self._read()
        if doc and doc.get("token") == token:
            remote.translated(self.store_url, lambda: self._fs.rm_file(self._path), op="deleting the lock object")
