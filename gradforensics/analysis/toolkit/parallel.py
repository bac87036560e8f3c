"""The per-unit statistics of the post-pass analyses, on several threads or on a cluster's workers.

After the Gram pass, drift, oscillation and conflict compute their statistics unit
by unit (a tensor, or one head of it): on a store shaped like a real model that is
hundreds to thousands of independent, mostly-BLAS computations.  :func:`map_units`
runs one analysis's per-unit function over its units on the threads the engine
grants (:func:`unit_threads`: the pass's ``num_workers``, else the machine's cores),
results in the units' order: every statistic is the one the serial loop computes
(each unit's permutations are seeded by its own name).  Outside
:func:`unit_threads` (an analysis called directly, a test), it is the serial loop.

When the pass ran on a ``dask.distributed`` client (``--workers``, ``--scheduler``),
:func:`unit_threads` is given it and :func:`map_units` runs on its workers instead:
the units are built on the client (a spilled pass reads each Gram matrix from its
file there), shipped in batches of at most :data:`BATCH_BYTES` of Gram matrices and
:data:`BATCH_UNITS` units, one task a batch, at most two batches a worker thread in flight,
and the results are gathered in the units' order.  The arrays travel with the tasks:
the workers need no file system shared with the client.  The function must pickle
(a module-level function, or a :func:`functools.partial` of one over small, frozen
arguments) and runs with one BLAS thread, as on the threads: the same statistics.
A worker that dies (killed for memory, say) or runs out of memory stops the
analysis with one :class:`~gradforensics.errors.WorkerLostError` line naming the units;
an error the function raises is raised as it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import Any, TypeVar

from gradforensics.errors import WorkerLostError

__all__ = ["BATCH_BYTES", "BATCH_UNITS", "SLAB_UNITS", "available_cores", "map_slabs", "map_units",
           "release_freed_memory", "unit_threads", "worker_batches", "worker_lost", "workers_add_cores"]

T = TypeVar("T")
R = TypeVar("R")

_THREADS: ContextVar[int] = ContextVar("gradforensics_unit_threads", default=1)
_CLIENT: ContextVar[Any] = ContextVar("gradforensics_unit_client", default=None)

BATCH_BYTES = 8 * 2**20
"""Bytes of Gram matrices (``item.gram``) one task of :func:`map_units` carries to a worker, at most
(a batch travels inside its task; dask warns about graphs above 10 MB)."""
BATCH_UNITS = 32
"""Units one task of :func:`map_units` carries to a worker, at most."""


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the platform tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:        # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


@contextmanager
def unit_threads(n: int | None, client: Any = None) -> Iterator[int]:
    """Within the block, :func:`map_units` uses *n* threads (None: :func:`available_cores`), BLAS one each,
    or - given a ``distributed.Client`` - that client's workers."""
    threads = max(1, int(n) if n is not None else available_cores())
    token, on = _THREADS.set(threads), _CLIENT.set(client)
    try:
        if threads > 1:
            from threadpoolctl import threadpool_limits

            with threadpool_limits(limits=1):       # n threads x 1 BLAS thread, not n x cores
                yield threads
        else:
            yield threads
    finally:
        _THREADS.reset(token)
        _CLIENT.reset(on)


def map_units(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(x) for x in items]``, on the threads or the workers of :func:`unit_threads`; the first error is raised.

    A :class:`~collections.abc.Sequence` (such as :func:`~gradforensics.analysis.toolkit.units.units`,
    which reads each unit's Gram matrix when it is taken) is indexed in the thread that
    runs ``fn`` (on a client: as its batch is shipped), so only the items in work are built at once.

    Raises
    ------
    WorkerLostError
        On a client: a worker died, or ran out of memory, running a batch.
    """
    todo: Sequence[T] = items if isinstance(items, Sequence) else list(items)
    client = _CLIENT.get()
    if client is not None and len(todo):
        return _on_workers(client, fn, todo)
    threads = min(_THREADS.get(), len(todo))
    if threads <= 1:
        return [fn(x) for x in todo]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gradforensics-unit") as pool:
        return list(pool.map(lambda i: fn(todo[i]), range(len(todo))))


SLAB_UNITS = 64
"""Units one call of :func:`map_slabs`'s function gets (the last slab may hold fewer)."""


class _Slabs(Sequence[list[T]]):
    """Consecutive slabs of *todo*, each built (its items taken from *todo*) when it is indexed."""

    def __init__(self, todo: Sequence[T], size: int) -> None:
        self._todo, self._size = todo, size

    def __len__(self) -> int:
        return -(-len(self._todo) // self._size)

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        if not 0 <= i < len(self):
            raise IndexError(i)
        return [self._todo[j] for j in range(i * self._size, min(len(self._todo), (i + 1) * self._size))]


def map_slabs(fn: Callable[[list[T]], list[R]], items: Iterable[T], size: int = SLAB_UNITS) -> list[R]:
    """:func:`map_units` over slabs of at most *size* consecutive items: ``fn(slab)`` returns one result per item
    of its slab, in order; the results of all slabs, in the items' order.

    For per-unit statistics that stack the same small calls over the units of a slab
    (one call where there were *size*); each slab is built in the thread that runs it.
    """
    todo: Sequence[T] = items if isinstance(items, Sequence) else list(items)
    out: list[R] = []
    for part in map_units(fn, _Slabs(todo, max(1, int(size)))):
        out.extend(part)
    if len(out) != len(todo):
        raise RuntimeError(f"map_slabs: {len(out)} results for {len(todo)} items")
    return out


def release_freed_memory() -> None:
    """Hand the memory the unit threads have freed back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    Each thread allocates from its own malloc arena, and what is freed there stays in the arena: after the
    threads of :func:`map_slabs`, the process keeps hundreds of MB it no longer uses, which the next phase,
    on the main thread, does not reuse (conflict on 200 sources x 400 records: 532 MB resident after its
    slabs, 245 MB once trimmed; docs/conflict.md, "Memory").
    """
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)


# ------------------------------------------------------------------ on a cluster
def workers_add_cores(client: Any) -> bool:
    """Whether *client*'s workers bring cores this process lacks: a worker on another host, or more worker
    threads in all than :func:`available_cores`.

    Workers on this machine alone (``--workers N`` here) share its cores with the client:
    shipping the units to them adds the pickling and the scheduler's traffic and no core
    (measured on 2 cores: 2x the CPU, 1.2-1.8x the wall of the client's threads).
    """
    import socket

    workers = client.scheduler_info().get("workers", {})
    if not workers:
        return False
    here = {"127.0.0.1", "localhost", "::1", socket.gethostname()}
    with suppress(OSError):
        here |= {str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None)}
    hosts = {str(w.get("host") or addr.split("://")[-1].rsplit(":", 1)[0]) for addr, w in workers.items()}
    threads = sum(int(w.get("nthreads", 1)) for w in workers.values())
    return bool(hosts - here) or threads > available_cores()


