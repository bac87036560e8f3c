"""``gradforensics analyze STORE --out DIR``: the forensic pass, then the report.

Threads by default; ``--workers N`` starts a local ``dask.distributed`` cluster
of N single-threaded worker processes; ``--scheduler ADDRESS`` attaches to a
running one (``tcp://host:8786`` or a scheduler file written by ``dask
scheduler --scheduler-file``, as on SLURM).  Exit 0 whatever is found; with
``--fail-on SEVERITY``, 1 when a flag reaches it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gradforensics._text import terminal
from gradforensics.errors import SpecError

__all__ = ["add_arguments", "run"]



def add_arguments(p: argparse.ArgumentParser) -> None:
    from gradforensics.commands import storage as storage_flags
    from gradforensics.reporting.severity import add_fail_on_argument

    p.add_argument("store", help="a *.zarr directory or *.h5 file written by gradforensics, or a Zarr store at an "
                                 "fsspec URL (s3://bucket/dump.zarr)")
    p.add_argument("--out", required=True, help="directory for report.html, report.md, flags.json, tables/")
    storage_flags.add_argument(p)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--scheduler", metavar="ADDRESS",
                       help="attach to a running dask scheduler: tcp://host:port or a scheduler file")
    where.add_argument("--workers", type=int, metavar="N", help="start a local cluster of N worker processes")
    p.add_argument("--only", metavar="A,B", help="run only these analyses (comma-separated)")
    p.add_argument("--slab-mb", type=float, default=None, metavar="MB",
                   help="MiB per dask chunk of gradients (peak memory ~ slab x workers)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_fail_on_argument(p)


@contextmanager
def _client(args: argparse.Namespace) -> Iterator[Any]:
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
                          dashboard_address=None) as cluster, Client(cluster) as client:
            yield client
        return
    address = args.scheduler
    try:
        if os.path.isfile(address):
            client = Client(scheduler_file=address, timeout="30s")
        else:
            client = Client(address, timeout="30s")
    except (OSError, TimeoutError) as exc:
        raise SpecError(f"--scheduler {address}: no dask scheduler answered ({exc}); expected tcp://host:port "
                        "or a scheduler file.") from exc
    with client:
        yield client


def run(args: argparse.Namespace) -> int:
    from gradforensics.analysis.engine import analyze, select_analyses
    from gradforensics.commands import storage as storage_flags
    from gradforensics.reporting import report
    from gradforensics.reporting.severity import counts_phrase, exit_code

    select_analyses(args.only, flag="--only")           # refused in the flag's words, before the store is opened
    where = storage_flags.location(args, args.store)
    options = {"engine": {"slab_bytes": int(args.slab_mb * (1 << 20))}} if args.slab_mb else None
    with _client(args) as client:
        findings = analyze(where, client=client, only=args.only, options=options, progress=not args.quiet)
    report(findings, args.out, store=where)
    if partial := findings.header.get("partial"):
        print(terminal(f"note: the store is being written by {partial['writer']}; analysed the "
                       f"{partial['n_records']} records committed so far (results not saved in the store)"),
              file=sys.stderr)
    print(terminal(f"{findings.store}: {counts_phrase(findings.flags)}; report in {args.out}"), file=sys.stderr)
    return exit_code(findings, args.fail_on, verb="analyze")

