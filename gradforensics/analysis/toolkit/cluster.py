"""Waiting on a ``dask.distributed`` cluster that may lose its workers or its scheduler mid-pass.

A scheduler whose workers are all gone keeps the pass's tasks queued for ever (new
workers may come), and a client whose scheduler died sees its futures cancelled
(``FutureCancelledError``).  Every wait of a pass on a client goes through
:func:`gather_all` / :func:`next_ready`: between short waits :class:`ClusterWatch`
asks the scheduler how many workers it has (at most once a second) and stops the
pass with one :class:`~gradforensics.errors.WorkerLostError` line (exit 2) when
there has been none for ``GRADFORENSICS_NO_WORKERS_S`` seconds (default
:data:`NO_WORKERS_S`), or at once when the scheduler cannot be reached or has
cancelled the pass's futures.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from gradforensics.errors import SpecError, WorkerLostError

__all__ = ["NO_WORKERS_S", "ClusterWatch", "gather_all", "next_ready", "no_workers_s", "on_wait", "scheduler_lost"]

#: seconds a pass waits on a scheduler that has no worker before it stops (``GRADFORENSICS_NO_WORKERS_S``)
NO_WORKERS_S = 60.0
#: seconds between two questions to the scheduler
_POLL_S = 1.0
_RESTART = ("start workers on it again and rerun, or run on threads (without --workers / --scheduler).")
#: a test hook, inert by default: called with what is being waited for each time a pass starts waiting on the cluster
#: (the tests kill the workers or the scheduler from it, mid-pass)
on_wait: Callable[[str], None] | None = None


def no_workers_s() -> float:
    """How long a pass waits on a scheduler without workers: ``GRADFORENSICS_NO_WORKERS_S``."""
    raw = os.environ.get("GRADFORENSICS_NO_WORKERS_S", "").strip()
    if not raw:
        return NO_WORKERS_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise SpecError(f"GRADFORENSICS_NO_WORKERS_S={raw!r}: expected a positive number of seconds "
                        f"(e.g. {NO_WORKERS_S:g}).")
    return value


def _address(client: Any) -> str:
    return str(getattr(getattr(client, "scheduler", None), "address", None) or "the dask scheduler")


def scheduler_lost(client: Any, what: str, exc: BaseException | None = None) -> WorkerLostError:
    """The one line for a scheduler that went away (or cancelled the pass) while running *what*."""
    text = " ".join(str(exc).split()) if exc is not None else ""
    reason = text.partition("reason: ")[2].partition(" ")[0].rstrip(".")     # FutureCancelledError's
    why = f" ({reason or f'{type(exc).__name__}: {text[:160]}'})" if text else ""
    return WorkerLostError(f"{_address(client)}: the dask scheduler went away or cancelled the work while running "
                           f"{what}{why}; restart it and its workers and rerun, or run on threads (without "
                           "--workers / --scheduler).")


class ClusterWatch:
    """Whether the cluster of *client* can still finish *what*; :meth:`check` raises when it cannot."""

    def __init__(self, client: Any, what: str, grace: float | None = None) -> None:
        self.client, self.what = client, what
        self.grace = no_workers_s() if grace is None else grace
        self.empty_since: float | None = None
        self.next_poll = 0.0

    def check(self) -> None:
        now = time.monotonic()
        if now < self.next_poll:
            return
        self.next_poll = now + _POLL_S
        if self.client.status != "running":
            raise scheduler_lost(self.client, self.what, ConnectionError(f"client {self.client.status}"))
        try:
            workers = self.client.scheduler_info(n_workers=-1).get("workers", {})
        except (OSError, TimeoutError) as exc:     # CommClosedError is an OSError
            raise scheduler_lost(self.client, self.what, exc) from None
        if workers:
            self.empty_since = None
            return
        self.empty_since = self.empty_since if self.empty_since is not None else now
        if now - self.empty_since >= self.grace:
            raise WorkerLostError(f"{_address(self.client)}: no dask worker for {now - self.empty_since:.0f} s "
                                  f"while running {self.what} (every worker left or was killed; "
                                  f"GRADFORENSICS_NO_WORKERS_S={self.grace:g}); {_RESTART}")


def gather_all(client: Any, futures: Sequence[Any], what: str) -> list[Any]:
    """``client.gather(futures)``, watching the cluster while it waits (see :class:`ClusterWatch`).

    The gather runs on a helper thread (a result lost with its worker sends it back to
    waiting); this thread checks the cluster between short waits for it.
    """
    import threading

    if on_wait is not None:
        on_wait(what)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = list(client.gather(list(futures)))
        except BaseException as exc:            # handed to the waiting thread and raised there
            box["error"] = exc

    t = threading.Thread(target=run, name="gradforensics-gather", daemon=True)
    t.start()
    watch = ClusterWatch(client, what)
    while t.is_alive():
        t.join(timeout=_POLL_S)
        if t.is_alive():
            watch.check()
    if "error" in box:
        raise box["error"]
    return box["value"]


def next_ready(done: Any, watch: ClusterWatch) -> Any:
    """The next finished future of the ``as_completed`` *done* (None when it is empty), watching the cluster."""
    if on_wait is not None:
        on_wait(watch.what)
    while not done.has_ready():
        if done.is_empty():
            return None
        watch.check()
        time.sleep(0.02)
    fut = next(done)
    if fut.status == "cancelled":
        raise scheduler_lost(watch.client, watch.what)
    return fut
