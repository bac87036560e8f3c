"""``--out``, ``--overwrite``, ``--quiet``: one meaning each, on every verb.

The rule of ``--out``, the same for every verb:

* gradforensics never replaces anything it did not write.  A directory ``--out``
  (``analyze``, ``report``, ``loss``, ``compare``, ``whatif``, ``demo``) must be
  new, empty, or one gradforensics wrote before (it leaves a ``.gradforensics``
  marker file there); anything else is refused in one line, even with
  ``--overwrite``.  A store ``--out`` (``capture``) must be new or a gradforensics
  store.
* What gradforensics wrote is of two kinds.  A report (``report.*``, ``flags.json``,
  ``tables/``, ``figures/``) is derived from a store and is re-rendered in place on a
  rerun.  A store or the demo's checkpoint is recorded data that costs a run to redo:
  it is replaced only with ``--overwrite``.

``--quiet`` means: no progress bar, size estimate or word of what is being done on
stderr; the result, what qualifies it (a store still being written, runs that differ,
repairs made to a log) and errors are still printed.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from gradforensics.errors import OutExistsError, ReportInterrupted

__all__ = ["DIR_RULE", "MARKER", "METAVARS", "STORE_RULE", "add_out", "add_overwrite", "add_quiet", "check_dir", "check_store", "interrupted_report", "mark",
           "out_dir"]

#: The file gradforensics leaves in every directory ``--out`` it writes.
MARKER = ".gradforensics"

#: The one metavar of ``--out``: a directory, or for ``capture`` the store.
METAVARS = {"dir": "DIR", "store": "STORE"}

DIR_RULE = ("; must be new, empty, or written by gradforensics before (its own files are replaced, "
             "nothing else is)")
STORE_RULE = "; an existing store is replaced only with --overwrite, anything else never"


def add_out(p: argparse.ArgumentParser, what: str, *, kind: str = "dir", default: str | None = None) -> None:
    """``--out DIR`` (or ``--out STORE``), with *what* it receives and the rule above in its help."""
    rule = DIR_RULE if kind == "dir" else STORE_RULE
    p.add_argument("--out", required=default is None, default=default, metavar=METAVARS[kind],
                   help=what + rule + (" (default: %(default)s)" if default is not None else ""))


def add_overwrite(p: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    """``--overwrite``: replace *what* (a store gradforensics recorded); never anything else."""
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace {what} an earlier gradforensics run recorded at --out (never anything else)")


def add_quiet(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--quiet``: the same words on every verb."""
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar, size estimate or word of what is being done (the result, notes that "
                        "qualify it and errors are still printed)")


def check_dir(path: str | os.PathLike[str], *, stores: Sequence[str] = (), overwrite: bool = False) -> Path:
    """Refuse a directory ``--out`` that the rule does not allow; *stores*: names in it replaced only with
    *overwrite* (the recorded data of an earlier run).  Nothing is created."""
    out = Path(path)
    if out.is_symlink() and not out.is_dir():
        raise OutExistsError(f"--out {out} is a symbolic link to nothing; choose another --out.")
    if not out.exists():
        return out
    if not out.is_dir():
        raise OutExistsError(f"--out {out} is a file, not a directory; gradforensics does not replace it. "
                             "Choose another --out.")
    try:
        entries = [e.name for e in out.iterdir()]
    except OSError as exc:
        raise OutExistsError(f"--out {out} cannot be listed ({exc.strerror}); choose another --out.") from exc
    if not entries:
        return out
    if MARKER not in entries:
        shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
        raise OutExistsError(f"--out {out} holds files gradforensics did not write ({shown}); it does not "
                             "replace them, even with --overwrite. Choose a new or empty directory.")
    kept = [s for s in stores if (out / s).exists()]
    if kept and not overwrite:
        raise OutExistsError(f"--out {out} already holds {', '.join(kept)} recorded by an earlier run; pass "
                             "--overwrite to replace it, or choose another --out.")
    return out


def check_store(path: str, overwrite: bool) -> None:
    """Refuse a local store ``--out`` that is not a gradforensics store, even with *overwrite*.

    A new path or an empty directory passes; an existing store is the library's to refuse
    without ``--overwrite`` (:func:`gradforensics.replay.pipeline.store_location`), as is a URL.
    """
    from gradforensics.store import remote
    from gradforensics.store.backends import STORE_SUFFIXES, guess_backend

    p = Path(path)
    if remote.is_url(path) or not path.lower().endswith(STORE_SUFFIXES) or not (p.exists() or p.is_symlink()):
        return
    if p.is_dir() and not p.is_symlink() and not any(p.iterdir()):
        return
    problem = "is a symbolic link" if p.is_symlink() else guess_backend(path).not_a_store(p)
    if problem:
        raise OutExistsError(f"--out {path} {problem}; gradforensics does not replace it, even with --overwrite. "
                             "Choose another --out.")


def mark(path: str | os.PathLike[str], verb: str) -> None:
    """Leave the marker in *path* (if it is a directory): gradforensics wrote it, with this *verb*."""
    from gradforensics import __version__
    from gradforensics.errors import WriteRefusedError, refusal

    out = Path(path)
    if out.is_dir() and not (out / MARKER).exists():
        try:
            (out / MARKER).write_text(json.dumps({"written_by": f"gradforensics {__version__}", "verb": verb})
                                      + "\n", encoding="utf-8")
        except OSError as exc:
            why = refusal(exc)
            if why is None:
                raise
            raise WriteRefusedError(f"{out / MARKER}: could not be written ({why}).") from exc


@contextmanager
def out_dir(path: str | os.PathLike[str], verb: str, *, stores: Sequence[str] = (),
            overwrite: bool = False, store: str | None = None) -> Iterator[Path]:
    """Check *path* by the rule, let the verb write there, then mark it as gradforensics'.

    Ctrl-C inside becomes :class:`~gradforensics.errors.ReportInterrupted`, which says that
    *path* holds an incomplete report and how to finish it: with *store* (whose analysis
    results are saved), ``gradforensics report STORE --out PATH``, no gradient read again;
    else the verb again.
    """
    out = check_dir(path, stores=stores, overwrite=overwrite)
    try:
        yield out
    except BaseException as exc:
        with suppress(OSError):          # what the verb wrote is ours; a full disk must not hide its error
            mark(out, verb)
        if type(exc) is KeyboardInterrupt:
            raise ReportInterrupted(interrupted_report(str(path), verb, store)) from None
        raise
    mark(out, verb)


def interrupted_report(path: str, verb: str, store: str | None = None) -> str:
    """What a Ctrl-C while *verb* wrote into *path* leaves, and the command that finishes it."""
    again = (f"the analysis results are saved in {store}: `gradforensics report {store} --out {path}` writes it "
             "without reading the gradients again" if store is not None
             else f"run `gradforensics {verb}` again with the same --out to write it whole")
    return f"while writing into {path}; what it holds is incomplete; {again}."
