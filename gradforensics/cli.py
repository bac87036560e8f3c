"""The ``gradforensics`` command line.

Each verb lives in its own module under :mod:`gradforensics.commands` exposing
``add_arguments(parser)`` and ``run(args) -> int``; add a verb with one line in
``VERBS``.  A :class:`~gradforensics.errors.GradforensicsError`, and an ``OSError``
that is the machine refusing (a full disk, a read-only file system, a permission),
become one line on stderr and exit code 2; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from gradforensics._text import terminal
from gradforensics.errors import GradforensicsError, refusal

__all__ = ["VERBS", "build_parser", "environment_error", "main"]


#: verb -> (module under gradforensics.commands, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "inspect": ("inspect", "what a store holds: schema, sources, records, tensors, sizes"),
    "report": ("report", "re-render the report from a store's stored analysis results (no gradient reads)"),
    "demo": ("demo", "train a tiny transformer with planted trouble on CPU, capture, analyze, report"),
    "analyze": ("analyze", "run the forensic pass over a store (Dask) and write the report"),
    "loss": ("loss", "loss-curve forensics of a store or training logs: spectrum vs red noise, fractal dimension"),
    "compare": ("compare", "compare two runs of one model finding by finding: resolved, new, persisting, worse"),
    "capture": ("capture", "dump a problem checkpoint (HF directory or raw PyTorch) replaying batches per data source"),
    "whatif": ("whatif", "replay the problem checkpoint under several optimizers / LRs / mixtures on identical batches, "
                         "side by side"),
}


def build_parser() -> argparse.ArgumentParser:
    from gradforensics import __version__

    parser = argparse.ArgumentParser(prog="gradforensics", description="Offline forensics of sick training runs.")
    parser.add_argument("--version", action="version", version=f"gradforensics {__version__}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, (module, help_) in VERBS.items():
        p = sub.add_parser(verb, help=help_, description=help_)
        mod = importlib.import_module(f"gradforensics.commands.{module}")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except GradforensicsError as exc:
        print(terminal(f"gradforensics {args.verb}: error: {exc}"), file=sys.stderr)   # one line, whatever it names
        _quiet_abandoned_reads()
        return 2
    except KeyboardInterrupt:
        print(f"gradforensics {args.verb}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        line = environment_error(exc)
        if line is None:
            raise                        # not the machine saying no: a bug, keep the traceback
        print(terminal(f"gradforensics {args.verb}: error: {line}"), file=sys.stderr)
        return 2


def environment_error(exc: OSError) -> str | None:
    """One line for the machine refusing a write or read (:func:`~gradforensics.errors.refusal`), else None."""
    reason = refusal(exc)
    if reason is None:
        return None
    return f"{exc.filename}: {reason}." if exc.filename else f"{reason} ({str(exc)[:200]})."


def _quiet_abandoned_reads() -> None:
    """After an error, keep stderr to its one line.

    A chunk that fails its checksum aborts zarr's concurrent read of its
    neighbours; asyncio then reports each abandoned read ("Task was destroyed but
    it is pending!") when the interpreter exits.  They are the same error, told
    already.
    """
    import logging

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
