"""Conflict's peak memory at many sources: ``analyze --only conflict`` on 200 sources x 400 records.

The store (built under ``--dir``, reused when present): ``--sources`` sources (default 200),
``--records`` records (default 400), each a pure batch of source ``i % sources`` (two records
a source at the defaults), in ``--mode`` (default ``training``), of ``--layers`` layers
(default 2) of ``benchmarks/shape.py``'s LLaMA-shaped block at width ``--d`` (default 16):
7 tensors and 39 units a layer (q/k/v/o in 8 heads).  Half the sources share one mean
gradient, the other half its opposite, plus noise: every unit has ``S (S - 1) / 2`` source
pairs (19,900 at 200 sources), the quadratic part of conflict's table.

Each measurement runs ``gradforensics analyze --only conflict`` in its own process and prints
its peak RSS (``ru_maxrss`` of the child), CPU and wall seconds.  With ``--before DIR`` (an
older ``gradforensics`` package: ``git archive <commit> gradforensics | tar -x -C DIR``) both
codes run, interleaved, and the p-values and flags of the two are compared (the conflict
table's ``p_value`` on the rows both tables hold, by unit and pair: conflict keeps at most
``table_rows`` rows, 100,000 by default, of the 1.55 million; and the flags' kind, unit, sources
and severity to 1e-9).

    python benchmarks/conflict_memory.py --before /tmp/old
    python benchmarks/conflict_memory.py --permutations 19      # the table and flags phases, quickly

The permutation phase costs ``B N² (S - 1)`` flops a unit (5e12 in all at the defaults: about three
minutes on an idle core): ``--permutations 19`` runs everything else, the same table, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402  (after the BLAS thread limits)
from _common import parse_or_child  # noqa: E402
from shape import HEADS, shapes  # noqa: E402

HERE = Path(__file__).resolve().parent


def build(path: Path, sources: int, records: int, layers: int, d: int, mode: str, seed: int = 0) -> None:
    """The store of the module docstring."""
    import gradforensics as gf

    rng = np.random.default_rng(seed)
    names = shapes("heads", layers, d)
    base = {n: rng.standard_normal(s, dtype=np.float32) for n, s in names.items()}
    srcs = [f"s{k:03d}" for k in range(sources)]
    with gf.Recorder(path, sources=srcs, mode=mode, overwrite=True, heads=HEADS) as rec:
        for i in range(records):
            k = i % sources
            sign = 1.0 if k % 2 else -1.0
            rec.record(step=i, loss=2.0 + 0.1 * np.sin(i), source=srcs[k], n_samples=32,
                       grads={n: sign * base[n] + 2 * rng.standard_normal(s, dtype=np.float32)
                              for n, s in names.items()})


def child(args: argparse.Namespace) -> None:
    import gradforensics as gf

    t0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    f = gf.analyze(args.store, only="conflict", progress=False,
                   options={"conflict": {"permutations": args.permutations}})
    t = f.table("conflict")
    r = resource.getrusage(resource.RUSAGE_SELF)
    flags = sorted([fl.kind, fl.tensor, -1 if fl.head is None else fl.head, list(fl.sources), round(fl.severity, 9)]
                   for fl in f.flags)
    print(json.dumps({"cpu_s": r.ru_utime + r.ru_stime - t0.ru_utime - t0.ru_stime,
                      "wall_s": time.perf_counter() - w0, "rss_mb": r.ru_maxrss / 1024, "rows": len(t),
                      "p": {f"{r.tensor}|{r.head}|{r.source_a}|{r.source_b}": round(float(r.p_value), 12)
                            for r in t[["tensor", "head", "source_a", "source_b", "p_value"]].itertuples(index=False)},
                      "flags": flags}))


def run_child(store: Path, pythonpath: str, B: int) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    p = subprocess.run([sys.executable, __file__, "--child", "--store", str(store), "--permutations", str(B)], env=env,
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"analyze {store} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/gf-conflict-memory")
    ap.add_argument("--sources", type=int, default=200)
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--mode", default="training", choices=("training", "replay"))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--permutations", type=int, default=999,
                    help="conflict's B (the permutation phase's flops scale with it: B x N^2 x S a unit; its memory not)")
    ap.add_argument("--before", default=None, metavar="DIR", help="a directory holding an older gradforensics/")
    parsed = parse_or_child(ap, child)
    if parsed is None:
        return
    args, root = parsed
    store = root / f"S{args.sources}-N{args.records}-L{args.layers}-d{args.d}-{args.mode}.zarr"
    if not store.exists():
        t = time.perf_counter()
        build(store, args.sources, args.records, args.layers, args.d, args.mode)
        print(f"built {store} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    codes = [("after", str(HERE.parent))] + ([("before", str(Path(args.before).resolve()))] if args.before else [])
    res: dict[str, list[dict]] = {}
    for _ in range(args.repeat):                      # interleaved
        for code, pp in codes:
            res.setdefault(code, []).append(run_child(store, pp, args.permutations))
    print(f"{'code':7} {'rss MB':>7} {'cpu min':>8} {'cpu med':>8} {'wall min':>8} {'rows':>8} {'flags':>6}")
    for code, rows in res.items():
        cpu = [r["cpu_s"] for r in rows]
        print(f"{code:7} {max(r['rss_mb'] for r in rows):7.0f} {min(cpu):8.2f} {statistics.median(cpu):8.2f} "
              f"{min(r['wall_s'] for r in rows):8.2f} {rows[0]['rows']:8d} {len(rows[0]['flags']):6d}")
    if args.before:
        a, b = res["after"][0], res["before"][0]
        common = a["p"].keys() & b["p"].keys()      # a table cut to ``table_rows`` keeps some of the rows
        same_p = all(a["p"][k] == b["p"][k] or (a["p"][k] != a["p"][k] and b["p"][k] != b["p"][k]) for k in common)
        same_flags = a["flags"] == b["flags"]
        print(f"p-values {'same' if same_p else 'DIFFER'} on the {len(common)} rows both tables hold; "
              f"flags {'same' if same_flags else 'DIFFER'}; "
              f"rss after/before {max(r['rss_mb'] for r in res['after']) / max(r['rss_mb'] for r in res['before']):.2f}")


if __name__ == "__main__":
    main()
