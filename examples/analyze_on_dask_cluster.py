"""Run the forensic pass on an existing dask.distributed scheduler (copy and adapt).

On a real cluster the scheduler is already running (``dask scheduler`` on a head
node, or a Kubernetes/SLURM deployment) and you only need its address::

    gradforensics analyze dump.zarr --out report/ --scheduler tcp://head-node:8786

or, from Python, ``gf.analyze(path, client=Client(address))`` as below.  The
store must be on storage every worker can read (a shared filesystem).

Runs as-is: a ``LocalCluster`` of worker processes stands in for the cluster,
and without ``--store`` a small store with a planted data-source conflict is
written first.  Usage::

    python examples/analyze_on_dask_cluster.py [--store PATH] [--out DIR] [--workers N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import gradforensics as gf


def example_store(path: Path) -> Path:
    """A small store with known trouble (zh and en conflict in layers 1-2)."""
    from gradforensics.testing.planted_directions import planted_conflict

    planted_conflict(seed=0, n=96).write(path)
    return path


def main(argv: list[str] | None = None) -> Path:
    from distributed import Client, LocalCluster

    p = argparse.ArgumentParser(description="Analyze a store on a dask.distributed cluster.")
    p.add_argument("--store", default=None, help="*.zarr or *.h5 store (default: write a small planted one)")
    p.add_argument("--out", default=None, help="report directory (default: a temporary one)")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="gf-dask-"))
    out.mkdir(parents=True, exist_ok=True)
    store = Path(args.store) if args.store else example_store(out / "dump.zarr")

    # Stand-in for the cluster you already have; in real use, skip this and take its address.
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster:
        address = cluster.scheduler_address            # e.g. "tcp://127.0.0.1:40123"
        print(f"scheduler at {address}")

        # --- what you run against your own scheduler -------------------------
        with Client(address) as client:
            findings = gf.analyze(store, client=client, progress=False)
        paths = gf.report(findings, out)
        # ---------------------------------------------------------------------

    print(f"{len(findings.flags)} findings; scheduler: {findings.header.get('scheduler')}")
    for f in findings.flags[:3]:
        print(f"  {f.severity:.2f} {f.kind:<10} {f.tensor}{'' if f.head is None else f' head {f.head}'}  "
              f"{', '.join(f.sources)}")
    print(f"report: {paths['html']}")
    return out


if __name__ == "__main__":      # worker processes re-import this module: keep the guard
    main()
