"""Threads against ``--workers 2``, side by side: CPU, wall and peak RSS of the client and the workers.

Two stores (built once under ``--dir`` with ``benchmarks/shape.py``'s builder, reused when present):

* ``heads``: the realistic heads store (24 LLaMA-shaped layers, q/k/v/o in 8 heads, 936
  units, ``--d 32``, ``--records`` records: 126 MB at 128), where the per-unit statistics
  after the Gram pass are most of the work;
* ``big``: a store of ``--big-gb`` GB (``--big-layers`` layers at a real head width,
  d = 256: heads of 32 x 256 floats), several times the memory each worker is allowed
  (``--worker-mb``, dask's ``memory_limit``: the nanny kills a worker past 95 % of it).

Each measurement is one child process running ``gf.analyze`` either on threads (the
default: the machine's cores, one BLAS thread each) or on a ``LocalCluster`` of two
single-threaded worker processes (``processes=True``), as ``--workers 2`` starts.
Threads run under the same budget, enforced the way dask enforces its workers' (a
watchdog polls the process's RSS every 50 ms and kills it past ``--threads-mb``):
``RLIMIT_AS`` counts reserved address space, which numpy and OpenBLAS reserve far
beyond what they touch, so it fails runs that fit.  The child reports:

* CPU seconds of the client and of every process under it (the nannies and workers,
  read with psutil just before the cluster closes), user + system;
* wall seconds of ``gf.analyze`` (and of starting the cluster, apart), and of the
  analyses after the pass (their ``compute`` + ``flags``, timed in the client);
* peak RSS (``VmHWM``) of the client and of the largest worker;
* a digest of every table and flag (``shape.py``'s): threads and workers must agree.

Repeats are interleaved (threads, workers, threads, ...); min and median are printed.
The big store is deleted at the end unless ``--keep``.

    python benchmarks/workers.py --records 128 --repeat 2
    python benchmarks/workers.py --only big --big-gb 3.5 --worker-mb 1024 --threads-mb 2048 --repeat 2
    python benchmarks/workers.py --only heads --before /tmp/old     # both codes (git archive <commit> gradforensics)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import parse_or_child  # noqa: E402
from shape import _digest, build  # noqa: E402


def _hwm_mb(pid: int) -> float:
    """Peak resident set (``VmHWM``) of process *pid* in MB, 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _watchdog(limit_mb: float) -> None:
    """Kill this process when its RSS passes *limit_mb* (as dask's nanny does its workers)."""
    import psutil

    me = psutil.Process()

    def watch() -> None:
        while True:
            if me.memory_info().rss / 2**20 > limit_mb:
                print(json.dumps({"killed": f"RSS above {limit_mb:.0f} MB"}), flush=True)
                os._exit(3)
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()


def _timed_analyses() -> dict[str, float]:
    """Wall seconds of every analysis's ``compute`` + ``flags`` (in the client), summed under ``"all"``."""
    import dataclasses

    from gradforensics.analysis.contract.registry import REGISTRY

    spent = {"all": 0.0}

    def wrap(fn):
        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["all"] += time.perf_counter() - t
        return wrapped

    for name, a in list(REGISTRY.items()):
        REGISTRY[name] = dataclasses.replace(a, compute=wrap(a.compute), flags=wrap(a.flags))
    return spent


def _tree_cpu(me) -> dict[int, float]:
    """User + system CPU seconds of *me* and of every process under it, by pid."""
    import psutil

    out = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            c = p.cpu_times()
            out[p.pid] = c.user + c.system
        except psutil.Error:
            pass
    return out


def child(args: argparse.Namespace) -> None:
    import psutil

    import gradforensics as gf

    me = psutil.Process()
    spent = _timed_analyses()
    out: dict = {}
    if args.child == "threads":
        if args.threads_mb:
            _watchdog(args.threads_mb)
        t = time.perf_counter()
        f = gf.analyze(args.store, progress=False)
        out["wall_s"] = time.perf_counter() - t
        cpu = me.cpu_times()
        out.update(cpu_s=cpu.user + cpu.system, client_cpu_s=cpu.user + cpu.system, start_s=0.0, worker_rss_mb=0.0)
    else:
        from distributed import Client, LocalCluster

        t = time.perf_counter()
        limit = f"{args.worker_mb}MiB" if args.worker_mb else "auto"
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                          memory_limit=limit) as cluster, Client(cluster) as client:
            out["start_s"] = time.perf_counter() - t
            at_start = _tree_cpu(me)
            t = time.perf_counter()
            f = gf.analyze(args.store, client=client, progress=False)
            out["wall_s"] = time.perf_counter() - t
            at_end = _tree_cpu(me)
            workers = client.run(os.getpid)
            out.update(cpu_s=sum(at_end.values()), worker_rss_mb=max(_hwm_mb(pid) for pid in workers.values()),
                       client_cpu_s=at_end[me.pid],
                       worker_cpu_s=sum(at_end[p] for p in workers.values()),
                       worker_cpu_in_analyze_s=sum(at_end[p] - at_start.get(p, 0.0) for p in workers.values()),
                       startup_cpu_s=sum(at_start.values()))
    out.update(post_s=spent["all"], client_rss_mb=_hwm_mb(os.getpid()), flags=len(f.flags), digest=_digest(f))
    print(json.dumps(out), flush=True)


