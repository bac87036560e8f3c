"""Fenced writers on object storage (issue 25): a writer whose lease ran out writes nothing into the new owner's store.

Two real writer processes against a real S3 server (moto's server mode on loopback),
each posing as its own host (``socket.gethostname``), with a 2-second lease:
writer A records, is frozen with SIGSTOP past its lease, writer B takes the store
over and writes records 5000-5005, then A is resumed.  A must stop with
``StoreLockedError`` at its next flush, and the store must hold exactly B's records.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pytest.importorskip("moto")
pytest.importorskip("s3fs")
from _s3 import BUCKET, moto_server

WRITER = textwrap.dedent("""
    import os, socket, sys, time
    import numpy as np
    socket.gethostname = lambda: sys.argv[2]            # this process plays another machine
    import gradforensics as gf
    from gradforensics.errors import StoreLockedError
    url, first, count, pause = sys.argv[1], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    freeze_at = float(os.environ.get("FREEZE_AT_STEP", "nan"))
    if freeze_at == freeze_at:     # freeze this process inside the flush of that step: checked, chunks not written
        import signal
        from gradforensics.store.zarr_backend import ZarrBackend
        real_write_rows = ZarrBackend.write_rows
        def write_rows(self, name, start, data):
            if name == "grads/w" and float(data.flat[0]) == freeze_at:
                print("FROZEN", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            return real_write_rows(self, name, start, data)
        ZarrBackend.write_rows = write_rows
    if os.environ.get("FREEZE_AT_CREATE"):   # freeze inside its first record: lock checked, no array created yet
        import signal
        from gradforensics.store.zarr_backend import ZarrBackend
        real_create = ZarrBackend.create
        def create(self, *args, **kwargs):
            if not self._open:
                print("FROZEN", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            return real_create(self, *args, **kwargs)
        ZarrBackend.create = create
    if os.environ.get("FREEZE_AT_DELETE"):   # freeze inside close's re-chunking: lock checked, arrays not yet deleted
        import signal
        from gradforensics.store.zarr_backend import ZarrBackend
        real_delete = ZarrBackend.delete
        def delete(self, name):
            print("FROZEN", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            return real_delete(self, name)
        ZarrBackend.delete = delete
    tensor = os.environ.get("TENSOR", "w")
    rpc = None if os.environ.get("FREE_CHUNKS") else 1   # free: fewer records than a chunk are re-chunked at close
    # background=False: record() returns once its flush is committed, so the test freezes A between flushes
    rec = gf.Recorder(url, sources=["a"], mode="training", records_per_chunk=rpc, overwrite=True, background=False)
    if os.environ.get("FREEZE_BEFORE_FIRST"):      # opened (store created, lock held), no record yet
        import signal
        print("FROZEN", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    if os.environ.get("WAIT_BEFORE_FIRST"):
        print("OPENED", flush=True)
        time.sleep(float(os.environ["WAIT_BEFORE_FIRST"]))
    try:
        for i in range(first, first + count):
            rec.record(step=i, loss=float(i), source="a", grads={tensor: np.full((4, 8), float(i), np.float32)})
            print(i, flush=True)
            time.sleep(pause)
        rec.close()
    except StoreLockedError as exc:
        print("LOCKED", exc, flush=True)
        os._exit(3)
    print("DONE", flush=True)
""")


@pytest.fixture(scope="module")
def s3():
    with moto_server() as endpoint:
        yield endpoint


def _writer(url: str, host: str, first: int, count: int, pause: float,
            freeze_at: int | None = None, **flags: str) -> subprocess.Popen[str]:
    env = {**os.environ, "GRADFORENSICS_LOCK_LEASE_S": "2", "OMP_NUM_THREADS": "1", **flags}
    if freeze_at is not None:
        env["FREEZE_AT_STEP"] = str(freeze_at)
    return subprocess.Popen([sys.executable, "-c", WRITER, url, host, str(first), str(count), str(pause)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_a_writer_frozen_past_its_lease_writes_nothing_into_the_new_owners_store(s3):
    from gradforensics.store.reader import Store

    url = f"s3://{BUCKET}/fenced.zarr"
    a = _writer(url, "host-a", 1000, 50, 1.0)
    assert a.stdout is not None
    for line in a.stdout:                      # A has committed a few records and sleeps between them
        if int(line) >= 1002:
            break
    a.send_signal(signal.SIGSTOP)              # frozen outside a flush, lock held
    try:
        time.sleep(3.0)                        # past A's 2 s lease
        b = _writer(url, "host-b", 5000, 6, 0.0)
        out, err = b.communicate(timeout=120)
        assert b.returncode == 0 and out.strip().endswith("DONE"), err[-2000:]
        assert "took over a stale writer lock" in err and "host host-a" in err
    finally:
        a.send_signal(signal.SIGCONT)
    rest, a_err = a.communicate(timeout=120)
    assert a.returncode == 3, (rest, a_err[-2000:])
    assert "LOCKED" in rest and "was taken over" in rest
    store = Store(url)
    assert store.n_records == 6
    np.testing.assert_array_equal(store.batches()["step"], np.arange(5000, 5006))
    w = store.grad("w").compute()
    np.testing.assert_array_equal(w[:, 0, 0], np.arange(5000, 5006, dtype=np.float32))   # not one record of A's


def test_takeover_bumps_the_fencing_token_and_a_lost_create_response_is_recognised(s3, monkeypatch):
    import boto3

    from gradforensics.store.remote_lock import RemoteLock

    url = f"s3://{BUCKET}/fence.zarr"
    old = {"host": "elsewhere", "pid": 1, "started": time.time() - 7200, "lease_s": 60.0,
           "heartbeat": time.time() - 3600, "token": "x", "fence": 4}
    client = boto3.client("s3")
    client.put_object(Bucket=BUCKET, Key="fence.zarr.lock", Body=json.dumps(old).encode())
    with pytest.warns(UserWarning, match="took over a stale writer lock"):
        lock = RemoteLock(url).acquire()
    doc = json.loads(client.get_object(Bucket=BUCKET, Key="fence.zarr.lock")["Body"].read())
    assert doc["fence"] == 5 and lock.check()["token"] == doc["token"]     # still ours
    client.put_object(Bucket=BUCKET, Key="fence.zarr.lock", Body=json.dumps({**doc, "token": "other"}).encode())
    from gradforensics.errors import StoreLockedError

    with pytest.raises(StoreLockedError, match="was taken over"):
        lock.check()
    client.delete_object(Bucket=BUCKET, Key="fence.zarr.lock")

    # The create lands but its response is lost (the connection drops after the PUT): the retry sees the
    # object exist (412); reading it back finds this writer's own token, so the lock is taken, not refused
    # as "another process".
    from gradforensics.store import remote

    lost = RemoteLock(f"s3://{BUCKET}/lost.zarr")
    fs = remote.filesystem(lost.url)[0]          # fsspec's cached instance: the lock's own
    real_pipe = fs.pipe_file
    dropped: list[str] = []

    def pipe_then_drop_connection(path, value, **kwargs):
        out = real_pipe(path, value, **kwargs)
        if kwargs.get("mode") == "create" and not dropped:
            dropped.append(path)
            raise ConnectionResetError("connection reset by peer")
        return out
    monkeypatch.setattr(fs, "pipe_file", pipe_then_drop_connection)
    lost.acquire()
    assert dropped
    lost.check()
    monkeypatch.undo()
    lost.release()
    assert "Contents" not in client.list_objects_v2(Bucket=BUCKET, Prefix="lost.zarr.lock")


@pytest.mark.slow
@pytest.mark.parametrize("b_records", [6, 2])
def test_a_writer_frozen_inside_a_flush_lands_no_byte_in_the_new_owners_store(s3, b_records):
    """Issue 42: A frozen *inside* its flush of step 1002 (its lock checked, the chunk not yet written), past its
    lease; B takes over and writes *b_records*; A resumes.  Before: A's in-flight chunk landed in B's store
    (``grads/w`` = [5000, 5001, 1002, ...]).  Now every PUT of a writer is conditional (If-None-Match / If-Match
    on its own ETag): A's chunk PUT fails, A asks its lock and stops; with 2 records of B, A's chunk would land
    on a key B never wrote, beyond B's committed records, where no reader looks."""
    from gradforensics.store.reader import Store

    url = f"s3://{BUCKET}/fenced-inflight-{b_records}.zarr"
    a = _writer(url, "host-a", 1000, 50, 0.0, freeze_at=1002)
    assert a.stdout is not None
    for line in a.stdout:
        if line.strip() == "FROZEN":
            break
    try:
        time.sleep(3.0)                         # past A's 2 s lease, A stopped inside its flush
        b = _writer(url, "host-b", 5000, b_records, 0.0)
        out, err = b.communicate(timeout=120)
        assert b.returncode == 0 and out.strip().endswith("DONE"), err[-2000:]
    finally:
        a.send_signal(signal.SIGCONT)
    rest, a_err = a.communicate(timeout=120)
    assert a.returncode == 3, (rest, a_err[-2000:])
    assert "LOCKED" in rest
    store = Store(url)
    assert store.n_records == b_records
    np.testing.assert_array_equal(store.batches()["step"], np.arange(5000, 5000 + b_records))
    w = store.grad("w").compute()
    np.testing.assert_array_equal(w[:, 0, 0], np.arange(5000, 5000 + b_records, dtype=np.float32))
    assert (w == w[:, :1, :1]).all()           # every byte of every record is B's


def _objects(prefix: str) -> dict[str, str]:
    """``{key: ETag}`` of every object under *prefix* in the bucket."""
    import boto3

    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


@pytest.mark.slow
def test_a_writer_frozen_before_its_deletes_deletes_nothing_of_the_new_owners(s3):
    """Issue 42: A records 2 records (fewer than a chunk), closes, and freezes in the re-chunking of its close
    (lock checked, its arrays about to be deleted and created again), past its lease; B takes over and writes 6
    records of the same tensor; A resumes.  Before: A's deletes were unconditional - B's ``grads/w`` (metadata and
    chunks) went, A created its own empty one in its place, and B's store was refused ("grads/w holds 0 rows; the
    store commits 6").  Now A deletes only what it wrote, each ``If-Match`` its own ETag: the first answers 412, A
    asks its lock and stops; B's objects are exactly as B left them."""
    from gradforensics.store.reader import Store

    url = f"s3://{BUCKET}/fenced-delete.zarr"
    a = _writer(url, "host-a", 1000, 2, 0.0, FREEZE_AT_DELETE="1", FREE_CHUNKS="1")
    assert a.stdout is not None
    for line in a.stdout:
        if line.strip() == "FROZEN":
            break
    try:
        time.sleep(3.0)                         # past A's 2 s lease
        b = _writer(url, "host-b", 5000, 6, 0.0)
        out, err = b.communicate(timeout=120)
        assert b.returncode == 0 and out.strip().endswith("DONE"), err[-2000:]
        left_by_b = _objects("fenced-delete.zarr/")
    finally:
        a.send_signal(signal.SIGCONT)
    rest, a_err = a.communicate(timeout=120)
    assert a.returncode == 3, (rest, a_err[-2000:])
    assert "LOCKED" in rest and "was taken over" in rest
    assert _objects("fenced-delete.zarr/") == left_by_b          # not one object of B's deleted, added or replaced
    store = Store(url)
    assert store.n_records == 6
    w = store.grad("w").compute()
    np.testing.assert_array_equal(w[:, 0, 0], np.arange(5000, 5006, dtype=np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before_first", "at_create"])
def test_a_writer_frozen_before_its_first_record_creates_no_array_in_the_new_owners_store(s3, where):
    """Issue 42: A opens its store and freezes before its first record, past its lease; B takes over, opens the store
    and waits before its first record; A resumes and records.  Before: A's array creations were PUTs of keys nobody
    had written since the takeover (``If-None-Match: *`` held), so A's empty ``grads/w`` stayed in B's store, which
    records tensor ``v``; B itself crashed on A's ``batches/step`` (zarr's ``ContainsArrayError`` traceback).  Now
    A asks its lock before creating its arrays and stops there: B's store holds B's objects only.

    ``at_create``: A froze *after* that check, inside its first array's creation - the bound no S3 condition
    expresses (docs/stores-you-did-not-write.md): A's ``batches/*`` and ``grads/w`` land; B replaces the arrays it
    records (it owns the lock), and the empty ``grads/w`` of A is refused by a reader in one line naming it."""
    from gradforensics.store.reader import Store

    url = f"s3://{BUCKET}/fenced-create-{where}.zarr"
    a = _writer(url, "host-a", 1000, 3, 0.0, **{f"FREEZE_{where.upper()}": "1"})
    assert a.stdout is not None
    for line in a.stdout:
        if line.strip() == "FROZEN":
            break
    time.sleep(3.0)                             # past A's 2 s lease
    b = _writer(url, "host-b", 5000, 6, 0.0, WAIT_BEFORE_FIRST="6", TENSOR="v")
    try:
        assert b.stdout is not None
        for line in b.stdout:
            if line.strip() == "OPENED":
                break
    finally:
        a.send_signal(signal.SIGCONT)
    rest, a_err = a.communicate(timeout=120)
    out, err = b.communicate(timeout=120)
    assert b.returncode == 0 and out.strip().endswith("DONE"), err[-2000:]
    assert a.returncode == 3, (rest, a_err[-2000:])
    assert "LOCKED" in rest and "was taken over" in rest
    prefix = url.split("/", 3)[3]
    stranger = [k for k in _objects(prefix + "/") if k.startswith(prefix + "/grads/w/")]
    if where == "at_create":
        from gradforensics.errors import CorruptChunkError

        assert stranger == [prefix + "/grads/w/zarr.json"]          # metadata only, no chunk
        with pytest.raises(CorruptChunkError, match=r"grads/w holds 0 rows; the store commits 6"):
            Store(url)
        boto3 = pytest.importorskip("boto3")
        boto3.client("s3").delete_object(Bucket=BUCKET, Key=stranger[0])     # the remedy the docs give
    else:
        assert not stranger
    store = Store(url)
    assert store.n_records == 6
    np.testing.assert_array_equal(store.grad("v").compute()[:, 0, 0], np.arange(5000, 5006, dtype=np.float32))
