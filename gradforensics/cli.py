"""The ``gradforensics`` command line.

Each verb lives in its own module under :mod:`gradforensics.commands` exposing
``add_arguments(parser)`` and ``run(args) -> int``; add a verb with one line in
``VERBS``.  A :class:`~gradforensics.errors.GradforensicsError`, and an ``OSError``
that is the machine refusing (a full disk, a read-only file system, a permission),
become one line on stderr and exit code 2; anything else is a bug and keeps its
traceback.  A warning is one line (``gradforensics VERB: warning: ...``); Ctrl-C is one line
(with what the verb leaves behind, where it says) and exit code 130; a reader of stdout
that leaves early (``| head -1``) ends the verb quietly with exit code 141.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from gradforensics._text import terminal
from gradforensics.errors import GradforensicsError, refusal

__all__ = ["VERBS", "build_parser", "environment_error", "main"]


#: verb -> (module under gradforensics.commands, one-line help), in the order of the workflow
VERBS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "train a tiny transformer with planted trouble on CPU, capture, analyze, report"),
    "capture": ("capture", "dump a problem checkpoint (HF directory or raw PyTorch) replaying batches per data source"),
    "import": ("import_", "import a run's history: a checkpoint series (updates between checkpoints) or Megatron-LM "
                          "gradient dumps"),
    "inspect": ("inspect", "what a store holds: schema, sources, records, tensors, sizes"),
    "analyze": ("analyze", "run the forensic pass over a store (Dask) and write the report"),
    "report": ("report", "re-render the report from a store's stored analysis results (no gradient reads)"),
    "compare": ("compare", "compare two runs of one model finding by finding: resolved, new, persisting, worse"),
    "whatif": ("whatif", "replay the problem checkpoint under several optimizers / LRs / mixtures on identical batches, "
                         "side by side"),
    "loss": ("loss", "loss-curve forensics of a store or training logs: spectrum vs red noise, fractal dimension"),
}


class _Formatter(argparse.HelpFormatter):
    """Help with each option's default shown, where it has one worth showing and the text does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is False or default == []
                or default == argparse.SUPPRESS or "default" in text.lower()):
            return text
        shown = " ".join(default) if isinstance(default, list) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})" if text else f"default: {shown}"


class _Parser(argparse.ArgumentParser):
    """An argparse parser that refuses in one line on stderr, in the words of its own verb.

    No abbreviations (``--ou`` is not ``--out``); an option the verb does not take
    is named, with the closest option it does take, before any other complaint
    (a misspelt ``--ouy X`` is not "--out required"); arguments left over are
    refused by the verb's parser, not the top-level one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        self._refuse_unknown_options(argv)
        ns, extras = super().parse_known_args(argv, namespace)
        if extras and self._subparsers is None:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    def _refuse_unknown_options(self, argv: list[str]) -> None:
        known = self._option_string_actions
        for token in argv:
            if token == "--":
                return
            if self._subparsers is not None and not token.startswith("-"):
                return                            # the verb: the rest is its parser's to judge
            if not token.startswith("-") or token == "-" or self._negative_number_matcher.match(token):
                continue
            name = token.split("=", 1)[0] if token.startswith("--") else token
            if name in known or (not token.startswith("--") and token[:2] in known):
                continue
            longs = [o for o in known if o.startswith("--")]
            close = difflib.get_close_matches(name, longs, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            self.error(f"unknown option {name}{hint}")

    def error(self, message: str) -> NoReturn:
        """One line: ``<prog>: error: <message>; see <prog> --help``; exit 2."""
        line = f"{self.prog}: error: {message.rstrip('.')}; see `{self.prog} --help`"
        self.exit(2, terminal(" ".join(line.split())) + "\n")


def build_parser() -> argparse.ArgumentParser:
    from gradforensics import __version__

    parser = _Parser(prog="gradforensics", description="Offline forensics of sick training runs.")
    parser.add_argument("--version", action="version", version=f"gradforensics {__version__}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB", parser_class=_Parser)
    for verb, (module, help_) in VERBS.items():
        p = sub.add_parser(verb, help=help_, description=help_, formatter_class=_Formatter)
        mod = importlib.import_module(f"gradforensics.commands.{module}")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shown = warnings.formatwarning
    # how a warning reads when Python prints it (one that is recorded, by pytest.warns, stays as it is)
    warnings.formatwarning = _one_line_warnings(args.verb)
    try:
        rc = int(args._run(args) or 0)
        sys.stdout.flush()                         # a reader that left (`| head -1`) is told here, not at exit
        return rc
    except BrokenPipeError:
        return _reader_left()
    except GradforensicsError as exc:
        said = exc.cli or str(exc)       # in the command's words (--overwrite), not Python's (overwrite=True)
        print(terminal(f"gradforensics {args.verb}: error: {said}"), file=sys.stderr)   # one line, whatever it names
        _quiet_abandoned_reads()
        return 2
    except KeyboardInterrupt as exc:             # Ctrl-C; a verb's own interrupt says what it leaves behind
        said = f": {exc}" if str(exc) else ""
        print(terminal(f"gradforensics {args.verb}: interrupted{said}"), file=sys.stderr)
        return 130
    except OSError as exc:
        line = environment_error(exc)
        if line is None:
            raise                        # not the machine saying no: a bug, keep the traceback
        print(terminal(f"gradforensics {args.verb}: error: {line}"), file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = shown


#: The exit status when stdout's reader left early (``gradforensics inspect ... | head -1``): 128 + SIGPIPE,
#: what a shell reports for a command a closed pipe stopped.
EXIT_PIPE_CLOSED = 141


def _reader_left() -> int:
    """stdout's reader is gone: nothing more to say to it, and no traceback about it.

    Python flushes stdout once more at exit; pointing it at ``os.devnull`` first keeps
    that flush from failing again (the way the Python docs recommend for SIGPIPE).
    """
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return EXIT_PIPE_CLOSED


def _one_line_warnings(verb: str) -> Callable[..., str]:
    """``warnings.formatwarning`` for a verb: each warning one line, ``gradforensics VERB: warning: ...``.

    The library raises them with :func:`warnings.warn`, so a Python caller can filter or record
    them (``warnings.filterwarnings``, ``pytest.warns``); on the command line they read like the
    verb's other lines, without the file, line number and source line Python shows.
    """
    def fmt(message: Warning | str, category: type[Warning], filename: str, lineno: int,
            line: str | None = None) -> str:
        text = " ".join(str(message).split()).removeprefix("gradforensics: ")
        return terminal(f"gradforensics {verb}: warning: {text}") + "\n"

    return fmt


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
    already.  So are the writes zarr ran beside one that failed for good at a URL
    (a service answering 503 to every request): their coroutines, closed when the
    interpreter exits, end in "Exception ignored in: <coroutine ...>" tracebacks.
    """
    import inspect
    import logging

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not inspect.iscoroutine(unraisable.object):
            previous(unraisable)

    sys.unraisablehook = hook


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