def run_child(mode: str, store: Path, args: argparse.Namespace) -> dict:
    mode, _, code = mode.partition("@")
    env = {**os.environ, "PYTHONPATH": str(Path(args.before).resolve()) if code == "before" else str(HERE.parent)}
    cmd = [sys.executable, __file__, "--child", mode, "--store", str(store)]
    if args.worker_mb:
        cmd += ["--worker-mb", str(args.worker_mb)]
    if args.threads_mb:
        cmd += ["--threads-mb", str(args.threads_mb)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = [ln for ln in p.stdout.strip().splitlines() if ln.startswith("{")]
    if lines and "killed" in json.loads(lines[-1]):
        return {**json.loads(lines[-1]), "cpu_s": float("nan"), "wall_s": float("nan")}
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{mode} {store} failed:\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def _mm(rows: list[dict], key: str) -> str:
    xs = [r[key] for r in rows if key in r]
    return f"{min(xs):8.2f} {statistics.median(xs):8.2f}" if xs else f"{'-':>8} {'-':>8}"


def compare(args: argparse.Namespace, stores: list[tuple[str, Path]]) -> None:
    res: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeat):                  # interleaved: a change in machine load hits both alike
        for label, path in stores:
            for mode in ("threads", "workers", *(("threads@before", "workers@before") if args.before else ())):
                res.setdefault((label, mode), []).append(run_child(mode, path, args))
    print(f"{'store':6} {'mode':14} {'cpu min':>8} {'cpu med':>8} {'wall min':>8} {'wall med':>8} "
          f"{'post min':>8} {'post med':>8} {'start':>6} {'client MB':>9} {'worker MB':>9}  findings;  "
          "CPU client / workers (of which in analyze) min")
    for (label, mode), rows in res.items():
        killed = [r["killed"] for r in rows if "killed" in r]
        ok = [r for r in rows if "killed" not in r]
        if not ok:
            print(f"{label:6} {mode:14} killed: {killed[0]}")
            continue
        print(f"{label:6} {mode:14} {_mm(ok, 'cpu_s')} {_mm(ok, 'wall_s')} {_mm(ok, 'post_s')} "
              f"{min(r['start_s'] for r in ok):6.2f} {max(r['client_rss_mb'] for r in ok):9.0f} "
              f"{max(r['worker_rss_mb'] for r in ok):9.0f}  {ok[0]['flags']} flags, {ok[0]['digest']}"
              + (f"  ({len(killed)} killed)" if killed else "")
              + f";  {min(r['client_cpu_s'] for r in ok):.2f} / {min(r.get('worker_cpu_s', 0.0) for r in ok):.2f} "
              f"({min(r.get('worker_cpu_in_analyze_s', 0.0) for r in ok):.2f})")
    for label, _ in stores:
        a, b = res[(label, "workers")], res[(label, "threads")]
        if any("killed" in r for r in a + b):
            continue
        every = [r for (lab, _), rows in res.items() if lab == label for r in rows]
        same = "same" if len({r["digest"] for r in every}) == 1 else "DIFFER"
        print(f"{label}: workers/threads cpu {_ratio(a, b, 'cpu_s')}, wall {_ratio(a, b, 'wall_s')}, "
              f"post-pass wall {_ratio(a, b, 'post_s')}; findings {same} (every mode and code)")
        for mode in ("threads", "workers") if args.before else ():
            a, b = res[(label, mode)], res[(label, f"{mode}@before")]
            print(f"{label} {mode}: after/before cpu {_ratio(a, b, 'cpu_s')}, wall {_ratio(a, b, 'wall_s')}, "
                  f"client rss {max(r['client_rss_mb'] for r in a) / max(r['client_rss_mb'] for r in b):.2f}")


def _ratio(a: list[dict], b: list[dict], key: str) -> str:
    return (f"{min(r[key] for r in a) / min(r[key] for r in b):.2f} (min) / "
            f"{statistics.median(r[key] for r in a) / statistics.median(r[key] for r in b):.2f} (median)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/gf-workers")
    ap.add_argument("--records", type=int, default=128, help="records of the heads store")
    ap.add_argument("--big-gb", type=float, default=3.5, help="bytes of the big store's gradients")
    ap.add_argument("--big-layers", type=int, default=8)
    ap.add_argument("--worker-mb", type=int, default=None, help="memory limit of each worker (dask's memory_limit)")
    ap.add_argument("--threads-mb", type=int, default=None, help="RSS past which the threads run is killed")
    ap.add_argument("--only", choices=("heads", "big"), default=None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the big store")
    ap.add_argument("--before", default=None, metavar="DIR",
                    help="a directory holding an older gradforensics/: both modes of both codes, interleaved")
    parsed = parse_or_child(ap, child, verb=True)
    if parsed is None:
        return None
    args, root = parsed
    stores, made = [], []
    if args.only in (None, "heads"):
        p = root / f"heads-L24-d32-N{args.records}.zarr"
        if not p.exists():
            build(p, "heads", 24, 32, args.records, None)
        stores.append(("heads", p))
    if args.only in (None, "big"):
        per_record = args.big_layers * 10 * 256 * 256 * 4           # shape.shapes("heads", L, 256): 10 d² a layer
        n = max(16, round(args.big_gb * 1e9 / per_record))
        p = root / f"big-L{args.big_layers}-d256-N{n}.zarr"
        if not p.exists():
            t = time.perf_counter()
            build(p, "heads", args.big_layers, 256, n, None)
            print(f"built {p} ({n * per_record / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        stores.append(("big", p))
        made.append(p)
    try:
        compare(args, stores)
    finally:
        for p in made if not args.keep else []:
            shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    main()
