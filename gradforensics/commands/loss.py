"""``gradforensics loss FILE_OR_STORE [FILE ...] --out DIR``: loss-curve forensics.

Runs every registered analysis with a ``series`` hook (the loss-curve analyses
``loss_spectrum``, ``fractal``, ``coherence``) through the registry
(:func:`gradforensics.analysis.engine.analyze_series`), with their own options and
flags, on a store's ``batches/loss`` or on training logs (CSV / TSV / JSON Lines
with a step column and value columns), and writes what ``analyze`` writes: the
report, ``flags.json`` and ``tables/<name>.csv``.  Several files are several ranks
of the same run; so are the groups of a ``--rank-col``.  Repairs made to a log
(dropped NaN, averaged duplicate steps, interpolated gaps) are printed, one line
per series.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradforensics._text import terminal
from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import numpy as np

    from gradforensics.analysis.contract.model import Findings
    from gradforensics.analysis.contract.options import Options
    from gradforensics.analysis.toolkit.series import SeriesGroup
    from gradforensics.store.reader import Store
    from gradforensics.store.schema import StoreMeta

__all__ = ["LossInput", "add_arguments", "findings_of", "load", "run", "series_options"]




class _SignalChoices(Sequence[str]):
    """The choices of a signal option, read from the toolkit on first use (``--help`` imports no analysis)."""

    def __init__(self, module: str, name: str) -> None:
        self._module, self._name = module, name

    def _values(self) -> tuple[str, ...]:
        from importlib import import_module

        return tuple(getattr(import_module(f"gradforensics.analysis.toolkit.signal.{self._module}"), self._name))

    def __getitem__(self, i):  # type: ignore[override]
        return self._values()[i]

    def __len__(self) -> int:
        return len(self._values())


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gradforensics.reporting.severity import add_fail_on_argument

    DETRENDERS, CORRECTIONS = _SignalChoices("detrending", "DETRENDERS"), _SignalChoices("peaks", "CORRECTIONS")

    p.add_argument("inputs", nargs="+", metavar="FILE_OR_STORE",
                   help="a gradforensics store, or one or more CSV / JSON Lines logs (several = several ranks)")
    from gradforensics.commands import output
    from gradforensics.commands import storage as storage_flags

    output.add_out(p, "directory for report.html, report.md, flags.json, tables/")
    storage_flags.add_argument(p)
    p.add_argument("--step-col", metavar="COL", help="step column (default: step, _step, global_step, iteration, …)")
    p.add_argument("--time-col", metavar="COL", help="wall-clock seconds column: sample by time, frequencies in Hz")
    p.add_argument("--rank-col", metavar="COL", help="data-parallel rank column: one series per rank + coherence")
    p.add_argument("--columns", metavar="A,B", help="value columns to analyse (default: every numeric column)")
    p.add_argument("--axis", choices=("step", "time"), default="step",
                   help="for a store: sample by batches/step (default) or batches/time")
    p.add_argument("--detrend", choices=DETRENDERS, default="savgol", metavar="METHOD",
                   help="trend removal: %(choices)s (default: savgol)")
    p.add_argument("--alpha", type=float, default=0.01, help="significance after correction (default 0.01)")
    p.add_argument("--correction", choices=CORRECTIONS, default="bh", metavar="METHOD",
                   help="multiple-testing correction over frequencies: %(choices)s (default bh)")
    p.add_argument("--nperseg", type=int, default=None, help="Welch segment length (default: N/8, a power of 2)")
    output.add_quiet(p)
    add_fail_on_argument(p)


def _is_store(path: str) -> bool:
    from gradforensics.store.backends import STORE_SUFFIXES

    return os.path.isdir(path) or path.lower().rstrip("/").endswith(STORE_SUFFIXES)


@dataclass(frozen=True)
class LossInput:
    """The series ``loss`` analyses and where they came from.

    ``label`` is the findings' ``store`` field (the store's path, or the log files);
    ``meta`` the store's metadata, or for logs one made up for them (``training``
    mode, no sources, ``n_records`` the rows of the longest series); ``store`` and
    ``batches`` are set for a store only.
    """

    groups: list[SeriesGroup]
    label: str
    meta: StoreMeta
    kind: str
    store: Store | None = None
    batches: dict[str, np.ndarray] = field(default_factory=dict)


def load(args: argparse.Namespace) -> LossInput:
    """The series of the inputs: a store's ``batches/*``, or one or more logs."""
    from gradforensics import logs
    from gradforensics.analysis.toolkit import series
    from gradforensics.store.schema import StoreMeta

    stores = [p for p in args.inputs if _is_store(p)]
    if stores and len(args.inputs) > 1:
        raise SpecError(f"loss: give one store, or one or more log files; got {args.inputs}.")
    if stores:
        from gradforensics.commands import storage as storage_flags
        from gradforensics.store.reader import Store

        st = Store(storage_flags.location(args, stores[0]), check_chunks=False)
        batches = st.batches()
        groups = series.from_batches(batches, None, mode=st.mode, axis=args.axis)
        return LossInput(groups, st.path, st.meta, "store", st, batches)
    spec = logs.LogSpec(step_col=args.step_col, time_col=args.time_col, rank_col=args.rank_col,
                          columns=tuple(c.strip() for c in (args.columns or "").split(",") if c.strip()))
    groups = logs.read_logs(args.inputs, spec)
    n_rows = max((g.combined.quality.n_rows for g in groups), default=0)
    return LossInput(groups, ", ".join(args.inputs), StoreMeta(sources=(), mode="training", n_records=n_rows), "log")


