"""The forensic pass against the I/O floor: wall time and peak RSS, side by side.

Builds (once; reused when present) a store of ``--gb`` GB of float32 gradients
(``--records`` records of ``--tensors`` square tensors), then runs, each in its
own Python process so peak RSS is that phase's alone:

* ``raw``:   every byte of the gradient chunk files read with plain ``read()``
  (the file-system floor);
* ``read``:  every on-disk chunk of every ``grads/*`` array read and decoded
  through the store, sequentially, one thread (the read floor of the pass);
* ``gram``:  the Gram kernel alone over in-memory slabs of the same total bytes,
  one thread (the compute floor: ``2 N`` flops per gradient element);
* ``pass``:  ``gf.analyze`` with the Gram-based analyses (noise, nonfinite),
  threads (the Gram pass: one ``dask.compute``);
* ``full``:  ``gf.analyze`` with every registered analysis, threads;
* ``dist``:  the ``pass`` on a 2-process ``LocalCluster`` (cluster start-up
  excluded from ``pass_seconds``; ``worker_peak_rss_mb`` per worker).

and prints wall seconds, GB/s, peak RSS and the ratios pass/read.  The page
cache is warm (the store was just written or read), so the floor is the
optimistic one; compare phases within one run.

    python benchmarks/analyze.py                  # 4 GB, 128 records
    python benchmarks/analyze.py --gb 0.5 --records 64 --backend h5
    python benchmarks/analyze.py --gb 1 --phases raw,read,pass --compare-checksums   # cost of chunk checksums
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402  (after the BLAS thread limits)

HERE = Path(__file__).resolve().parent


def build(path: Path, gb: float, records: int, tensors: int, seed: int = 0, checksums: bool = True) -> None:
    """A store of about *gb* GB: *records* records of *tensors* float32 (side, side) tensors."""
    import gradforensics as gf
    from gradforensics.store.layout import LayoutPolicy

    per_tensor = gb * 1e9 / records / tensors / 4
    side = int(np.sqrt(per_tensor)) // 64 * 64
    rng = np.random.default_rng(seed)
    names = [f"layers.{i}.mlp.weight" for i in range(tensors)]
    base = {n: rng.standard_normal((side, side), dtype=np.float32) for n in names}
    with gf.Recorder(path, sources=["a", "b"], mode="training", queue_size=2, overwrite=True,
                     layout=LayoutPolicy(checksums=checksums)) as rec:
        for i in range(records):
            noise = rng.standard_normal((side, side), dtype=np.float32)
            rec.record(step=i, loss=2.0, source="ab"[i % 2], n_samples=32,
                       grads={n: base[n] + noise for n in names})


def _store_bytes(path: Path) -> int:
    from gradforensics.store.reader import Store

    return int(sum(i.nbytes for i in Store(path).grads.values()))


def phase_raw(path: Path) -> dict:
    files = [path] if path.is_file() else [p for p in (path / "grads").rglob("*") if p.is_file()]
    n = 0
    buf = bytearray(16 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while (k := fh.readinto(buf)) > 0:
                n += k
    return {"bytes": n}


def phase_read(path: Path) -> dict:
    """Every on-disk chunk of every gradient array, in order, decoded to float32, one thread."""
    import itertools

    from gradforensics.store.reader import Store

    store = Store(path)
    n = 0
    for info in store.grads.values():
        h = store.handle(info)
        grid = [range(0, s, c) for s, c in zip(info.shape, info.chunks)]
        for starts in itertools.product(*grid):
            sel = tuple(slice(s, min(s + c, dim)) for s, c, dim in zip(starts, info.chunks, info.shape))
            n += h[sel].nbytes
    return {"bytes": n}


def phase_gram(path: Path) -> dict:
    """The compute floor: the Gram kernel over in-memory slabs of the same shape and total bytes, one thread."""
    from gradforensics.analysis.engine.gram import chunk_partial
    from gradforensics.store.reader import Store

    store = Store(path)
    info = next(iter(store.grads.values()))
    n = info.shape[0]
    total = _store_bytes(path)
    slab = np.random.default_rng(0).standard_normal((n, (32 << 20) // (4 * n)), dtype=np.float32)
    from threadpoolctl import threadpool_limits

    done = 0
    with threadpool_limits(limits=1):
        while done < total:
            chunk_partial(slab, None, 0, 0, 0, False)
            done += slab.nbytes
    return {"bytes": done}


def phase_pass(path: Path, only: str | None, slab_mb: float | None) -> dict:
    import gradforensics as gf

    opts: dict = {"engine": {"persist": False}}
    if slab_mb:
        opts["engine"]["slab_bytes"] = int(slab_mb * (1 << 20))
    f = gf.analyze(path, only=only, options=opts, progress=False)
    return {"bytes": _store_bytes(path), "flags": len(f.flags), "analyses": sorted(f.results)}


def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM; ru_maxrss would include the parent's before exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def phase_dist(path: Path, workers: int = 2) -> dict:
    """The Gram pass on a process LocalCluster; RSS is the client's plus every worker's peak."""
    from distributed import Client, LocalCluster

    import gradforensics as gf

    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        t0 = time.perf_counter()
        f = gf.analyze(path, client=client, only="noise,nonfinite", options={"engine": {"persist": False}},
                       progress=False)
        seconds = time.perf_counter() - t0
        worker_rss = client.run(_peak_rss_mb)
    return {"bytes": _store_bytes(path), "flags": len(f.flags), "pass_seconds": seconds,
            "worker_peak_rss_mb": sorted(worker_rss.values())}


def child(args: argparse.Namespace) -> None:
    """Run one phase in this process and print its JSON line.

    Libraries are imported before the clock starts (a cold ``import dask.array,
    zarr, pandas`` costs seconds on a loaded machine and is not I/O).
    """
    import dask.array  # noqa: F401
    import h5py  # noqa: F401
    import pandas  # noqa: F401
    import scipy.stats  # noqa: F401
    import zarr  # noqa: F401

    import gradforensics.analysis  # noqa: F401  (imports every registered analysis)

    path = Path(args.store)
    base_rss = _peak_rss_mb()
    cpu0 = os.times()
    t0 = time.perf_counter()
    if args.phase == "raw":
        out = phase_raw(path)
    elif args.phase == "read":
        out = phase_read(path)
    elif args.phase == "gram":
        out = phase_gram(path)
    elif args.phase == "dist":
        out = phase_dist(path)
    else:
        out = phase_pass(path, "noise,nonfinite" if args.phase == "pass" else None, args.slab_mb)
    out["seconds"] = time.perf_counter() - t0
    cpu1 = os.times()
    out["cpu_seconds"] = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    out["peak_rss_mb"] = _peak_rss_mb()
    out["rss_after_imports_mb"] = base_rss
    print(json.dumps(out))


def run_phase(phase: str, store: Path, slab_mb: float | None) -> dict:
    cmd = [sys.executable, __file__, "--child", phase, "--store", str(store)]
    if slab_mb:
        cmd += ["--slab-mb", str(slab_mb)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"phase {phase} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=4.0)
    p.add_argument("--records", type=int, default=128)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--backend", choices=("zarr", "h5"), default="zarr")
    p.add_argument("--dir", default=str(HERE / "_data"))
    p.add_argument("--slab-mb", type=float, default=None)
    p.add_argument("--phases", default="raw,read,gram,pass,read,pass,full")
    p.add_argument("--rebuild", action="store_true")
    p.add_argument("--delete", action="store_true", help="remove the store afterwards")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--compare-checksums", action="store_true",
                   help="also build the same store without chunk checksums and run every phase on both, interleaved")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.phase = args.child
        child(args)
        return
    stem = f"bench-{args.gb:g}gb-{args.records}r-{args.tensors}t"
    variants = {"": True, "-nocrc": False} if args.compare_checksums else {"": True}
    stores = {tag: Path(args.dir) / f"{stem}{tag}.{args.backend}" for tag in variants}
    for tag, store in stores.items():
        if args.rebuild or not store.exists():
            if store.exists():
                shutil.rmtree(store) if store.is_dir() else store.unlink()
            store.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            build(store, args.gb, args.records, args.tensors, checksums=variants[tag])
            print(f"built {store} in {time.perf_counter() - t0:.1f} s")
    store = stores[""]
    results: dict[str, list[dict]] = {}
    for phase in args.phases.split(","):
        for tag, path in stores.items():
            r = run_phase(phase, path, args.slab_mb)
            results.setdefault(phase + tag, []).append(r)
            gbs = r["bytes"] / 1e9 / r["seconds"]
            print(f"{phase + tag:>11}: {r['seconds']:7.2f} s  {gbs:6.2f} GB/s  cpu {r['cpu_seconds']:7.2f} s  "
                  f"peak RSS {r['peak_rss_mb']:7.0f} MB  ({r['bytes'] / 1e9:.2f} GB)", flush=True)
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in results.items()}
    for phase in args.phases.split(","):
        if f"{phase}-nocrc" in best:
            cost = best[phase]["seconds"] / best[f"{phase}-nocrc"]["seconds"]
            print(f"{phase}: checksummed / unchecksummed time {cost:.2f}x")
    summary = {"store": str(store), "gb": best[next(iter(best))]["bytes"] / 1e9, "records": args.records,
               "cpus": os.cpu_count(), "phases": best}
    if "read" in best:
        for k in ("pass", "full"):
            if k in best:
                ratio = best[k]["seconds"] / best["read"]["seconds"]
                summary[f"{k}_over_read"] = ratio
                print(f"{k}/read time ratio: {ratio:.2f}x   peak RSS {best[k]['peak_rss_mb']:.0f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if args.delete:
        for path in stores.values():
            shutil.rmtree(path) if path.is_dir() else path.unlink()


if __name__ == "__main__":
    main()
