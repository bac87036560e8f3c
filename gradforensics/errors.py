"""Errors gradforensics raises on bad input.

Every error is a :class:`GradforensicsError`; subclasses also inherit the
matching built-in exception so ``except FileNotFoundError`` still works.  The
message is one line: what, where, expected vs found, and what to do.  The CLI
prints it on stderr and exits with code 2; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import errno

__all__ = ["AttentionUnavailableError", "CaptureInterrupted", "CaptureWarning", "CheckpointError", "CompareWarning",
           "CorruptChunkError", "CorruptStoreError", "DataError", "DataFileNotFoundError", "EmptyStoreError",
           "FlagsSchemaError", "GradforensicsError", "HeadSplitError", "ImportSourceError", "LogNotPlacedError", "LogReadError", "MissingArrayError",
           "MissingExtraError", "MissingShardError", "ModelMismatchError", "NoAnswerError", "NotACheckpointError",
           "NotAStoreError", "OfflineError", "OutExistsError", "PlotBugWarning", "ReportInterrupted",
           "SchemaVersionError", "ShardMismatchError",
           "SpecError", "StoreClosedError", "StoreExistsError", "StoreLockedError", "StoreMismatchError",
           "StorePermissionError", "StoreUnreachableError", "Terminated", "UnsafeNameError", "WhatIfInterrupted",
           "WorkerLostError", "WriteRefusedError", "refusal"]


class GradforensicsError(Exception):
    """Base class of every error gradforensics raises on bad input.

    *cli*: the same line in the command line's words (``--overwrite``, ``--attention GLOB``) where the
    Python one names a keyword (``overwrite=True``, ``attention=[module globs]``); the CLI prints
    :attr:`cli` when it is set, ``str()`` otherwise.
    """

    #: the message in the command line's words, where it differs from ``str()`` (None: the same)
    cli: str | None = None

    def __init__(self, *args: object, cli: str | None = None) -> None:
        super().__init__(*args)
        if cli is not None:
            self.cli = cli


class NotAStoreError(GradforensicsError, FileNotFoundError):
    """The path is missing or holds no gradforensics store."""


class SchemaVersionError(GradforensicsError, ValueError):
    """The store was written with a schema this version does not read."""


class MissingArrayError(GradforensicsError, KeyError):
    """A required array of the schema is absent from the store."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class StoreMismatchError(GradforensicsError, ValueError):
    """Data handed to the store does not match what the store holds."""


class CorruptChunkError(GradforensicsError, OSError):
    """A chunk of an array is missing or cannot be decoded."""


class EmptyStoreError(GradforensicsError, ValueError):
    """The store holds no complete record."""


class SpecError(GradforensicsError, ValueError):
    """An option or specification given by the user is invalid."""


class HeadSplitError(SpecError):
    """A head split that cannot be made or fails its probe check; ``str()`` is the Python fix, :attr:`cli` the CLI one."""

    def __init__(self, message: str, cli: str | None = None) -> None:
        super().__init__(message, cli=cli or message)


class AttentionUnavailableError(SpecError):
    """``attention=`` was asked of a model whose attention exposes no weights (SDPA / flash kernels)."""


class StoreClosedError(GradforensicsError, RuntimeError):
    """The store or recorder was used after it was closed."""


class StoreExistsError(GradforensicsError, FileExistsError):
    """A new store was asked for at a path that already holds something."""


class OutExistsError(GradforensicsError, FileExistsError):
    """A command's ``--out`` holds something gradforensics may not replace (not its own, or recorded data
    without ``--overwrite``)."""


class StoreLockedError(GradforensicsError, BlockingIOError):
    """Another writer holds the store's lock."""


class CorruptStoreError(GradforensicsError, ValueError):
    """The store's metadata is damaged or inconsistent (shapes, attributes, links)."""


class UnsafeNameError(GradforensicsError, ValueError):
    """A name (tensor, module, source, analysis) that cannot safely become a store key or a file name."""


class ModelMismatchError(GradforensicsError, ValueError):
    """Two stores that must hold one model (``compare``) differ in a tensor's name or shape."""


class MissingExtraError(GradforensicsError, ImportError):
    """An optional dependency a command needs is not installed; the message names the extra that brings it."""


