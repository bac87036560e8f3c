"""Writes to object storage that a fenced writer cannot land: every PUT conditional (issue 42).

A writer's lock at a URL is held by lease (:mod:`gradforensics.store.remote_lock`); a
writer frozen past its lease is fenced: another takes the store over.  Checking the lock
before a flush leaves a window - a writer frozen *inside* a flush would, once resumed, still
send that flush's PUTs.  S3 cannot condition a PUT on another object (the lock), but it can
condition it on the object itself, and that is enough:

* a key this writer has not written in this session is written with ``If-None-Match: *``
  (it must not exist);
* a key it has written is rewritten with ``If-Match: <the ETag its own write got>``
  (nobody has written it since).

So a late PUT of a fenced writer fails (412) on every key the new owner has written or
deleted since the takeover - the root ``zarr.json``, every array's metadata, every chunk
it wrote - and lands only on a key the new owner has not written yet: a chunk beyond the
records it has committed, which readers never read (reads stop at the committed count).
When the new owner then writes that key, its own PUT fails with 412; a failed precondition
always asks the writer's lock (:meth:`~gradforensics.store.lock.StoreLock.check`): a writer
whose lock was taken over stops with :class:`~gradforensics.errors.StoreLockedError`, the
owner replaces the object it did not expect (an old writer's leftover, or its own write whose
answer was lost) with a PUT conditioned on that object's ETag.

Deletes are conditional too (issue 42): an object a writer wrote itself in this session is deleted
with ``DeleteObject`` ``If-Match: <the ETag its own write got>`` (S3 has conditional deletes on
general-purpose buckets; moto's server checks ``If-Match`` on DELETE): an object the new owner
has rewritten answers 412 (one it deleted, 404) and the writer asks its lock and stops.  An object
it did not write (an earlier writer's leftover: an unfinished analysis generation) is deleted only
when asked by name or prefix, listed first, the lock checked second, each object then conditional
on the ETag it was listed with: an object the new owner rewrote answers 412, one it created after
the listing is not in it, and a takeover before the check stops the writer.

What no condition can express: a key that *nobody* has written since the takeover.  A writer
asks its lock before creating its arrays, but one frozen between that check and its creation
requests, resumed after a takeover and before the new owner's first record, still creates the
metadata of arrays the owner has not created (``If-None-Match: *`` holds); it stops at its
next flush (its lock check).  The owner replaces the arrays it records
(:meth:`~gradforensics.store.zarr_backend.ZarrBackend.create`); an empty array of a tensor it
does not record stays, and a reader refuses the store naming it.  See
docs/stores-you-did-not-write.md.

Only ``s3://`` (``s3a://``) stores are written this way: other file systems have no
conditional PUT in fsspec.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gradforensics.errors import StoreLockedError

__all__ = ["FENCED_SCHEMES", "fenced_store_class"]

FENCED_SCHEMES = frozenset({"s3", "s3a"})
#: attempts to replace an object this writer did not expect before giving up (another writer keeps writing it)
_REPLACE_ATTEMPTS = 4


def _failed_precondition(exc: BaseException) -> bool:
    """Whether *exc* (s3fs's translation of a PUT's answer) says a condition of the PUT failed."""
    from gradforensics.store.answers import exception_chain, status_of

    if isinstance(exc, FileExistsError):      # s3fs: 412 on If-None-Match
        return True
    for e in exception_chain(exc):
        status, code = status_of(e)
        if status == 412 or code == "PreconditionFailed":
            return True
    return False


def _missing(exc: BaseException) -> bool:
    """Whether *exc* says the object a conditional request named is not there (404), or the service saw a
    conflicting request on it at the same time (409)."""
    from gradforensics.store.answers import exception_chain, status_of

    if isinstance(exc, FileNotFoundError):
        return True
    for e in exception_chain(exc):
        status, code = status_of(e)
        if status in (404, 409) or code in ("NoSuchKey", "NotFound", "ConditionalRequestConflict"):
            return True
    return False


def _key_path(root: str, key: str) -> str:
    """The object path of store key *key* under the store's root path *root*."""
    root = root.rstrip("/")
    return (f"{root}/{key}" if root else key).rstrip("/")


