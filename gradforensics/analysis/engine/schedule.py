"""Where the pass runs: one ``dask.compute`` of its collections, on a client or the local threads.

:func:`compute_collections` computes every collection of a pass at once (BLAS pinned to one
thread per worker thread); :func:`default_client` is the client dask would use anyway;
:func:`units_client` is where the per-unit statistics go under a client.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from gradforensics.analysis.engine.options import EngineOptions
from gradforensics.analysis.toolkit.cluster import ClusterWatch, gather_all, next_ready, scheduler_lost
from gradforensics.analysis.toolkit.parallel import worker_lost, workers_add_cores

if TYPE_CHECKING:
    from distributed import Client

    from gradforensics.analysis.engine.spill import GramSpill

__all__ = ["compute_collections", "default_client", "units_client"]


def compute_collections(collections: list[Any], client: Client | None, progress: bool, num_workers: int | None,
                        arrive: Mapping[int, GramSpill] | None = None) -> list[Any]:
    """One compute of all *collections*, on *client* or the local scheduler.

    Under a client, the results of the collections in *arrive* are handed to their
    spill as each comes back (one at a time), never gathered all together.
    """
    import dask

    # dask 2026.8 (dask.compute and Client.compute alike) returns the results of mixed
    # Array / Delayed collections grouped by type, not in the order given, when it
    # optimizes the graph; keep the order by not optimizing a mixed list.
    optimize = len({type(c) for c in collections}) <= 1
    # Delayed graphs (the Gram and slab passes) are built with exactly the tasks they need:
    # culling thousands of their layers cost more than running a small store's pass.
    from dask.delayed import Delayed

    if all(isinstance(c, Delayed) for c in collections):
        optimize = False
    if client is not None:
        client.run(_pin_blas)
        futures = client.compute(collections, optimize_graph=optimize)
        if progress:                           # drawn beside the wait: it blocks until every task is done
            import threading

            from distributed import progress as dprogress

            threading.Thread(target=dprogress, args=(futures,), name="gradforensics-progress", daemon=True).start()
        from concurrent.futures import CancelledError

        from distributed.scheduler import KilledWorker

        try:
            if arrive:
                return _gather_spilling(client, futures, arrive)
            return gather_all(client, futures, "the Gram pass")    # a cluster that lost its workers: one line
        except KilledWorker as exc:            # killed past its memory limit, say: one line, not dask's traceback
            raise worker_lost(exc, "the Gram pass") from None
        except CancelledError as exc:          # FutureCancelledError: the scheduler went away
            raise scheduler_lost(client, "the Gram pass", exc) from None
    from threadpoolctl import threadpool_limits

    kwargs: dict[str, Any] = {}
    if dask.config.get("scheduler", None) is None:
        # the threaded scheduler itself, not its name: dask looks a name up only after importing
        # distributed to ask for a client (0.4-0.5 s), and default_client found none
        from dask.threaded import get as threaded_get

        kwargs["scheduler"] = threaded_get
        if num_workers:
            kwargs["num_workers"] = int(num_workers)
    with threadpool_limits(limits=1), _progress_bar(progress):
        return list(dask.compute(*collections, optimize_graph=optimize, **kwargs))


def _gather_spilling(client: Client, futures: list[Any], arrive: Mapping[int, GramSpill]) -> list[Any]:
    """The values of *futures* as they complete; those in *arrive* written to their spill first."""
    from distributed import as_completed

    at: dict[str, list[int]] = {}
    for i, f in enumerate(futures):
        at.setdefault(f.key, []).append(i)
    values: list[Any] = [None] * len(futures)
    done, watch = as_completed(futures), ClusterWatch(client, "the Gram pass")
    while (fut := next_ready(done, watch)) is not None:
        val = fut.result()
        for i in at.pop(fut.key, []):
            values[i] = arrive[i].arrive(i, val) if i in arrive else val
            futures[i] = None          # the worker may drop it now
        del fut, val
    return values


def _progress_bar(progress: bool) -> AbstractContextManager[Any]:
    if not progress:
        return nullcontext()
    from dask.diagnostics import ProgressBar

    return ProgressBar(minimum=1.0, out=sys.stderr)


def units_client(engine: EngineOptions, client: Client | None) -> Client | None:
    """The client :func:`map_units` ships the per-unit statistics to, or None (the client's threads)."""
    if client is None or engine.unit_statistics == "client":
        return None
    return client if engine.unit_statistics == "workers" or workers_add_cores(client) else None


def default_client() -> Client | None:
    """The client dask would use anyway (one set as default), if distributed is loaded.

    A ``Client`` made the default sets dask's ``scheduler`` to ``"dask.distributed"``; any
    other scheduler set in dask's config (``"synchronous"``, ``"threads"``, a callable) is
    respected: no client then.
    """
    import dask

    if "distributed" not in sys.modules or dask.config.get("scheduler", None) not in (None, "dask.distributed",
                                                                                       "distributed"):
        return None
    from distributed import default_client

    try:
        return default_client()
    except ValueError:
        return None


def _pin_blas() -> None:
    """One BLAS thread per worker thread (runs on each distributed worker)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1)