class StorePermissionError(GradforensicsError, PermissionError):
    """The storage service holding a store (``s3://``, ...) refused the credentials."""


class StoreUnreachableError(GradforensicsError, ConnectionError):
    """The storage service holding a store (``s3://``, ...) could not be reached after retries."""


class WorkerLostError(GradforensicsError, RuntimeError):
    """A ``dask.distributed`` worker died (killed for memory, say) or ran out of memory running part of the analysis."""


class NoAnswerError(TimeoutError):
    """An attempt of a store operation at a URL that had not returned when its deadline came (internal: the retry
    layer turns it into a :class:`StoreUnreachableError` line)."""


class WriteRefusedError(GradforensicsError, OSError):
    """The machine refused a write (a full disk, a read-only file system, a permission); names the path."""


#: errno values that mean the machine refused a read or write (not a bug in gradforensics)
_REFUSALS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.ENAMETOOLONG}
_REFUSAL_TEXT = ("No space left on device", "Disk quota exceeded", "Read-only file system", "Permission denied")


def refusal(exc: OSError) -> str | None:
    """The reason, when *exc* is the machine refusing (full disk, read-only, permission); None otherwise.

    h5py reports these without ``errno`` set, in its message (``errno = 28, error message = 'No space ...'``).
    """
    text = str(exc)
    if exc.errno not in _REFUSALS and not any(t in text for t in _REFUSAL_TEXT):
        return None
    return exc.strerror or next((t for t in _REFUSAL_TEXT if t in text), text[:200])


# errors of the inputs read by capture, replay, what-if and the log reader
class DataError(GradforensicsError, ValueError):
    """A data file is missing, empty, not UTF-8, or lacks the text field."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A data file does not exist."""


class NotACheckpointError(GradforensicsError, FileNotFoundError):
    """The path is neither a Hugging Face model directory nor a checkpoint file."""


class CheckpointError(GradforensicsError, ValueError):
    """The checkpoint is there but cannot be loaded as asked."""


class OfflineError(GradforensicsError, ConnectionError):
    """Loading would have needed the network."""


class LogReadError(GradforensicsError, ValueError):
    """A training log could not be read or holds no usable series."""


class ImportSourceError(GradforensicsError, ValueError):
    """What ``gradforensics import`` was handed is not a series it reads (no checkpoints, no dump, no steps)."""


class MissingShardError(ImportSourceError, FileNotFoundError):
    """A sharded dump lacks a rank's file (tensor-, pipeline- or expert-parallel) for an iteration."""


class ShardMismatchError(ImportSourceError):
    """The shards of one tensor do not fit together (shape, dtype, or a tensor missing from a rank)."""


class LogNotPlacedError(ImportSourceError):
    """A run's side log (Megatron-LM's ``tokens_per_expert/``) does not fit the layout: not read, said why."""


class FlagsSchemaError(GradforensicsError, ValueError):
    """A flags.json document does not follow the schema."""


# interrupts: Ctrl-C that says what was kept (KeyboardInterrupt, so a bare except Exception lets them through)
class CaptureInterrupted(KeyboardInterrupt):
    """Ctrl-C during a capture; ``str()`` says what the store holds (it stays a valid store)."""


class ReportInterrupted(KeyboardInterrupt):
    """Ctrl-C while a verb writes its report into ``--out``; ``str()`` says what is left and how to finish it."""


class WhatIfInterrupted(KeyboardInterrupt):
    """Ctrl-C during a what-if; ``str()`` says which stores hold which steps."""


class Terminated(KeyboardInterrupt):
    """SIGTERM while a multi-rank recorder is open (torchrun stops every rank when one dies).

    Raised in the main thread, like Ctrl-C, so that the ``with`` block unwinds and
    the recorder closes: rank 0 then commits every rank's complete records.
    """


# warnings
class PlotBugWarning(RuntimeWarning):
    """An analysis's ``plot`` raised or drew nothing; the report shows a note instead."""


class CaptureWarning(RuntimeWarning):
    """Something that qualifies what a capture records (rows repeated, no stability verdict possible, ...).

    Raised with :func:`warnings.warn`, so a Python caller can filter it; the command line prints
    each as one line (``gradforensics capture: warning: ...``).
    """


class CompareWarning(UserWarning):
    """Two runs compared are not like for like (versions, data sources): the CLI prints it as one note line."""

