"""``gradforensics loss FILE_OR_STORE [FILE ...] --out DIR``: loss-curve forensics.

Runs the loss-curve analyses (``loss_spectrum``, ``fractal``, ``coherence``) on
a store's ``batches/loss`` or on training logs (CSV / TSV / JSON Lines with a
step column and value columns) and writes what ``analyze`` writes: the report,
``flags.json`` and ``tables/<name>.csv``.  Several files are several ranks of
the same run; so are the groups of a ``--rank-col``.  Repairs made to a log
(dropped NaN, averaged duplicate steps, interpolated gaps) are printed, one
line per series.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from gradforensics._text import terminal
from gradforensics.errors import SpecError

if TYPE_CHECKING:
    from gradforensics.analysis.engine.model import Findings
    from gradforensics.analysis.series import SeriesGroup

STORE_SUFFIXES = (".zarr", ".h5", ".hdf5")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gradforensics.analysis.kinds.loss_spectrum import CORRECTIONS, DETRENDERS
    from gradforensics.report.severity import add_fail_on_argument

    p.add_argument("inputs", nargs="+", metavar="FILE_OR_STORE",
                   help="a gradforensics store, or one or more CSV / JSON Lines logs (several = several ranks)")
    p.add_argument("--out", required=True, help="directory for report.html, report.md, flags.json, tables/")
    p.add_argument("--step-col", metavar="COL", help="step column (default: step, _step, global_step, iteration, …)")
    p.add_argument("--time-col", metavar="COL", help="wall-clock seconds column: sample by time, frequencies in Hz")
    p.add_argument("--rank-col", metavar="COL", help="data-parallel rank column: one series per rank + coherence")
    p.add_argument("--columns", metavar="A,B", help="value columns to analyse (default: every numeric column)")
    p.add_argument("--axis", choices=("step", "time"), default="step",
                   help="for a store: sample by batches/step (default) or batches/time")
    p.add_argument("--detrend", choices=DETRENDERS, default="savgol", help="trend removal (default: savgol)")
    p.add_argument("--alpha", type=float, default=0.01, help="significance after correction (default 0.01)")
    p.add_argument("--correction", choices=CORRECTIONS, default="bh",
                   help="multiple-testing correction over frequencies (default bh)")
    p.add_argument("--nperseg", type=int, default=None, help="Welch segment length (default: N/8, a power of 2)")
    p.add_argument("--quiet", action="store_true", help="do not print the repairs made to the series")
    add_fail_on_argument(p)


def _is_store(path: str) -> bool:
    return os.path.isdir(path) or path.lower().rstrip("/").endswith(STORE_SUFFIXES)


def load(args: argparse.Namespace) -> tuple[list[SeriesGroup], dict[str, Any]]:
    """The series of the inputs and the findings' header fields."""
    from gradforensics.analysis import series

    stores = [p for p in args.inputs if _is_store(p)]
    if stores and len(args.inputs) > 1:
        raise SpecError(f"loss: give one store, or one or more log files; got {args.inputs}.")
    if stores:
        from gradforensics.store.reader import Store

        st = Store(stores[0], check_chunks=False)
        groups = series.from_batches(st.batches(), None, mode=st.mode, axis=args.axis)
        return groups, {"store": st.path, "n_records": st.n_records, "mode": st.mode, "sources": st.sources,
                        "input": "store"}
    spec = series.LogSpec(step_col=args.step_col, time_col=args.time_col, rank_col=args.rank_col,
                          columns=tuple(c.strip() for c in (args.columns or "").split(",") if c.strip()))
    groups = series.read_logs(args.inputs, spec)
    n_rows = max((g.combined.quality.n_rows for g in groups), default=0)
    return groups, {"store": ", ".join(args.inputs), "n_records": n_rows, "mode": "training", "sources": (),
                    "input": "log"}


def findings_of(groups: list[SeriesGroup], meta: dict[str, Any], options: Any) -> Findings:
    """Run the three loss-curve analyses on *groups* (no engine) and gather :class:`Findings`."""
    from gradforensics.analysis.engine.model import Findings
    from gradforensics.analysis.kinds import coherence, fractal, loss_spectrum

    spec = loss_spectrum.analyze_series(groups, options)
    results = {"loss_spectrum": spec, "fractal": fractal.analyze_series(groups, options)}
    if any(g.ranks for g in groups):
        results["coherence"] = coherence.analyze_series(groups, options)
    flags = loss_spectrum.flags_from_table(spec.table, options)
    header = {"input": meta["input"], "series": [g.name for g in groups],
              "repairs": {g.name: "; ".join(g.combined.quality.notes()) for g in groups
                          if g.combined.quality.notes()}}
    return Findings(store=meta["store"], n_records=int(meta["n_records"]), mode=meta["mode"],
                    sources=tuple(meta["sources"]), header=header, results=results, flags=flags)


def run(args: argparse.Namespace) -> int:
    from gradforensics.analysis.kinds.loss_spectrum import SpectrumOptions
    from gradforensics.report import report

    options = SpectrumOptions(detrend=args.detrend, nperseg=args.nperseg, alpha=args.alpha,
                              correction=args.correction, axis=args.axis)
    groups, meta = load(args)
    if not args.quiet:
        for g in groups:
            notes = g.combined.quality.notes()
            if notes:
                print(terminal(f"{g.name}: " + "; ".join(notes)), file=sys.stderr)
    findings = findings_of(groups, meta, options)
    report(findings, args.out, store=meta["store"] if meta["input"] == "store" else None)
    n_top = sum(f.severity > 0.5 for f in findings.flags)
    print(terminal(f"{findings.store}: {len(groups)} series, {len(findings.flags)} findings ({n_top} above 0.5); "
                   f"report in {args.out}"), file=sys.stderr)
    if args.fail_on is not None and any(f.severity >= args.fail_on - 1e-12 for f in findings.flags):
        return 1
    return 0

