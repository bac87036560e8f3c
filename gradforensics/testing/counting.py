"""``CountingScheduler``: a dask scheduler that counts the computes it runs.

The design's "one pass over the bytes" is a countable claim: a forensic pass calls
``dask.compute`` once (:mod:`gradforensics.analysis.engine.run`), so every gradient,
activation and weight byte is read by one graph.  Set the counter as dask's scheduler
and every compute in the block goes through it - ``dask.compute``, ``.compute()``,
``np.asarray`` of a dask array, a compute nested inside a task - and is counted::

    import dask
    from gradforensics.testing import CountingScheduler

    counter = CountingScheduler()
    with dask.config.set(scheduler=counter):
        gf.analyze(path, progress=False)
    assert counter.calls == 1

(``with counter.counting(): ...`` does the same.)  The graphs still run, on dask's
threaded scheduler by default (or the ``get`` given, e.g. ``dask.local.get_sync``).
Under a ``dask.distributed`` client the client schedules, not this: count with the
local schedulers only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = ["CountingScheduler"]


class CountingScheduler:
    """A dask ``get`` that counts its calls and the tasks of each graph, then runs the graph.

    Parameters
    ----------
    get
        The scheduler that runs the graphs (default: ``dask.threaded.get``).

    Attributes
    ----------
    calls
        How many computes ran through it.
    graph_sizes
        The number of tasks of each computed graph, in call order.
    """

    def __init__(self, get: Callable[..., Any] | None = None) -> None:
        self._get = get
        self._lock = threading.Lock()
        self.calls = 0
        self.graph_sizes: list[int] = []

    def __call__(self, dsk: Mapping[Any, Any], keys: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls += 1
            try:
                self.graph_sizes.append(len(dsk))
            except TypeError:                   # a graph without a length: count the call alone
                self.graph_sizes.append(-1)
        get = self._get
        if get is None:
            import dask.threaded

            get = dask.threaded.get
        return get(dsk, keys, **kwargs)

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self.calls = 0
            self.graph_sizes = []

    @contextmanager
    def counting(self) -> Iterator[CountingScheduler]:
        """``with counter.counting(): ...``: dask's scheduler inside the block (``dask.config.set(scheduler=self)``)."""
        import dask

        with dask.config.set(scheduler=self):
            yield self

    def __repr__(self) -> str:
        return f"CountingScheduler(calls={self.calls})"
