"""``benchmarks/analyze.py --url URL``: the pass from object storage vs the same store on local disk.

The local store is copied byte for byte to *URL* (``s3://bucket/prefix.zarr``
with credentials and endpoint from the environment, or ``moto`` for an S3
server on loopback started here, in its own process so it does not share this
interpreter's GIL), then, interleaved and each in its own process:

* ``pass`` on the local path and on the URL (``gf.analyze`` with noise and
  nonfinite, threads): wall seconds, GB/s and their ratio; ``pass-url-obstore``
  the same with ``GRADFORENSICS_READ_LAYER=obstore``;
* ``layer``: every ``grads/*`` array read whole through zarr's ``FsspecStore``
  (s3fs) and through zarr's ``ObjectStore`` over obstore (if installed), to say
  which store layer is faster here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MOTO_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def moto_process() -> Iterator[str]:
    """An S3 server (moto) on a free loopback port, as a child process; yields its endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **MOTO_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def upload(local: Path, url: str) -> float:
    """Copy the store directory *local* to *url*; seconds taken."""
    from gradforensics.store import remote

    fs, root = remote.filesystem(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)
    t0 = time.perf_counter()
    files = [p for p in local.rglob("*") if p.is_file()]
    fs.put([str(p) for p in files], [f"{root}/{p.relative_to(local).as_posix()}" for p in files])
    return time.perf_counter() - t0


def read_layer(url: str, layer: str) -> dict[str, Any]:
    """Read every grads/* array of the store at *url* whole through one zarr store layer."""
    import numpy as np
    import zarr

    from gradforensics.store import remote
    from gradforensics.store.reader import Store

    names = [i.name for i in Store(url).grads.values()]
    if layer == "fsspec":
        store: Any = remote.zarr_store(url, True)
    else:
        from obstore.store import S3Store
        from zarr.storage import ObjectStore

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        s3 = S3Store(bucket, prefix=prefix, endpoint=endpoint, region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
                     client_options={"allow_http": True} if endpoint and endpoint.startswith("http:") else None)
        store = ObjectStore(s3, read_only=True)
    t0 = time.perf_counter()
    total = 0
    for name in names:
        total += np.asarray(zarr.open_array(store, path=name, mode="r")[...]).nbytes
    return {"bytes": total, "seconds": time.perf_counter() - t0}


def _child(code: str) -> dict[str, Any]:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         cwd=str(Path(__file__).resolve().parent))
    if res.returncode:
        raise SystemExit(f"benchmark child failed:\n{res.stderr}")
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def compare(local: Path, url: str, repeats: int, run_phase: Any) -> dict[str, Any]:
    """Upload, then the pass and the layer reads, local vs URL, interleaved; prints and returns the best of each."""
    if url == "moto":
        with moto_process() as endpoint:
            os.environ.update(MOTO_ENV, AWS_ENDPOINT_URL=endpoint)
            import boto3

            boto3.client("s3").create_bucket(Bucket="bench")
            return compare(local, "s3://bench/" + local.name, repeats, run_phase)
    up = upload(local, url)
    print(f"uploaded {local} to {url} in {up:.1f} s", flush=True)
    results: dict[str, list[dict[str, Any]]] = {}
    layers = ["fsspec"]
    try:
        import obstore  # noqa: F401

        layers.append("obstore")
    except ImportError:
        print("obstore not installed: the FsspecStore layer only", flush=True)
    for _ in range(repeats):
        for tag, where in (("local", str(local)), ("url", url)):
            results.setdefault(f"pass-{tag}", []).append(run_phase("pass", where, None))
        if "obstore" in layers:          # the pass with its chunk reads through obstore (opt-in layer)
            os.environ["GRADFORENSICS_READ_LAYER"] = "obstore"
            try:
                results.setdefault("pass-url-obstore", []).append(run_phase("pass", url, None))
            finally:
                del os.environ["GRADFORENSICS_READ_LAYER"]
        for layer in layers:
            code = f"import json, _remote; print(json.dumps(_remote.read_layer({url!r}, {layer!r})))"
            results.setdefault(f"read-{layer}", []).append(_child(code))
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in results.items()}
    for k, r in best.items():
        print(f"{k:>14}: {r['seconds']:7.2f} s  {r['bytes'] / 1e9 / r['seconds']:6.3f} GB/s", flush=True)
    ratio = best["pass-url"]["seconds"] / best["pass-local"]["seconds"]
    print(f"pass from {url.split('://')[0]}:// / pass from local disk: {ratio:.2f}x time", flush=True)
    if "read-obstore" in best:
        lr = best["read-fsspec"]["seconds"] / best["read-obstore"]["seconds"]
        print(f"read through FsspecStore / through obstore: {lr:.2f}x time", flush=True)
    return {"url": url, "upload_seconds": up, "phases": best, "url_over_local": ratio}
