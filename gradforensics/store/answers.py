"""What an exception of an HTTP client (botocore, aiohttp, s3fs's translations) says the server answered.

Shared by the retry layer (:mod:`gradforensics.store.remote`) and the conditional writes of a fenced writer
(:mod:`gradforensics.store.fenced`).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["exception_chain", "status_of"]


def status_of(exc: BaseException) -> tuple[int | None, str | None]:
    """``(HTTP status, error code)`` an exception of an HTTP client carries, each None when it says none."""
    status: int | None = None
    code: str | None = None
    resp = getattr(exc, "response", None)
    if isinstance(resp, Mapping):                                 # botocore ClientError
        meta = resp.get("ResponseMetadata")
        got = meta.get("HTTPStatusCode") if isinstance(meta, Mapping) else None
        status = got if isinstance(got, int) else None
        err = resp.get("Error")
        c = err.get("Code") if isinstance(err, Mapping) else None
        code = c if isinstance(c, str) and c else None
        if status is None and code is not None and code.isdigit():
            status = int(code)
    if status is None:
        for attr in ("status", "status_code", "code"):            # aiohttp, azure, gcsfs
            got = getattr(exc, attr, None)
            if isinstance(got, int) and not isinstance(got, bool) and 100 <= got <= 599:
                status = got
                break
    return status, code


def exception_chain(exc: BaseException) -> list[BaseException]:
    """*exc* and its causes / contexts, outermost first (each once)."""
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not x for x in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out