def fenced_store_class() -> type:
    """zarr's ``FsspecStore`` with every ``set`` a conditional PUT (defined on first use: zarr is imported lazily)."""
    global _CLASS
    if _CLASS is None:
        from zarr.storage import FsspecStore

        class FencedFsspecStore(FsspecStore):  # type: ignore[misc]
            """An ``FsspecStore`` whose writes are conditional PUTs (see the module docstring)."""

            #: ``check()`` raises StoreLockedError once this writer's lock is no longer its own (None: not fenced yet)
            check: Callable[[], None] | None = None

            def _etags(self) -> dict[str, str]:
                d = self.__dict__.get("_gf_etags")
                if d is None:
                    d = self.__dict__["_gf_etags"] = {}
                return d

            async def set(self, key: str, value: Any, byte_range: tuple[int, int] | None = None) -> None:
                check = self.check
                if check is None or byte_range is not None:
                    await super().set(key, value, byte_range)
                    return
                if not self._is_open:
                    await self._open()
                self._check_writable()
                path = _key_path(self.path, key)
                data = value.to_bytes()
                etags = self._etags()
                known = etags.get(path)
                cond: dict[str, str] = {"IfMatch": known} if known else {"IfNoneMatch": "*"}
                for _ in range(_REPLACE_ATTEMPTS):
                    try:
                        out = await self.fs._pipe_file(path, data, **cond)
                    except FileNotFoundError:       # If-Match on a key deleted since: someone else's store now
                        pass
                    except Exception as exc:
                        if not _failed_precondition(exc):
                            raise
                    else:
                        etag = out.get("ETag") if isinstance(out, dict) else None
                        if isinstance(etag, str) and etag:
                            etags[path] = etag
                        else:
                            etags.pop(path, None)
                        return
                    # the object is not what this writer left there: is the store still ours?
                    _, now = await self._recheck(check, path)
                    cond = {"IfMatch": now} if now else {"IfNoneMatch": "*"}
                raise StoreLockedError(f"{self.path}: {key} keeps being replaced by another writer while this one "
                                       "owns the store's lock; stop writing and check who else writes here.")

            async def delete(self, key: str) -> None:
                if self.check is None:
                    await super().delete(key)
                    return
                self._check_writable()
                path = _key_path(self.path, key)
                if path in self._etags():
                    await self._delete_own(path)
                else:
                    await self._delete_leftovers(path)

            async def delete_dir(self, prefix: str) -> None:
                if self.check is None:
                    await super().delete_dir(prefix)
                    return
                self._check_writable()
                root = _key_path(self.path, prefix)
                for path in sorted(p for p in self._etags() if p == root or p.startswith(root + "/")):
                    await self._delete_own(path)
                await self._delete_leftovers(root)

            async def _recheck(self, check: Callable[[], None], path: str) -> tuple[bool, str | None]:
                """After an unexpected answer: the lock checked (StoreLockedError once it is another's), then
                whether *path* exists and its ETag now (None when it has none)."""
                await asyncio.to_thread(check)
                try:
                    info = await self.fs._info(path, refresh=True)
                except FileNotFoundError:
                    return False, None
                now = info.get("ETag")
                return True, now if isinstance(now, str) and now else None

            async def _delete_leftovers(self, root: str) -> None:
                """Delete what this writer did not write at or under *root* (an earlier writer's leftovers: an
                unfinished analysis generation, an old array), each conditional on the ETag it had when listed.

                The listing comes first, the lock check second: a takeover before the check stops this writer,
                and an object the new owner rewrites after it answers 412 (its ETag changed); objects created
                after the listing are not in it.  So only objects already there before the takeover can go.
                """
                check = self.check
                assert check is not None
                try:
                    found = await self.fs._find(root, detail=True)
                except FileNotFoundError:
                    found = {}
                if not found:
                    try:
                        found = {root: await self.fs._info(root, refresh=True)}
                    except FileNotFoundError:
                        return
                listed = {p: i.get("ETag") for p, i in found.items() if isinstance(i, dict) and i.get("type") != "directory"}
                await asyncio.to_thread(check)
                own = self._etags()
                client = await self.fs.set_session()
                for path, etag in sorted(listed.items()):
                    if path in own or not (isinstance(etag, str) and etag):
                        continue
                    bucket, key, _ = self.fs.split_path(path)
                    try:
                        await client.delete_object(Bucket=bucket, Key=key, IfMatch=etag)
                    except Exception as exc:
                        if not (_failed_precondition(exc) or _missing(exc)):
                            raise
                    self.fs.invalidate_cache(path)

            async def _delete_own(self, path: str) -> None:
                """Delete *path* if this writer wrote it, conditioned on the ETag its write got (else leave it)."""
                etags = self._etags()
                known = etags.get(path)
                if known is None:
                    return
                check = self.check
                assert check is not None
                bucket, key, _ = self.fs.split_path(path)
                client = await self.fs.set_session()
                for _ in range(_REPLACE_ATTEMPTS):
                    try:
                        await client.delete_object(Bucket=bucket, Key=key, IfMatch=known)
                    except Exception as exc:
                        if not (_failed_precondition(exc) or _missing(exc)):
                            raise
                    else:
                        etags.pop(path, None)
                        self.fs.invalidate_cache(path)
                        return
                    # not what this writer left there: is the store still ours?
                    there, now = await self._recheck(check, path)
                    if not there:
                        etags.pop(path, None)
                        return                       # gone already (our own delete whose answer was lost)
                    if now is None:
                        break
                    known = now                      # still ours: the object left there goes
                raise StoreLockedError(f"{self.path}: {path} keeps being replaced by another writer while this one "
                                       "owns the store's lock; stop writing and check who else writes here.")

        _CLASS = FencedFsspecStore
    return _CLASS


_CLASS: type | None = None
