"""``--workers N`` / ``--scheduler ADDRESS``: where the dask pass of a verb that analyses stores runs.

Threads by default; ``--workers N`` starts a local ``dask.distributed`` cluster
of N single-threaded worker processes; ``--scheduler ADDRESS`` attaches to a
running one (``tcp://host:8786`` or a scheduler file written by ``dask
scheduler --scheduler-file``, as on SLURM).  The same flags, with the same
meaning, on ``analyze``, ``compare`` and ``whatif``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gradforensics.errors import SpecError

__all__ = ["add_arguments", "client"]


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--scheduler", metavar="ADDRESS",
                       help="attach to a running dask scheduler: tcp://host:port or a scheduler file")
    where.add_argument("--workers", type=int, metavar="N",
                       help="start a local cluster of N worker processes (default: threads in this process)")


@contextmanager
def client(args: argparse.Namespace) -> Iterator[Any]:
    """The distributed client the flags ask for, or None (threads)."""
    if args.scheduler is None and args.workers is None:
        yield None
        return
    from gradforensics._extras import require_extra

    require_extra("distributed", "--workers" if args.workers is not None else "--scheduler")
    from distributed import Client, LocalCluster
    if args.workers is not None:
        if args.workers < 1:
            raise SpecError(f"--workers must be >= 1; got {args.workers}.")
        with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                          dashboard_address=":0") as cluster, Client(cluster) as c:
            yield c
        return
    address = args.scheduler
    try:
        c = Client(scheduler_file=address, timeout="30s") if os.path.isfile(address) else Client(address, timeout="30s")
    except (OSError, TimeoutError) as exc:
        raise SpecError(f"--scheduler {address}: no dask scheduler answered ({exc}); expected tcp://host:port "
                        "or a scheduler file.") from exc
    try:
        yield c
    finally:
        _close(c)


def _close(c: Any) -> None:
    """Close the client; one whose scheduler went away quietly (its reconnect loop logs tracebacks as it stops)."""
    import logging
    from concurrent.futures import CancelledError

    if c.status == "running":
        c.close()
        return
    log = logging.getLogger("distributed.client")
    was = log.disabled
    log.disabled = True
    try:
        c.close(timeout=10)
    except (OSError, TimeoutError, CancelledError):
        pass
    finally:
        log.disabled = was
