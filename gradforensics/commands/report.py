"""``gradforensics report STORE --out DIR``: re-render the report from stored analysis results.

Reads only the store's ``analysis/`` group (written by ``gradforensics
analyze``), never the gradients: re-rendering a 100 GB dump takes seconds, and
works even where the gradient chunks have since been deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from gradforensics._text import terminal
from gradforensics.errors import MissingArrayError
from gradforensics.reporting.severity import add_fail_on_argument, exit_code

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Findings
    from gradforensics.store.location import Location
    from gradforensics.store.reader import Store

__all__ = ["COLLECT_EVERY", "add_arguments", "few_collections", "load_findings", "print_top", "run"]

#: The collector's first-generation threshold while a report is read and drawn (Python's default: 700).
COLLECT_EVERY = 20_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="a *.zarr directory or *.h5 file that `gradforensics analyze` has run on")
    from gradforensics.commands import output
    from gradforensics.commands import storage as storage_flags

    output.add_out(p, "directory for report.html, report.md, flags.json, tables/")
    storage_flags.add_argument(p)
    output.add_quiet(p)                    # nothing to silence but the same flag as every verb's
    add_fail_on_argument(p)


def load_findings(path: str | Location) -> tuple[Findings, Store]:
    """The stored findings of the store at *path*, without reading (or checking) gradient chunks."""
    from gradforensics.analysis.engine.results import read_findings
    from gradforensics.store.reader import Store
    from gradforensics.store.results import has_result

    store = Store(path, check_chunks=False)
    if not has_result(store, "findings"):
        raise MissingArrayError(
            f"{path} holds no analysis results; run `gradforensics analyze {path} --out DIR` first."
        )
    return read_findings(store), store


def print_top(findings: Findings, paths: dict[str, Path], n: int = 5, file: IO[str] | None = None) -> None:
    """Where the report is, the most severe findings, one line each, and what could not be judged (control
    characters escaped)."""
    from gradforensics.reporting.summary import group

    out = file or sys.stdout

    def say(line: str) -> None:               # names come from the store: no escape sequence reaches the terminal
        print(terminal(line), file=out)

    say(f"report: {paths['html']}")
    say(f"        {paths['markdown']}, {paths['flags']}")
    groups = group(findings.flags)
    if not groups:
        say("no findings.")
    for g in groups[:n]:
        say(f"  {g.severity:.2f} {g.kind:<13} {g.sentence(findings.n_records)}")
    if len(groups) > n:
        say(f"  ... and {len(groups) - n} more finding(s) in the report.")
    if findings.not_judged:             # what could not have fired: its silence is no all-clear
        say("  not judged: " + ", ".join(x.sentence() for x in findings.not_judged))


@contextlib.contextmanager
def few_collections() -> Iterator[None]:
    """Fewer cyclic garbage collections inside (the outputs are the same; garbage is still collected).

    What exists on entry (the imports) is frozen out of the collector's sight, and its first
    generation is collected every :data:`COLLECT_EVERY` allocations instead of 700.  The
    findings of a store of 2,000 tensors are hundreds of thousands of long-lived objects
    (flags, tables, 32,000 series) that every full collection traversed again: call
    :func:`gc.freeze` once they are read.  Measured on that store: 807 collections, 0.57
    CPU-s, became 118 and 0.12.  On exit the thresholds are restored and the objects
    frozen here given back to the collector (unless some were frozen before).
    """
    old, frozen = gc.get_threshold(), gc.get_freeze_count()
    gc.freeze()
    if old[0]:                                  # 0: collection switched off; it stays so
        gc.set_threshold(max(old[0], COLLECT_EVERY), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        if not frozen:                          # objects someone froze before stay frozen
            gc.unfreeze()


def run(args: argparse.Namespace) -> int:
    from gradforensics.commands import output
    from gradforensics.commands import storage as storage_flags
    from gradforensics.reporting import report

    output.check_dir(args.out)
    with few_collections():
        findings, store = load_findings(storage_flags.location(args, args.store))
        gc.freeze()                             # long-lived: never garbage while the report is drawn
        with output.out_dir(args.out, "report", store=str(args.store)):
            paths = report(findings, args.out, store=store)
    print_top(findings, paths)
    return exit_code(findings, args.fail_on, verb="report")
