"""A throttling or failing S3 service (issue 42): 503 SlowDown and 500 InternalError are retried, by status.

Against a real S3 server on loopback (moto's server mode) behind :class:`~tests._s3.FaultyProxy`,
which answers the first K requests of a kind (:class:`~tests._s3.FirstK`) with the S3 error XML of
a 503 SlowDown or a 500 InternalError before forwarding the rest.  s3fs turns such an answer, once
botocore's own attempts are spent, into ``OSError(EBUSY, "Please reduce your request rate.")``,
whose words name no status: the retry is decided by the status and the exception's type, never by
the message.  A service that answers every request so is given up on in one line naming the store and
the operation, and nothing more on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

from gradforensics.cli import main
from gradforensics.errors import StoreUnreachableError
from gradforensics.store import remote, url_reads
from gradforensics.testing.planted import nonfinite_store
from tests._s3 import BUCKET, FaultyProxy, FirstK, moto_server

ONLY = "nonfinite,noise"


def s3_error(status: int, code: str, operation: str = "GetObject") -> OSError:
    """What s3fs raises for an S3 error answer: botocore's ClientError, translated by s3fs."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    err = ClientError({"Error": {"Code": code, "Message": "Please reduce your request rate."},
                       "ResponseMetadata": {"HTTPStatusCode": status}}, operation)
    out = translate_boto_error(err)
    assert isinstance(out, OSError)
    return out


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    url_reads.clear_read_stores()
    remote.reset_retry_budget()
    yield
    url_reads.clear_read_stores()


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def url(s3: str) -> str:
    u = f"s3://{BUCKET}/throttled/dump.zarr"
    nonfinite_store(u, n_records=12, records=(4, 7))
    return u


def _flags(out) -> list[tuple]:
    doc = json.loads((out / "flags.json").read_text())
    rows = doc["flags"] if isinstance(doc, dict) else doc
    return sorted((r["kind"], r["tensor"], r.get("head"), round(float(r["severity"]), 9)) for r in rows)


def test_retried_by_status_and_type_not_by_words() -> None:
    busy = s3_error(503, "SlowDown")
    assert "503" not in str(busy) and "slow" not in str(busy).lower()     # the words say nothing of a status
    assert remote.is_transient(busy) and remote.is_transient(s3_error(500, "InternalError"))
    assert remote.is_transient(s3_error(429, "TooManyRequests")) and remote.is_transient(s3_error(400, "Throttling"))
    bare = OSError(busy.errno, str(busy))                 # s3fs's translation without its cause (set_cause=False)
    assert remote.is_transient(bare)
    assert not remote.is_transient(s3_error(404, "NoSuchKey")) and not remote.is_transient(s3_error(403, "AccessDenied"))
    assert not remote.is_transient(s3_error(400, "InvalidArgument"))
    assert not remote.is_transient(OSError("503 SlowDown: retry"))    # words without a status: not a status
    assert not remote.is_transient(ValueError("500 internal error"))
    def busy() -> None:
        raise s3_error(503, "SlowDown")

    with pytest.raises(StoreUnreachableError) as info:
        remote.with_retries(busy, "s3://b/x", attempts=2, backoff_s=0.001)
    line = str(info.value)
    assert line.startswith("s3://b/x: GetObject failed: the storage service kept answering 503 SlowDown")
    assert "2 attempts in" in line and "\n" not in line


@pytest.fixture(scope="module")
def clean_flags(url, tmp_path_factory) -> list[tuple]:
    out = tmp_path_factory.mktemp("clean")
    assert main(["analyze", url, "--out", str(out), "--only", ONLY, "--quiet"]) == 0
    return _flags(out)


@pytest.mark.slow
@pytest.mark.parametrize(("status", "which"), [(503, "chunk GET"), (500, "result PUT")])
def test_analyze_rides_out_the_first_answers_of_503_or_500(url, s3, clean_flags, tmp_path, status, which,
                                                           capsys) -> None:
    """Before: the first chunk GETs answered 503 ended ``analyze`` with ``OSError: [Errno 16] Please reduce your
    request rate.``; the result-commit PUTs likewise.  Now both are retried and the flags are those of a clean run."""
    kind = (lambda m, p: m == "GET" and "/c/" in p) if which == "chunk GET" else \
        (lambda m, p: m == "PUT" and "/analysis/" in p)
    fail = FirstK(3, kind, status)      # more than botocore's 2 requests of one attempt (max_attempts=1 here)
    with FaultyProxy(s3, every=0, fail=fail) as proxy, warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        rc = main(["analyze", url, "--out", str(tmp_path / "faulty"), "--only", ONLY, "--quiet",
                   "--storage-option", f"endpoint_url={proxy.endpoint}",
                   "--storage-option", "config_kwargs.retries.max_attempts=1",
                   "--storage-option", "skip_instance_cache=true"])
    assert rc == 0, capsys.readouterr().err
    assert fail.failed == 3
    assert _flags(tmp_path / "faulty") == clean_flags


@pytest.mark.slow
def test_a_service_answering_503_to_everything_is_one_line_naming_store_and_operation(url, s3, tmp_path) -> None:
    for which, op in (("all", "listing the store failed"), ("put", "failed")):
        kind = (lambda m, p: True) if which == "all" else (lambda m, p: m == "PUT" and "/analysis/" in p)
        with FaultyProxy(s3, every=0, fail=FirstK(None, kind, 503)) as proxy:
            res = subprocess.run(
                [sys.executable, "-m", "gradforensics", "analyze", url, "--out", str(tmp_path / which), "--only", ONLY,
                 "--quiet", "--storage-option", f"endpoint_url={proxy.endpoint}",
                 "--storage-option", "config_kwargs.retries.max_attempts=1"],
                capture_output=True, text=True, timeout=300,
                env={**os.environ, "GRADFORENSICS_REMOTE_DEADLINE_S": "8", "OMP_NUM_THREADS": "1"})
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]     # before: coroutine tracebacks after it
        line = lines[0]
        assert line.startswith(f"gradforensics analyze: error: {url}: ") and op in line, line
        assert "kept answering 503 SlowDown" in line and "attempts in" in line
        if which == "put":
            assert "creating analysis/" in line or "writing" in line, line
