"""Stores at fsspec URLs, against a real S3 HTTP server on loopback (moto's server mode).

The same planted store is written once straight to ``s3://`` by the Recorder and
once to a local directory; every command must see the same store and raise the
same flags from both, also with dask worker processes and with a server that
refuses one request in eight.  The store-safety rules (lock, no overwrite,
confined names, missing chunks) are checked on object storage too.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

from gradforensics.cli import main
from gradforensics.errors import (
    CorruptChunkError,
    CorruptStoreError,
    GradforensicsError,
    NotAStoreError,
    StoreExistsError,
    StoreLockedError,
)
from gradforensics.store import remote, url_reads
from gradforensics.store.layout import dimension_names
from gradforensics.store.lock import StoreLock
from gradforensics.store.reader import Store
from gradforensics.store.remote_lock import RemoteLock
from gradforensics.testing.planted import nonfinite_store
from tests._s3 import BUCKET, FaultyProxy, moto_server

ONLY = "nonfinite,noise,drift"


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    """Each test opens its own zarr stores for the pass's reads (a proxy's endpoint must not reach the next)."""
    url_reads.clear_read_stores()
    yield
    url_reads.clear_read_stores()


@pytest.fixture(scope="module")
def s3():
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def pair(s3, tmp_path_factory):
    """The same planted store at s3:// and on local disk (NaN/Inf in 2 records of one tensor)."""
    local = tmp_path_factory.mktemp("local") / "dump.zarr"
    url = f"s3://{BUCKET}/pair/dump.zarr"
    for path in (local, url):
        nonfinite_store(path, n_records=12, records=(4, 7))
    return url, str(local)


def _flags(out) -> list[tuple]:
    doc = json.loads((out / "flags.json").read_text())
    rows = doc["flags"] if isinstance(doc, dict) else doc
    return sorted((r["kind"], r["tensor"], r.get("head"), round(float(r["severity"]), 9)) for r in rows)


def _s3_client():
    import boto3

    return boto3.client("s3")


# ------------------------------------------------------------------ the whole path
@pytest.mark.slow
def test_s3_store_inspect_analyze_workers_report_match_local(pair, tmp_path, capsys):
    url, local = pair
    assert main(["inspect", url, "--json"]) == 0
    remote_summary = json.loads(capsys.readouterr().out)
    assert main(["inspect", local, "--json"]) == 0
    local_summary = json.loads(capsys.readouterr().out)
    for s in (remote_summary, local_summary):
        s.pop("path")
        s.pop("created")
    assert remote_summary == local_summary

    assert main(["analyze", local, "--out", str(tmp_path / "local"), "--only", ONLY, "--quiet"]) == 0
    assert main(["analyze", url, "--out", str(tmp_path / "s3"), "--only", ONLY, "--workers", "2", "--quiet"]) == 0
    flags = _flags(tmp_path / "s3")
    assert flags == _flags(tmp_path / "local")
    assert ("nonfinite", "layers.1.mlp.up.weight", None) in {f[:3] for f in flags if f[3] > 0.5}

    # analysis results were written back to the same URL: report reads them without a gradient
    assert Store(url, check_chunks=False).has("analysis/findings")
    capsys.readouterr()
    assert main(["report", url, "--out", str(tmp_path / "again")]) == 0
    assert _flags(tmp_path / "again") == flags

    # compare takes a URL too: the same run before and after changes nothing
    from gradforensics.runs.compare import compare

    c = compare(url, local, tmp_path / "cmp", progress=False)
    assert c.rows and not any(r.changed for r in c.rows)


@pytest.mark.slow
def test_a_server_refusing_one_request_in_8_gives_the_same_flags(pair, s3):
    from gradforensics.analysis.engine.run import analyze

    url, local = pair
    opts = {"engine": {"persist": False}}
    want = analyze(local, only="nonfinite,noise", options=opts, progress=False)
    with FaultyProxy(s3, every=8) as proxy:
        store = Store(url, storage_options={"endpoint_url": proxy.endpoint, "skip_instance_cache": True})
        got = analyze(store, only="nonfinite,noise", options=opts, progress=False)
    assert proxy.refused >= 5 and proxy.refused == proxy.seen // 8
    assert [(f.kind, f.tensor, f.head, f.severity) for f in got.flags] == \
        [(f.kind, f.tensor, f.head, f.severity) for f in want.flags]
    assert any(f.kind == "nonfinite" and f.severity > 0.5 for f in got.flags)


