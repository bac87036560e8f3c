"""The exact Gram pass over many records: one task per record block against one per pair, side by side.

A store of ``--records`` records (default 4,096; ~340 MB) holding one head-split tensor
(4 heads of 16 x 128, 32 KiB a record) and one of 48 x 256 (48 KiB a record, chunks of
whole rows wider than 2N floats: at N = 4,096 all records of a chunk exceed both the slab
and the K they feed, so the record axis is split in blocks) is built once under ``--dir``
by the current code; then the Gram matrices of every tensor and head are computed
(``gram_graphs`` + ``dask.compute``, threads) by the current code and, with ``--before
DIR`` (an older ``gradforensics`` package, ``git archive <commit> gradforensics | tar -x
-C DIR``), by the older one, each in its own process, repeats interleaved.  Printed per
run: tasks, CPU seconds (user + system), wall seconds, peak RSS, and the largest
difference between the two codes' Gram matrices relative to their largest entry.

    python benchmarks/gram_pass.py --before /tmp/old                   # default slab, 128 MiB
    python benchmarks/gram_pass.py --before /tmp/old --slab-mb 32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402  (after the BLAS thread limits)

SHAPES = {"l0.attn.q": (64, 128), "l0.mlp": (48, 256)}


def build(path: Path, records: int) -> None:
    import gradforensics as gf

    rng = np.random.default_rng(0)
    base = {k: rng.standard_normal(s, dtype=np.float32) for k, s in SHAPES.items()}
    with gf.Recorder(path, sources=["a", "b"], heads={"l0.attn.q": 4}, overwrite=True,
                     expected_records=records) as rec:
        for i in range(records):
            rec.record(step=i, loss=2.0, source="ab"[i % 2], n_samples=32,
                       grads={k: (0.3 * v + rng.standard_normal(v.shape, dtype=np.float32)) for k, v in base.items()})


def child(store: str, slab_mb: float, sample: str, workers: int) -> None:
    import dask

    from gradforensics.analysis.engine.gram import gram_graphs
    from gradforensics.store.reader import Store

    s = Store(store)
    graphs = gram_graphs(s, slab_bytes=int(slab_mb * (1 << 20)))
    tasks = sum(len(g.__dask_graph__()) for g in graphs.values())
    t0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = dask.compute(graphs, scheduler="threads", num_workers=workers)[0]
    wall = time.perf_counter() - w0
    t1 = resource.getrusage(resource.RUSAGE_SELF)
    idx = np.arange(0, s.n_records, 37)
    np.savez(sample, **{f"{g.tensor}|{g.head}": g.gram[np.ix_(idx, idx)] for res in out.values() for g in res})
    print(json.dumps({"tasks": tasks, "cpu": t1.ru_utime + t1.ru_stime - t0.ru_utime - t0.ru_stime, "wall": wall,
                      "rss_mb": t1.ru_maxrss / 1024}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=4096)
    ap.add_argument("--slab-mb", type=float, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--before", type=Path, default=None)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sample", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.slab_mb, args.sample, args.workers)
        return 0
    root = args.dir or Path(tempfile.mkdtemp(prefix="gf-grampass-"))
    root.mkdir(parents=True, exist_ok=True)
    store = root / f"gram2-N{args.records}.zarr"
    if not store.exists():
        build(store, args.records)
    codes = {"after": os.environ.get("PYTHONPATH", ""), **({"before": str(args.before)} if args.before else {})}
    runs: dict[str, list[dict]] = {c: [] for c in codes}
    for rep in range(args.repeat):
        for code, pp in codes.items():
            sample = root / f"sample-{code}.npz"
            cmd = [sys.executable, __file__, "--child", str(store), "--slab-mb", str(args.slab_mb),
                   "--sample", str(sample), "--workers", str(args.workers)]
            r = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=pp), check=True, capture_output=True, text=True)
            runs[code].append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(rep, code, runs[code][-1], flush=True)
    mb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store) for f in fs) / 1e6
    print(f"{args.records:,} records, {mb:.0f} MB on disk, slab {args.slab_mb:g} MiB, {args.workers} threads")
    for code, rs in runs.items():
        cpu, wall, rss = ([r[k] for r in rs] for k in ("cpu", "wall", "rss_mb"))
        print(f"{code:<7} tasks {rs[0]['tasks']:>5}  CPU s {min(cpu):6.2f} / {statistics.median(cpu):6.2f}  "
              f"wall s {min(wall):6.2f} / {statistics.median(wall):6.2f}  peak RSS {max(rss):6.0f} MB")
    if args.before:
        a, b = np.load(root / "sample-after.npz"), np.load(root / "sample-before.npz")
        rel = max(float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()) for k in b.files)
        print(f"Gram matrices, after vs before (every 37th record): largest difference {rel:.2e} of the largest entry")
    return 0


if __name__ == "__main__":
    sys.exit(main())