def _run_batch(fn: Callable[[T], R], batch: list[T]) -> list[R]:
    """One task on a worker: *fn* over its *batch*, with one BLAS thread (as on the threads)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        return [fn(x) for x in batch]


def worker_batches(todo: Sequence[T]) -> Iterator[tuple[int, list[T]]]:
    """``(start, items)``: consecutive items, at most :data:`BATCH_UNITS` of them and :data:`BATCH_BYTES` of Gram
    matrices (a batch holds at least one item), each built when its batch is."""
    start, size = 0, 0
    batch: list[T] = []
    for i in range(len(todo)):
        x = todo[i]
        nbytes = _nbytes(x)
        if batch and (len(batch) >= BATCH_UNITS or size + nbytes > BATCH_BYTES):
            yield start, batch
            start, size, batch = i, 0, []
        batch.append(x)
        size += nbytes
    if batch:
        yield start, batch


def _nbytes(x: Any) -> int:
    """Bytes of Gram matrices an item carries (a slab of :func:`map_slabs`: its units')."""
    if isinstance(x, list):
        return sum(_nbytes(y) for y in x)
    return int(getattr(getattr(x, "gram", None), "nbytes", 0))


def _where(batch: Sequence[Any]) -> str:
    batch = [y for x in batch for y in (x if isinstance(x, list) else [x])]        # slabs: their units
    names = [x.where() if callable(getattr(x, "where", None)) else repr(x)[:60] for x in (batch[0], batch[-1])]
    return names[0] if len(batch) == 1 else f"{len(batch)} units, {names[0]} to {names[1]}"


def _on_workers(client: Any, fn: Callable[[T], R], todo: Sequence[T]) -> list[R]:
    """:func:`map_units` on *client*'s workers: batches shipped as they are built, results in order.

    A batch travels inside its task (not scattered ahead): a task whose worker dies is
    run again elsewhere (the scheduler's ``allowed-failures``) from what it carries.
    """
    from concurrent.futures import CancelledError

    from distributed import as_completed
    from distributed.scheduler import KilledWorker

    from gradforensics.analysis.toolkit.cluster import ClusterWatch, next_ready, scheduler_lost

    slots = max(1, sum(client.nthreads().values()))         # threads of every worker
    out: list[Any] = [None] * len(todo)
    at: dict[str, tuple[int, str]] = {}
    done = as_completed()
    batches = worker_batches(todo)

    def ship() -> None:
        nxt = next(batches, None)
        if nxt is not None:
            start, batch = nxt
            fut = client.submit(_run_batch, fn, batch, pure=False)
            at[fut.key] = (start, _where(batch))
            done.add(fut)

    for _ in range(2 * slots):          # two batches a worker thread in flight: the client holds that many
        ship()
    watch = ClusterWatch(client, "the per-unit statistics")
    try:
        while (fut := next_ready(done, watch)) is not None:
            start, where = at.pop(fut.key)
            try:
                res = fut.result()
            except KilledWorker as exc:
                raise worker_lost(exc, f"the per-unit statistics of {where}") from None
            except CancelledError as exc:            # FutureCancelledError: the scheduler went away
                raise scheduler_lost(client, f"the per-unit statistics of {where}", exc) from None
            except MemoryError:
                raise WorkerLostError(f"a dask worker ran out of memory running the per-unit statistics of {where}; "
                                      f"{_ADVICE}") from None
            out[start:start + len(res)] = res
            del fut, res
            ship()
    finally:
        if done.futures and client.status == "running":
            with suppress(OSError, TimeoutError):
                client.cancel(list(done.futures))
    return out


_ADVICE = ("give the workers more memory (fewer of them, or a larger memory limit), or run on threads "
           "(without --workers / --scheduler).")


def worker_lost(exc: Any, what: str) -> WorkerLostError:
    """The one-line :class:`WorkerLostError` for dask's ``KilledWorker`` *exc*, raised while running *what*."""
    last = getattr(exc.last_worker, "address", exc.last_worker)
    return WorkerLostError(f"a dask worker died running {what} ({exc.allowed_failures + 1} attempts, the last on "
                           f"{last}; its log says why); {_ADVICE}")
