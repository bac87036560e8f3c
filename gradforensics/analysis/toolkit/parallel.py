"""The per-unit statistics of the post-pass analyses, on several threads.

After the Gram pass, drift, oscillation and conflict compute their statistics unit
by unit (a tensor, or one head of it): on a store shaped like a real model that is
hundreds to thousands of independent, mostly-BLAS computations.  :func:`map_units`
runs one analysis's per-unit function over its units on the threads the engine
grants (:func:`unit_threads`: the pass's ``num_workers``, else the machine's cores),
results in the units' order: every statistic is the one the serial loop computes,
bit for bit (each unit's permutations are seeded by its own name).  Outside
:func:`unit_threads` (an analysis called directly, a test), it is the serial loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

__all__ = ["available_cores", "map_units", "unit_threads"]

T = TypeVar("T")
R = TypeVar("R")

_THREADS: ContextVar[int] = ContextVar("gradforensics_unit_threads", default=1)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the platform tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:        # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


@contextmanager
def unit_threads(n: int | None) -> Iterator[int]:
    """Within the block, :func:`map_units` uses *n* threads (None: :func:`available_cores`), BLAS one each."""
    threads = max(1, int(n) if n is not None else available_cores())
    token = _THREADS.set(threads)
    try:
        if threads > 1:
            from threadpoolctl import threadpool_limits

            with threadpool_limits(limits=1):       # n threads x 1 BLAS thread, not n x cores
                yield threads
        else:
            yield threads
    finally:
        _THREADS.reset(token)


def map_units(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(x) for x in items]``, on the threads of :func:`unit_threads`; the first error is raised.

    A :class:`~collections.abc.Sequence` (such as :func:`~gradforensics.analysis.toolkit.units.units`,
    which reads each unit's Gram matrix when it is taken) is indexed in the thread that
    runs ``fn``, so only the items in work are built at once.
    """
    todo: Sequence[T] = items if isinstance(items, Sequence) else list(items)
    threads = min(_THREADS.get(), len(todo))
    if threads <= 1:
        return [fn(x) for x in todo]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gradforensics-unit") as pool:
        return list(pool.map(lambda i: fn(todo[i]), range(len(todo))))
