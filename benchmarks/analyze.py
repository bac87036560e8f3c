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

and prints wall seconds, GB/s, peak RSS (the child process's high-water mark)
and the ratios Gram-pass / read-floor and full-pass / read-floor.  The page
cache is warm (the store was just written or read), so the floor is the
optimistic one; compare phases within one run.

``--long N`` runs the phases on the planted long-history store instead
(:func:`gradforensics.testing.planted_long.long_history_store`: N training-mode
records, oscillations confined to stretches, a rotating mean, a mid-run source
conflict, healthy tensors) and checks that ``full`` finds each planted truth over
the right records.  ``--table`` runs read, pass and full (best of two each) on
the 1 GB and 4 GB stores and the 100,000-record long-history store and prints one
table: RSS flat in N and store size, and both ratios.

    python benchmarks/analyze.py                  # 4 GB, 128 records
    python benchmarks/analyze.py --gb 0.5 --records 64 --backend h5
    python benchmarks/analyze.py --gb 1 --phases raw,read,pass --compare-checksums   # cost of chunk checksums
    python benchmarks/analyze.py --long 100000 --phases read,pass,full   # the long-history regime, truths checked
    python benchmarks/analyze.py --table          # 1 GB, 4 GB and 100k records in one table
    python benchmarks/analyze.py --table --configs "1 GB" --before /tmp/old   # against older code, side by side
    python benchmarks/analyze.py --gb 0.5 --url moto    # the pass from S3 on loopback vs local disk (_remote.py)
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
    from gradforensics.analysis.engine.gramkernel import chunk_partial
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
    flags = [[fl.kind, fl.tensor, fl.severity, list(fl.records)] for fl in f.flags if fl.severity >= 0.5]
    return {"bytes": _store_bytes(path), "flags": len(f.flags), "analyses": sorted(f.results),
            "regime": f.header.get("regime"), "records": f.n_records, "flags_above_half": flags}


def check_truths(flags: list, n: int) -> list[str]:
    """What the full pass on the planted long-history store got right and wrong, one line each."""
    from gradforensics.testing.planted_long import long_history_arrays

    truth = long_history_arrays(n, 0)[2]
    found = {(k, t): tuple(r) for k, t, _, r in flags}
    lines, w = [], max(1, -(-n // 128)) * 4
    for name, spec in truth["oscillation"].items():
        lo, hi = spec["records"]
        got = found.get(("oscillation", name))
        ok = got is not None and abs(got[0] - lo) <= w and abs(got[1] - hi) <= w
        lines.append(f"{'ok' if ok else 'MISSED'}: oscillation {name} period {spec['period']} in {lo}-{hi}: {got}")
    got = found.get(("conflict", truth["conflict"]["tensor"]))
    ok = got is not None and abs(got[0] - n // 2) <= n / 8
    lines.append(f"{'ok' if ok else 'MISSED'}: conflict since {n // 2}: {got}")
    ok = ("drift", truth["drift"]) in found and ("oscillation", truth["drift"]) not in found
    lines.append(f"{'ok' if ok else 'WRONG'}: drift {truth['drift']} flagged as drift, not as oscillation")
    healthy = [k for k in found if k[1] in truth["healthy"]]
    lines.append(f"{'ok' if not healthy else 'WRONG'}: healthy tensors flagged: {healthy}")
    return lines


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
    zarr, pandas, distributed, scipy.signal`` costs seconds on a loaded machine,
    once per process, and is neither I/O nor analysis).
    """
    import dask.array  # noqa: F401
    import distributed  # noqa: F401  (dask's get_scheduler imports it on every compute when installed)
    import h5py  # noqa: F401
    import pandas  # noqa: F401
    import scipy.signal  # (the loss-curve analyses)
    import scipy.sparse.linalg  # (spectral's Lanczos)
    import scipy.stats  # noqa: F401
    import zarr  # noqa: F401

    import gradforensics.analysis  # (imports every registered analysis)

    path = args.store if "://" in args.store else Path(args.store)    # a URL stays a string (--url)
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
    out["code"] = str(Path(gradforensics.analysis.__file__).parent.parent)     # which gradforensics ran
    print(json.dumps(out))


def build_long(path: Path, n: int) -> None:
    from gradforensics.testing.planted_long import long_history_store

    long_history_store(path, n=n)


TABLE = (("1 GB", {"gb": 1.0}), ("4 GB", {"gb": 4.0}), ("100k records", {"long": 100_000}))


def table(args: argparse.Namespace) -> None:
    """Read floor, Gram pass and full pass of every configuration in :data:`TABLE`.

    Each phase runs ``--reps`` times (2); the table shows the best wall time and, separately,
    the least CPU time of the repeats (on a shared machine both are noisy upwards only).

    With ``--before DIR`` (a tree holding an older ``gradforensics``, e.g. ``git archive HEAD
    gradforensics | tar -x -C DIR``) the Gram and full passes of that code run interleaved with
    this code's, same stores, same processes' set-up, and a before/after line follows each store.
    """
    rows = []
    configs = [c for c in TABLE if not args.configs or c[0] in args.configs.split(",")]
    for label, cfg in configs:
        store = _ensure(args, cfg.get("gb", args.gb), cfg.get("long"))
        best: dict[str, dict] = {}
        phases = ["read", "pass", "full"] + (["pass@before", "full@before"] if args.before else [])
        for phase in phases * args.reps:
            name, _, tag = phase.partition("@")
            r = run_phase(name, store, args.slab_mb, args.before if tag else args.after)
            if phase not in best or r["seconds"] < best[phase]["seconds"]:
                best[phase] = {**r, "cpu_seconds": min(r["cpu_seconds"], best.get(phase, r)["cpu_seconds"])}
            else:       # the best wall time and, separately, the least CPU time of the repeats
                best[phase]["cpu_seconds"] = min(best[phase]["cpu_seconds"], r["cpu_seconds"])
            print(f"  {label:>13} {phase:>11}: {r['seconds']:7.2f} s  cpu {r['cpu_seconds']:7.2f} s  "
                  f"peak RSS {r['peak_rss_mb']:6.0f} MB", flush=True)
        if args.before:
            for ph in ("pass", "full"):
                b, a, rd = best[f"{ph}@before"], best[ph], best["read"]
                print(f"    {ph} before -> after: wall {b['seconds']:.2f} -> {a['seconds']:.2f} s "
                      f"({b['seconds'] / a['seconds']:.2f}x faster), cpu {b['cpu_seconds']:.2f} -> "
                      f"{a['cpu_seconds']:.2f} s ({b['cpu_seconds'] / a['cpu_seconds']:.2f}x); over read (cpu): "
                      f"{b['cpu_seconds'] / rd['cpu_seconds']:.2f}x -> {a['cpu_seconds'] / rd['cpu_seconds']:.2f}x",
                      flush=True)
        if cfg.get("long"):
            for line in check_truths(best["full"]["flags_above_half"], int(cfg["long"])):
                print("   ", line)
        rows.append((label, best))
    print("\n(wall s / cpu s; the ratios are of wall time, then of CPU time)\n"
          "| store | GB | records | regime | read | Gram pass | full pass | Gram pass / read | "
          "full pass / read | peak RSS pass MB | peak RSS full MB |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for label, b in rows:
        regime = (b["full"].get("regime") or {}).get("name", "?")
        r, p_, f = b["read"], b["pass"], b["full"]
        print(f"| {label} | {r['bytes'] / 1e9:.3f} | {f.get('records', '')} | {regime} | "
              f"{r['seconds']:.2f} / {r['cpu_seconds']:.2f} | {p_['seconds']:.2f} / {p_['cpu_seconds']:.2f} | "
              f"{f['seconds']:.2f} / {f['cpu_seconds']:.2f} | "
              f"{p_['seconds'] / r['seconds']:.2f}x / {p_['cpu_seconds'] / r['cpu_seconds']:.2f}x | "
              f"{f['seconds'] / r['seconds']:.2f}x / {f['cpu_seconds'] / r['cpu_seconds']:.2f}x | "
              f"{p_['peak_rss_mb']:.0f} | {f['peak_rss_mb']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows), indent=2))


def _ensure(args: argparse.Namespace, gb: float, long: int | None) -> Path:
    """The benchmark store of this configuration, built when absent (or with ``--rebuild``)."""
    if long:
        store = Path(args.dir) / f"bench-long-{long}r.zarr"
    else:
        store = Path(args.dir) / f"bench-{gb:g}gb-{args.records}r-{args.tensors}t.{args.backend}"
    if args.rebuild or not store.exists():
        if store.exists():
            shutil.rmtree(store) if store.is_dir() else store.unlink()
        store.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        if long:
            build_long(store, long)
        else:
            build(store, gb, args.records, args.tensors)
        print(f"built {store} in {time.perf_counter() - t0:.1f} s", flush=True)
    return store


def run_phase(phase: str, store: Path, slab_mb: float | None, pythonpath: str | None = None) -> dict:
    """One phase in a child process; *pythonpath* first on its path (``--before``: the older code)."""
    cmd = [sys.executable, __file__, "--child", phase, "--store", str(store)]
    if slab_mb:
        cmd += ["--slab-mb", str(slab_mb)]
    env = None
    if pythonpath:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
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
    p.add_argument("--url", default=None, metavar="URL",
                   help="copy the store to URL (s3://bucket/x.zarr, or 'moto' for an S3 server on loopback) and "
                        "compare the pass from there with the pass from local disk (see benchmarks/_remote.py)")
    p.add_argument("--long", type=int, default=None, metavar="N",
                   help="use the planted long-history store of N records (and check its truths)")
    p.add_argument("--table", action="store_true", help="1 GB, 4 GB and 100k-record runs in one table")
    p.add_argument("--reps", type=int, default=2, help="--table: runs of each phase (best wall, least CPU)")
    p.add_argument("--configs", default=None, metavar="LABELS",
                   help="--table rows to run, comma-separated among '1 GB', '4 GB', '100k records' (default all)")
    p.add_argument("--before", default=None, metavar="DIR",
                   help="--table: also run the passes with DIR first on PYTHONPATH (older code), side by side")
    p.add_argument("--after", default=None, metavar="DIR",
                   help="--table with --before: DIR first on PYTHONPATH for the other runs (default: the installed "
                        "code; a tree of HEAD plus one's own files keeps others' work in progress out)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.phase = args.child
        child(args)
        return
    if args.table:
        table(args)
        return
    stem = f"bench-{args.gb:g}gb-{args.records}r-{args.tensors}t"
    variants = {"": True, "-nocrc": False} if args.compare_checksums else {"": True}
    stores = {tag: Path(args.dir) / f"{stem}{tag}.{args.backend}" for tag in variants}
    if args.long:
        stores = {"": _ensure(args, args.gb, args.long)}
    for tag, store in stores.items():
        if args.rebuild or not store.exists():
            if store.exists():
                shutil.rmtree(store) if store.is_dir() else store.unlink()
            store.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            build(store, args.gb, args.records, args.tensors, checksums=variants[tag])
            print(f"built {store} in {time.perf_counter() - t0:.1f} s")
    store = stores[""]
    if args.url:
        import _remote

        summary = _remote.compare(store, args.url, 2, run_phase)
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
        return
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
        for k, label in (("pass", "Gram-pass / read-floor"), ("full", "full-pass / read-floor")):
            if k in best:
                ratio = best[k]["seconds"] / best["read"]["seconds"]
                summary[f"{k}_over_read"] = ratio
                print(f"{label}: {ratio:.2f}x   peak RSS {best[k]['peak_rss_mb']:.0f} MB")
    if args.long and "full" in best:
        for line in check_truths(best["full"]["flags_above_half"], args.long):
            print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if args.delete:
        for path in stores.values():
            shutil.rmtree(path) if path.is_dir() else path.unlink()


if __name__ == "__main__":
    main()