def series_options(args: argparse.Namespace) -> dict[str, Options]:
    """The options of every registered analysis with a ``series`` hook, parsed once by its
    options class from the CLI's spectrum flags (those fields it has; the rest its defaults)."""
    from gradforensics.analysis import REGISTRY

    raw = {"detrend": args.detrend, "nperseg": args.nperseg, "alpha": args.alpha, "correction": args.correction,
           "axis": args.axis}
    out: dict[str, Options] = {}
    for a in REGISTRY.values():
        if a.series is not None:
            known = a.options.field_names()
            out[a.name] = a.options.parse({k: v for k, v in raw.items() if k in known}, a.name)
    return out


def findings_of(inp: LossInput, options: dict[str, Options]) -> Findings:
    """Run the registered series analyses on *inp* (no gradients read) and gather :class:`Findings`."""
    from gradforensics.analysis.contract.model import Findings
    from gradforensics.analysis.engine.run import analyze_series

    results, flags = analyze_series(inp.groups, inp.meta, options, store=inp.store, batches=inp.batches)
    header = {"input": inp.kind, "series": [g.name for g in inp.groups],
              "repairs": {g.name: "; ".join(g.combined.quality.notes()) for g in inp.groups
                          if g.combined.quality.notes()}}
    return Findings(store=inp.label, n_records=int(inp.meta.n_records), mode=inp.meta.mode,
                    sources=tuple(inp.meta.sources), header=header, results=results, flags=flags)


def run(args: argparse.Namespace) -> int:
    from gradforensics.commands import output
    from gradforensics.reporting import report
    from gradforensics.reporting.severity import counts_phrase, exit_code

    options = series_options(args)
    output.check_dir(args.out)
    inp = load(args)
    for g in inp.groups:                       # the repairs qualify the result: printed even with --quiet
        notes = g.combined.quality.notes()
        if notes:
            print(terminal(f"{g.name}: " + "; ".join(notes)), file=sys.stderr)
    findings = findings_of(inp, options)
    with output.out_dir(args.out, "loss"):
        report(findings, args.out, store=inp.store if inp.kind == "store" else None)
    print(terminal(f"{findings.store}: {len(inp.groups)} series, {counts_phrase(findings.flags)}; "
                   f"report in {args.out}"), file=sys.stderr)
    return exit_code(findings, args.fail_on, verb="loss")