def test_transient_errors_are_retried_and_others_are_not():
    from tests.test_remote_throttling import s3_error

    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise s3_error(503, "SlowDown")
        return "ok"

    assert remote.with_retries(flaky, "x", backoff_s=0.001) == "ok" and len(calls) == 3
    calls.clear()

    def missing():
        calls.append(1)
        raise FileNotFoundError("no such key")

    with pytest.raises(FileNotFoundError, match=r"^no such key$"):               # the caller's own error, unwrapped
        remote.with_retries(missing, "x", backoff_s=0.001)
    assert len(calls) == 1


# ------------------------------------------------------------------ errors: one line
@pytest.mark.slow
def test_missing_bucket_is_one_line(s3, capsys):
    assert main(["inspect", "s3://no-such-bucket/dump.zarr"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bucket does not exist" in err


@pytest.mark.slow
def test_missing_store_and_hdf5_url_are_one_line(s3, capsys):
    assert main(["inspect", f"s3://{BUCKET}/absent.zarr"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "zarr.json missing" in err
    assert main(["inspect", f"s3://{BUCKET}/dump.h5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "use a Zarr store" in err


@pytest.mark.slow
def test_refused_credentials_are_one_line(s3, monkeypatch, capsys):
    """With moto's authentication on, unknown keys are refused by the server: one line, exit 2."""
    from moto import settings

    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    rc = main(["inspect", f"s3://{BUCKET}/dump.zarr", "--storage-option", "key=wrong",
               "--storage-option", "secret=wrong", "--storage-option", "skip_instance_cache=true"])
    line = capsys.readouterr().err.strip()
    assert rc == 2
    assert "\n" not in line and "refused the credentials" in line


@pytest.mark.slow
def test_unreachable_endpoint_is_one_line(capsys):
    """Nothing listens on the endpoint (a real closed loopback port): one line after the retries, exit 2."""
    import socket

    with socket.socket() as sock:                   # a free port, closed again: connections are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rc = main(["inspect", f"s3://{BUCKET}/dump.zarr", "--storage-option", f"endpoint_url=http://127.0.0.1:{port}",
               "--storage-option", "key=k", "--storage-option", "secret=s",
               "--storage-option", "config_kwargs.retries.max_attempts=1"])
    line = capsys.readouterr().err.strip()
    assert rc == 2
    assert "\n" not in line and "could not be reached" in line and str(port) in line


def test_storage_options_parse():
    got = remote.parse_options(["anon=true", "client_kwargs.region_name=eu-west-1", "endpoint_url=http://h:9"])
    assert got == {"anon": True, "client_kwargs": {"region_name": "eu-west-1"}, "endpoint_url": "http://h:9"}
    with pytest.raises(GradforensicsError, match="KEY=VALUE"):
        remote.parse_options(["anon"])


# ------------------------------------------------------------------ store safety on object storage
def _tiny(url: str, value: float = 1.0, overwrite: bool = False) -> None:
    """A two-record store with one tensor (few objects: moto answers a request in ~20 ms)."""
    from gradforensics.recording import Recorder

    with Recorder(url, sources=["a"], overwrite=overwrite) as rec:
        for i in range(2):
            rec.record(step=i, loss=1.0, n_samples=4, lr=0.1, source="a",
                       grads={"w": np.full((4, 3), value + i, np.float32)})


@pytest.mark.slow
def test_lock_object_one_writer_and_conditional_create(s3):
    from gradforensics.recording import Recorder

    url = f"s3://{BUCKET}/locked.zarr"
    with Recorder(url, sources=["a"]):
        body = _s3_client().get_object(Bucket=BUCKET, Key="locked.zarr.lock")["Body"].read()
        assert json.loads(body)["pid"] == os.getpid()
        with pytest.raises(StoreLockedError, match="being written by another process"):
            Recorder(url, sources=["a"], overwrite=True)
    assert "Contents" not in _s3_client().list_objects_v2(Bucket=BUCKET, Prefix="locked.zarr.lock")
    # the service honours If-None-Match: * (measured: moto 5.2.5 answers 412 PreconditionFailed)
    a, b = RemoteLock(f"s3://{BUCKET}/race.zarr"), RemoteLock(f"s3://{BUCKET}/race.zarr")
    assert a._create() is True and b._create() is False
    a.release()


@pytest.mark.slow
def test_stale_lock_object_is_taken_over_with_a_warning(s3):
    url = f"s3://{BUCKET}/stale.zarr"
    old = {"host": "elsewhere", "pid": 1, "started": time.time() - 7200, "lease_s": 60.0,
           "heartbeat": time.time() - 3600, "token": "x"}
    _s3_client().put_object(Bucket=BUCKET, Key="stale.zarr.lock", Body=json.dumps(old).encode())
    with pytest.warns(UserWarning, match="took over a stale writer lock"):
        lock = StoreLock(url).acquire()
    lock.release()
    fresh = {**old, "heartbeat": time.time()}
    _s3_client().put_object(Bucket=BUCKET, Key="stale.zarr.lock", Body=json.dumps(fresh).encode())
    with pytest.raises(StoreLockedError, match=re.escape(f"{url} is being written by another process (host elsewhere, pid 1,")):
        StoreLock(url).acquire()


@pytest.mark.slow
def test_no_overwrite_of_a_foreign_prefix(s3):
    from gradforensics.recording import Recorder

    _s3_client().put_object(Bucket=BUCKET, Key="foreign.zarr/data.csv", Body=b"a,b\n")
    with pytest.raises(StoreExistsError, match="refusing to delete"):
        Recorder(f"s3://{BUCKET}/foreign.zarr", sources=["a"], overwrite=True)
    assert _s3_client().get_object(Bucket=BUCKET, Key="foreign.zarr/data.csv")["Body"].read() == b"a,b\n"
    url = f"s3://{BUCKET}/mine.zarr"
    _tiny(url)
    with pytest.raises(StoreExistsError, match="already exists"):
        _tiny(url)
    _tiny(url, value=5.0, overwrite=True)     # a gradforensics store is replaced when asked
    assert Store(url).read("grads/w")[0, 0, 0] == 5.0


@pytest.mark.slow
def test_damage_on_object_storage_is_found(s3):
    url, prefix = f"s3://{BUCKET}/damaged.zarr", "damaged.zarr"
    _tiny(url)
    c = _s3_client()
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")["Contents"]]
    chunk = next(k for k in keys if "/grads/w/c/" in k)
    c.delete_object(Bucket=BUCKET, Key=chunk)
    with pytest.raises(CorruptChunkError, match="grads/w"):
        Store(url)
    c.delete_object(Bucket=BUCKET, Key=f"{prefix}/batches/loss/zarr.json")   # its chunks stay
    with pytest.raises(CorruptStoreError, match=r"no zarr\.json"):
        Store(url)
    c.put_object(Bucket=BUCKET, Key=f"{prefix}/grads/../x", Body=b"")
    keys = {o["Key"] for o in c.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")["Contents"]}
    if f"{prefix}/grads/../x" in keys:      # kept verbatim by the service: refused by name
        with pytest.raises(CorruptStoreError, match=r"'\.\.'"):
            Store(url)
    with pytest.raises(NotAStoreError, match=re.escape(f"s3://{BUCKET}/nothing-here.zarr: ") + ".*expected a gradforensics store"):
        Store(f"s3://{BUCKET}/nothing-here.zarr")


# ------------------------------------------------------------------ xarray and dimension names
def test_dimension_names_rules():
    assert dimension_names("batches/mixture", 2) == ("record", "source")
    assert dimension_names("batches/loss", 1) == ("record",)
    assert dimension_names("grads/a.q", 4, {"heads": 4}) == ("record", "a.q.head", "a.q.ax2", "a.q.ax3")
    assert dimension_names("grads/a.up", 3) == ("record", "a.up.ax1", "a.up.ax2")
    assert dimension_names("weights/a.up", 3) == ("snapshot", "a.up.ax1", "a.up.ax2")
    assert dimension_names("acts/m/hist", 2) == ("record", "m.hist.ax1")


def test_xarray_opens_groups_with_named_dims(tmp_path):
    xr = pytest.importorskip("xarray")
    tensors = {"wide.weight": (48, 16), "narrow.weight": (8, 16), "attn.q.weight": (32, 16)}
    path = tmp_path / "x.zarr"
    nonfinite_store(path, n_records=8, records=(2,), tensor="wide.weight", tensors=tensors,
                    heads={"attn.q.weight": 4})
    store = Store(path)
    ds = xr.open_zarr(path, group="grads", consolidated=False)
    assert ds.sizes["record"] == store.n_records
    assert ds["wide.weight"].dims == ("record", "wide.weight.ax1", "wide.weight.ax2")
    assert ds["attn.q.weight"].dims[:2] == ("record", "attn.q.weight.head")
    assert ds.sizes["attn.q.weight.head"] == 4
    np.testing.assert_array_equal(ds["narrow.weight"].values, store.read("grads/narrow.weight"))
    assert int(np.isnan(ds["wide.weight"].isel(record=2).values).sum()) == 1
    batches = xr.open_zarr(path, group="batches", consolidated=False)
    assert batches["mixture"].dims == ("record", "source")
    assert batches.sizes["source"] == len(store.sources)
    if hasattr(xr, "open_datatree"):
        tree = xr.open_datatree(path, engine="zarr", consolidated=False)
        assert tree["grads"]["wide.weight"].dims[0] == "record"


@pytest.mark.slow
def test_xarray_reads_a_store_at_an_s3_url(pair):
    xr = pytest.importorskip("xarray")
    url, local = pair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = xr.open_zarr(url, group="grads", consolidated=False)
        np.testing.assert_array_equal(ds["layers.0.mlp.up.weight"].values,
                                      Store(local).read("grads/layers.0.mlp.up.weight"))


@pytest.mark.slow
def test_obstore_read_layer_reads_the_same_bytes(pair, monkeypatch):
    pytest.importorskip("obstore")
    from zarr.storage import ObjectStore

    url, local = pair
    monkeypatch.setenv("GRADFORENSICS_READ_LAYER", "obstore")
    assert isinstance(url_reads.read_store(url), ObjectStore)
    got = Store(url).grad("layers.0.attn.q.weight").compute()
    np.testing.assert_array_equal(got, Store(local).grad("layers.0.attn.q.weight").compute())



@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_memory_and_file_urls_give_the_flags_of_a_local_path(scheme, tmp_path):
    from gradforensics.analysis.engine.run import analyze

    url = f"memory://{tmp_path.name}/dump.zarr" if scheme == "memory" else f"file://{tmp_path}/url/dump.zarr"
    truth = nonfinite_store(url, n_records=8, records=(3,)).truth
    nonfinite_store(tmp_path / "local.zarr", n_records=8, records=(3,))
    got = analyze(Store(url), only="nonfinite", progress=False)
    want = analyze(str(tmp_path / "local.zarr"), only="nonfinite", progress=False)
    assert [(f.kind, f.tensor, f.severity) for f in got.flags] == [(f.kind, f.tensor, f.severity) for f in want.flags]
    assert [f.tensor for f in got.flags if f.severity > 0.5] == [truth["tensor"]]
    assert Store(url).has("analysis/findings")          # written back to the URL
    with pytest.raises(StoreExistsError, match=re.escape(f"{url} already exists")):
        nonfinite_store(url, n_records=8, records=(3,))


@pytest.mark.slow
def test_an_oversized_object_in_place_of_a_compressed_chunk_is_refused_from_the_listing(s3, tmp_path):
    """A 64 MiB object where a compressed chunk of a few KiB belongs is refused by its listed size, before any
    download (the issue saw the whole object fetched before the checksum refused it: 1.34 GB RSS for 400 MB)."""
    from tests._hostile import build_store

    url = f"s3://{BUCKET}/oversized.zarr"
    build_store(url, 8, compression="zstd")
    keys = [o["Key"] for o in _s3_client().list_objects_v2(Bucket=BUCKET, Prefix="oversized.zarr/grads/")["Contents"]]
    chunk = next(k for k in keys if "/c/" in k)
    _s3_client().put_object(Bucket=BUCKET, Key=chunk, Body=b"\0" * (64 << 20))
    with pytest.raises(CorruptChunkError, match=r"has 67108864 bytes, not at most \d+ \(a compressed chunk"):
        Store(url)                      # the listing's size decides: the open reads no chunk at all
