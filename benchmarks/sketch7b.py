"""A 7B-shaped sketch store written and analysed end to end, on a real local dask cluster.

Issue 46's item 4.  The store is shaped like a 7B LLaMA's sketch dump (32 layers x 7 weight
matrices = 224 tensors, q/k/v/o in 32 heads: 4,320 units; a sketch of ``k = 1024`` floats a
head, and one a whole tensor for gate/up/down): 17.2 MB a record.  Every record is written
through the project's :class:`~gradforensics.store.writer.StoreWriter`, as the recorder
writes it (the same array names, attributes and head split), with synthetic sketches:
Gaussian noise drawn from a pool (a window at a random offset a tensor) plus a mean per data
source (three sources, round robin), so the data-source statistics have something to find.

Then a child process starts a ``LocalCluster`` of ``--workers`` single-threaded worker
processes (``processes=True``), runs :func:`gradforensics.analyze` with it while the
scheduler's task stream records every task, and reports:

* wall, CPU (the client's and every worker's, user + system) and peak RSS (``VmHWM``) of the
  client and of the largest worker;
* the task stream by task prefix (``dask.utils.key_split``): count, compute seconds (sum,
  mean, max), transfer seconds, result bytes; the pass's span (first start to last stop);
* the scheduler's overhead per task, measured on the same cluster: ``--noop`` independent
  no-op tasks computed through the client, wall / tasks.

The store is deleted at the end (``--keep`` keeps it).  ``--json`` writes the figures.

    python benchmarks/sketch7b.py --records 2000 --out /tmp/gf-sketch7b --json /tmp/sketch7b.json
    python benchmarks/sketch7b.py --records 64 --layers 2 --out /tmp/gf-s7 # a quick check
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
from typing import Any

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402  (after the BLAS thread limits)

SOURCES = ("zh", "en", "code")
PROJ = ("q", "k", "v", "o", "gate", "up", "down")
POOL = 1 << 25                        # floats of noise drawn once (128 MiB); each tensor reads a window of it


def build(path: Path, layers: int, heads: int, k: int, records: int, seed: int = 0) -> dict[str, float]:
    """Write a *records*-record sketch store through ``StoreWriter``; its size and the seconds it took."""
    from gradforensics.store.heads import HeadSpec
    from gradforensics.store.schema import BATCH_FIELDS, batch_path, new_meta, sketch_path
    from gradforensics.store.writer import Row, StoreWriter

    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(POOL, dtype=np.float32)
    names, attrs, sizes = [], [], []
    for L in range(layers):
        for p in PROJ:
            name = f"model.layers.{L}.{'self_attn' if p in 'qkvo' else 'mlp'}.{p}_proj.weight"
            shape = (4096, 4096) if p in "qkvo" else ((11008, 4096) if p != "down" else (4096, 11008))
            a: dict[str, Any] = {"source_dtype": "bfloat16", "shape": list(shape), "seed": 0, "k": k,
                                 "method": "countsketch", "block": 1 << 20, "encoding": "float32"}
            if p in "qkvo":
                a.update(HeadSpec(heads, axis=1 if p == "o" else 0, role=p).attrs())
            names.append(name)
            attrs.append(a)
            sizes.append(heads * k if p in "qkvo" else k)
    # one mean per source and unit, 0.05 of the noise's scale, read from the pool's start
    means = [pool[s * max(sizes):s * max(sizes) + max(sizes)] * np.float32(0.05) for s in range(len(SOURCES))]
    meta = new_meta(list(SOURCES), "training", model={"class": "LlamaForCausalLM (synthetic sketches)"})
    t0, cpu0 = time.perf_counter(), time.process_time()
    offsets = rng.integers(0, POOL - max(sizes), size=(records, len(names)))
    writer = StoreWriter(path, meta, expected_records=records)
    try:
        for i in range(records):
            s = i % len(SOURCES)
            rows: dict[str, Row] = {}
            for j, (name, a, n) in enumerate(zip(names, attrs, sizes, strict=True)):
                data = pool[offsets[i, j]:offsets[i, j] + n] + means[s][:n]
                split = n != k
                rows[sketch_path(name)] = Row(data.reshape(heads, k) if split else data, a, head_split=split)
            mix = np.zeros(len(SOURCES), np.float32)
            mix[s] = 1
            for field, value in (("step", i), ("loss", 2.0 + 0.1 * np.sin(i / 7)), ("mixture", mix),
                                 ("n_samples", 1024), ("rank", 0), ("lr", 3e-4), ("time", float(i))):
                rows[batch_path(field)] = Row(np.asarray(value, dtype=BATCH_FIELDS[field]))
            writer.append(rows)
    finally:
        writer.close()
    wall = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"write_wall_s": wall, "write_cpu_s": time.process_time() - cpu0, "store_bytes": float(nbytes),
            "record_bytes": float(sum(sizes) * 4)}


def _hwm_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _noop(i: int) -> int:
    return i


def _by_prefix(stream: list[dict[str, Any]]) -> tuple[dict[str, dict[str, float]], float, float]:
    """Task stream -> {prefix: count, compute/transfer seconds, bytes}, the first start and the last stop."""
    from dask.utils import key_split

    out: dict[str, dict[str, float]] = {}
    first, last = float("inf"), float("-inf")
    for rec in stream:
        row = out.setdefault(key_split(rec["key"]), {"tasks": 0, "compute_s": 0.0, "max_s": 0.0,
                                                     "transfer_s": 0.0, "bytes": 0.0})
        row["tasks"] += 1
        for ss in rec.get("startstops", ()):
            d = ss["stop"] - ss["start"]
            first, last = min(first, ss["start"]), max(last, ss["stop"])
            if ss["action"] == "compute":
                row["compute_s"] += d
                row["max_s"] = max(row["max_s"], d)
            elif ss["action"] == "transfer":
                row["transfer_s"] += d
        nb = rec.get("nbytes")
        row["bytes"] += float(sum(nb.values()) if isinstance(nb, dict) else (nb or 0))
    return out, first, last


def child(store: str, workers: int, noop: int) -> dict[str, Any]:
    """Analyse *store* on a local cluster; every figure the parent prints."""
    import dask
    import psutil
    from distributed import Client, LocalCluster, get_task_stream

    import gradforensics as gf

    me = psutil.Process()
    out: dict[str, Any] = {}
    t = time.perf_counter()
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        out["start_s"] = time.perf_counter() - t
        pids = list(client.run(os.getpid).values())
        cpu_before = {p.pid: sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)]}
        t = time.perf_counter()
        with get_task_stream(client) as ts:
            f = gf.analyze(store, client=client, progress=False)
        out["wall_s"] = time.perf_counter() - t
        cpu_after = {p.pid: sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)]}
        out["client_cpu_s"] = cpu_after[me.pid] - cpu_before.get(me.pid, 0.0)
        out["worker_cpu_s"] = sum(cpu_after.get(p, 0.0) - cpu_before.get(p, 0.0) for p in pids)
        out["other_cpu_s"] = sum(v - cpu_before.get(p, 0.0) for p, v in cpu_after.items()
                                 if p != me.pid and p not in pids)        # the nannies, the scheduler's helpers
        out["worker_rss_mb"] = max(_hwm_mb(p) for p in pids)
        prefixes, first, last = _by_prefix(ts.data)
        out["prefixes"] = prefixes
        out["tasks"] = sum(r["tasks"] for r in prefixes.values())
        out["pass_span_s"] = last - first if prefixes else 0.0
        # the scheduler's cost per task on this cluster: independent no-op tasks, wall / tasks
        tasks = [dask.delayed(_noop, pure=False)(i) for i in range(noop)]
        client.compute(tasks[:50], sync=True)                               # warm
        t = time.perf_counter()
        client.compute(tasks, sync=True)
        out["noop_s_per_task"] = (time.perf_counter() - t) / max(noop, 1)
    out["client_rss_mb"] = _hwm_mb(os.getpid())
    out["flags"] = len(f.flags)
    out["flag_kinds"] = sorted({fl.kind for fl in f.flags})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2, help="worker processes, one thread each")
    ap.add_argument("--noop", type=int, default=4000, help="no-op tasks timed for the scheduler's overhead")
    ap.add_argument("--out", type=Path, required=True, help="a directory for the store (deleted after)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the store")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.workers, args.noop)), flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"sketch-{args.layers}x{args.heads}-k{args.k}-n{args.records}.zarr"
    free = shutil.disk_usage(args.out).free
    need = args.layers * (4 * args.heads + 3) * args.k * 4 * args.records
    if need > 0.8 * free:
        raise SystemExit(f"the store needs {need / 1e9:.1f} GB; {free / 1e9:.1f} GB free under {args.out}")
    if path.exists():
        shutil.rmtree(path)                          # this script's own store, left by an interrupted run
    try:
        built = build(path, args.layers, args.heads, args.k, args.records)
        print(f"wrote {args.records:,} records, {built['store_bytes'] / 1e9:.2f} GB "
              f"({built['record_bytes'] / 1e6:.1f} MB a record) in {built['write_wall_s']:.0f} s wall, "
              f"{built['write_cpu_s']:.0f} CPU-s; writer peak RSS "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB", flush=True)
        cmd = [sys.executable, __file__, "--child", str(path), "--workers", str(args.workers), "--noop",
               str(args.noop), "--out", str(args.out)]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            raise SystemExit(f"analyze failed:\n{p.stderr[-4000:]}")
        res = {**json.loads(lines[-1]), **built, "records": args.records, "layers": args.layers,
               "heads": args.heads, "k": args.k, "workers": args.workers}
    finally:
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
    cpu = res["client_cpu_s"] + res["worker_cpu_s"] + res["other_cpu_s"]
    print(f"analyze: wall {res['wall_s']:.0f} s, CPU {cpu:.0f} s (client {res['client_cpu_s']:.0f}, workers "
          f"{res['worker_cpu_s']:.0f}, other {res['other_cpu_s']:.0f}), peak RSS client "
          f"{res['client_rss_mb']:.0f} MB, worker {res['worker_rss_mb']:.0f} MB; {res['tasks']:,} tasks over "
          f"{res['pass_span_s']:.0f} s; {res['flags']} flags; scheduler {res['noop_s_per_task'] * 1e3:.2f} ms a "
          f"no-op task")
    print(f"{'prefix':40s} {'tasks':>6s} {'compute s':>10s} {'mean ms':>8s} {'max s':>7s} {'xfer s':>7s} {'MB out':>8s}")
    for name, r in sorted(res["prefixes"].items(), key=lambda kv: -kv[1]["compute_s"]):
        print(f"{name[:40]:40s} {r['tasks']:6d} {r['compute_s']:10.2f} {1e3 * r['compute_s'] / r['tasks']:8.2f} "
              f"{r['max_s']:7.2f} {r['transfer_s']:7.2f} {r['bytes'] / 1e6:8.1f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
