"""Who holds a store's lock, as its lock file says: the holder record both lock kinds share.

:mod:`gradforensics.store.lock` (a local sidecar file, flock) and
:mod:`gradforensics.store.remote_lock` (an object on a remote store, a lease and fencing token)
write and read the same holder record.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

__all__ = ["LEASE_SECONDS", "WRITING", "Holder"]

#: Seconds without a heartbeat after which a lock that cannot be checked by flock is stale
#: (``GRADFORENSICS_LOCK_LEASE_S`` sets it: shorter for writers that must fail over quickly).
LEASE_SECONDS = float(os.environ.get("GRADFORENSICS_LOCK_LEASE_S", "900"))
#: what a lock's holder may be writing (said when a stale lock is taken over)
WRITING = ("records", "analysis results")



@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock, as written in the lock file."""

    host: str
    pid: int
    started: float
    lease_s: float
    #: what the holder was writing: ``"records"`` (a capture) or ``"analysis results"`` (an analyze)
    writing: str = "records"

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        try:
            d = json.loads(raw.decode())
            writing = d.get("writing", "records")
            return cls(str(d["host"]), int(d["pid"]), float(d["started"]), float(d["lease_s"]),
                       writing if writing in WRITING else "records")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError):
            return None

    def lost(self) -> str:
        """What a takeover of this holder's lock cost, in words."""
        if self.writing == "analysis results":
            return "its unfinished analysis results are discarded, the committed ones are kept"
        return "its records in flight were lost, committed records are kept"

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
