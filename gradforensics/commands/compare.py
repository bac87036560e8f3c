"""``gradforensics compare BEFORE AFTER --out DIR``: what a fix resolved, left or broke.

Both stores must hold one model; each is analysed first if ``analyze`` has not
run on it.  Exit 0 whatever is found; with ``--fail-on SEVERITY``, 1 when a
``new`` or ``worse`` finding reaches it after the fix.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import IO, TYPE_CHECKING

from gradforensics._text import terminal
from gradforensics.errors import CompareWarning

if TYPE_CHECKING:
    from gradforensics.reporting.comparison import Comparison

__all__ = ["add_arguments", "print_summary", "run"]



def add_arguments(p: argparse.ArgumentParser) -> None:
    from gradforensics.reporting.severity import add_fail_on_argument

    p.add_argument("before", help="store captured before the fix (*.zarr or *.h5)")
    p.add_argument("after", help="store of the same model captured after the fix")
    from gradforensics.commands import output, workers
    from gradforensics.commands import storage as storage_flags

    output.add_out(p, "directory for report.html, report.md, compare.json, tables/compare.csv, figures/")
    storage_flags.add_argument(p)
    workers.add_arguments(p)
    output.add_quiet(p)
    add_fail_on_argument(p)


def print_summary(c: Comparison, n: int = 10, file: IO[str] | None = None) -> None:
    """Counts per status, where the report is, and the changed rows, one line each (names escaped)."""
    out = file or sys.stdout

    def say(line: str) -> None:
        print(terminal(line), file=out)

    say(", ".join(f"{v} {k}" for k, v in c.counts().items()) + f"; report: {c.paths['html']}")
    changed = [r for r in c.rows if r.changed]
    for r in changed[:n]:
        srcs = f" [{', '.join(r.sources)}]" if r.sources else ""
        b, a = (f"{v:.2f}" if v is not None else "-" for v in (r.severity_before, r.severity_after))
        say(f"  {r.status:<10} {r.kind:<13} {r.where}{srcs}: {b} -> {a}")
    if len(changed) > n:
        say(f"  ... and {len(changed) - n} more in {c.paths['csv']}.")


def run(args: argparse.Namespace) -> int:
    from gradforensics.commands import output, workers
    from gradforensics.commands import storage as storage_flags
    from gradforensics.reporting.severity import exit_code
    from gradforensics.runs.compare import compare

    before, after = storage_flags.location(args, args.before), storage_flags.location(args, args.after)
    with warnings.catch_warnings(record=True) as caught, output.out_dir(args.out, "compare"), \
            workers.client(args) as client:
        warnings.simplefilter("default")
        c = compare(before, after, args.out, client=client, progress=not args.quiet)
    for w in caught:              # a note is one line; any other warning goes out as Python shows it
        if issubclass(w.category, CompareWarning):     # it qualifies the result: printed even with --quiet
            print(terminal(f"gradforensics compare: note: {w.message}"), file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    print_summary(c)
    return exit_code(c, args.fail_on, verb="compare")
