"""``gradforensics analyze STORE --out DIR``: the forensic pass, then the report.

Threads by default, or ``--workers N`` / ``--scheduler ADDRESS``
(:mod:`gradforensics.commands.workers`); ``--out`` by the rule of
:mod:`gradforensics.commands.output`.  Exit 0 whatever is found; with
``--fail-on SEVERITY``, 1 when a flag reaches it.  ``--baseline STORE`` judges each
finding against an earlier healthy window or run of the same model
(:mod:`gradforensics.analysis.engine.baseline`).  ``--logs DIR`` joins the run's own logs
(TensorBoard event files, a ``trainer_state.json``) to the records by step for the timeline.
"""

from __future__ import annotations

import argparse
import sys
import time

from gradforensics._text import terminal

__all__ = ["add_arguments", "run"]



def add_arguments(p: argparse.ArgumentParser) -> None:
    from gradforensics.commands import output, workers
    from gradforensics.commands import storage as storage_flags
    from gradforensics.reporting.severity import add_fail_on_argument

    p.add_argument("store", help="a *.zarr directory or *.h5 file written by gradforensics, or a Zarr store at an "
                                 "fsspec URL (s3://bucket/dump.zarr)")
    output.add_out(p, "directory for report.html, report.md, flags.json, tables/")
    storage_flags.add_argument(p)
    workers.add_arguments(p)
    p.add_argument("--only", metavar="A,B", help="run only these analyses (comma-separated)")
    p.add_argument("--baseline", metavar="STORE", default=None,
                   help="an earlier healthy window or run of the same model: each finding is judged against it, "
                        "and one the baseline shows as strongly is context, below 0.5 (docs/baseline.md)")
    p.add_argument("--logs", metavar="DIR", default=None,
                   help="the run's own logs (TensorBoard event files or a trainer_state.json): their loss scale and "
                        "gradient norm join the timeline by step, skipped iterations leave the spike rule's window; "
                        "the store is not modified (docs/timeline.md)")
    p.add_argument("--slab-mb", type=float, default=None, metavar="MB",
                   help="MiB per dask chunk of gradients (peak memory ~ slab x workers)")
    output.add_quiet(p)
    add_fail_on_argument(p)


def run(args: argparse.Namespace) -> int:
    from gradforensics.analysis.engine.options import select_analyses
    from gradforensics.analysis.engine.run import analyze
    from gradforensics.commands import output, workers
    from gradforensics.commands import storage as storage_flags
    from gradforensics.commands.report import print_top
    from gradforensics.reporting import report
    from gradforensics.reporting.severity import counts_phrase, exit_code

    select_analyses(args.only, flag="--only")           # refused in the flag's words, before the store is opened
    output.check_dir(args.out)                          # and --out, before any gradient is read
    where = storage_flags.location(args, args.store)
    options = {"engine": {"slab_bytes": int(args.slab_mb * (1 << 20))}} if args.slab_mb else None
    with workers.client(args) as client:
        findings = analyze(where, client=client, only=args.only, options=options, progress=not args.quiet,
                           baseline=None if args.baseline is None else storage_flags.location(args, args.baseline),
                           logs=args.logs)
    t0 = time.perf_counter()
    if not args.quiet:                                  # the figures take a while: say so after the bar's 100 %
        print(terminal(f"writing the report into {args.out} (figures, tables) ..."), file=sys.stderr, flush=True)
    saved = None if findings.header.get("partial") else str(where)      # a partial pass's results are not saved
    with output.out_dir(args.out, "analyze", store=saved):
        paths = report(findings, args.out, store=where)
    if not args.quiet:
        print(f"report written in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        print_top(findings, paths)                      # the most severe findings, as `report` prints them
    if partial := findings.header.get("partial"):
        print(terminal(f"note: the store is being written by {partial['writer']}; analysed the "
                       f"{partial['n_records']} records committed so far (results not saved in the store)"),
              file=sys.stderr)
    if base := findings.header.get("baseline"):
        print(terminal(f"judged against the baseline {base['store']}: {base['context']} finding(s) it shows as "
                       "strongly are context (below 0.5)"), file=sys.stderr)
    if args.only and not args.quiet and not findings.header.get("partial"):
        print(terminal(f"note: this report holds the analyses run now ({', '.join(findings.results)}); the "
                       f"store's saved results keep the others' (`gradforensics report {args.store} --out DIR`)"),
              file=sys.stderr)
    print(terminal(f"{findings.store}: {counts_phrase(findings.flags)}; report in {args.out}"), file=sys.stderr)
    return exit_code(findings, args.fail_on, verb="analyze")

