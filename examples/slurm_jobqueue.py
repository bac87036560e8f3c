"""Run the forensic pass on a SLURM cluster through dask-jobqueue (copy and adapt).

dask-jobqueue submits dask workers as SLURM jobs and connects them to a
scheduler running where this script runs (a login node or a small job).
Adapt ``queue``/``account``/resources to your site; every worker must see the
store on a shared filesystem.

Where no SLURM is present (no ``sbatch`` on PATH) the script only prints the
batch script it would submit, which is the thing to check first on a new
cluster.  Usage::

    python examples/slurm_jobqueue.py STORE [--out DIR] [--jobs N] [--queue Q] [--account A]
    python examples/slurm_jobqueue.py --print-job-script
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import gradforensics as gf

if TYPE_CHECKING:
    from dask_jobqueue import SLURMCluster


def make_cluster(queue: str | None, account: str | None) -> SLURMCluster:
    from dask_jobqueue import SLURMCluster

    return SLURMCluster(
        queue=queue, account=account,
        cores=8, processes=8,                 # 8 single-threaded workers per job: one BLAS thread each
        memory="32GB",                        # per job; each worker gets memory/processes
        walltime="01:00:00",
        job_script_prologue=[                 # run before the workers start: your environment
            "export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1",
            "source ~/venvs/gradforensics/bin/activate",
        ],
        job_extra_directives=["--job-name=gradforensics"],
        local_directory="$TMPDIR",            # worker spill space on the node's local disk
        scheduler_options={"dashboard_address": None},
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Analyze a store on SLURM via dask-jobqueue.")
    p.add_argument("store", nargs="?", help="*.zarr or *.h5 store on a shared filesystem")
    p.add_argument("--out", default="report", help="report directory (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=2, help="SLURM jobs of workers to start")
    p.add_argument("--queue", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--print-job-script", action="store_true", help="print the batch script and exit")
    args = p.parse_args(argv)

    with make_cluster(args.queue, args.account) as cluster:
        if args.print_job_script or shutil.which("sbatch") is None:
            if not args.print_job_script:
                print("# no sbatch on PATH: this is the job script dask-jobqueue would submit")
            print(cluster.job_script())
            return 0
        if args.store is None:
            p.error("STORE is required to run the analysis")
        from distributed import Client

        cluster.scale(jobs=args.jobs)
        with Client(cluster) as client:
            client.wait_for_workers(1, timeout=600)       # queued jobs may take a while to start
            findings = gf.analyze(args.store, client=client)
        paths = gf.report(findings, Path(args.out))
        print(f"{len(findings.flags)} findings; report: {paths['html']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
