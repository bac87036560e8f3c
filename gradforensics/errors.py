"""Errors gradforensics raises on bad input.

Every error is a :class:`GradforensicsError`; subclasses also inherit the
matching built-in exception so ``except FileNotFoundError`` still works.  The
message is one line: what, where, expected vs found, and what to do.  The CLI
prints it on stderr and exits with code 2; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


class GradforensicsError(Exception):
    """Base class of every error gradforensics raises on bad input."""


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


class StoreClosedError(GradforensicsError, RuntimeError):
    """The store or recorder was used after it was closed."""


class StoreExistsError(GradforensicsError, FileExistsError):
    """A new store was asked for at a path that already holds something."""


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
