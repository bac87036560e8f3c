"""Long-history memory at 1,000 units: peak RSS of ``analyze`` against the record count.

Stores (built under ``--dir``, reused when present): ``--tensors`` tensors (default 100)
of ``heads x 2`` floats stored in ``--heads`` heads (default 9), i.e. ``tensors x (heads + 1)``
units (1,000), two sources alternating with opposite mean gradients, at each of
``--records`` (default 16,384, 32,768, 65,536 records: all in the long-history regime,
``N₀`` = 259 at 1,000 units).  A base store of 4,096 records is written through
:class:`gradforensics.Recorder`; the longer ones are that store grown in place with
the same generative model (zarr ``resize`` and whole-chunk writes: a Recorder writes
about 80 records a second at this shape).

Each measurement runs ``gf.analyze`` in its own process (peak RSS is its own:
``ru_maxrss``) and prints CPU seconds (user + system), wall seconds and peak RSS.
With ``--before DIR`` (an older ``gradforensics`` package: ``git archive <commit>
gradforensics | tar -x -C DIR``) each store is analysed by both codes, repeats
interleaved, and the oscillation p-values and the flags of the two are compared.
``--before-max N`` skips the old code above N records (it keeps ``33 x N`` float64 per
unit: 17 GB at 65,536 records).

    python benchmarks/longmem.py --before /tmp/old-longmem --before-max 32768

``--tensors`` takes a list: the units sweep at one record count (each store's
super-record Gram matrices are 512 KiB a unit, whatever N; spilled under ``TMPDIR`` when
they exceed 64 MiB in all):

    python benchmarks/longmem.py --records 4096 --tensors 100,200,400 --before /tmp/old
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
from _common import findings_digest, parse_or_child  # noqa: E402

HERE = Path(__file__).resolve().parent
BASE = 4096


def _names(tensors: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(tensors)]


def _grads(rng: np.random.Generator, base: np.ndarray, r0: int, r1: int) -> np.ndarray:
    """Records ``r0:r1`` of every tensor: ``(records, tensors, heads, 2)``; sources alternate, means opposed."""
    sign = np.where(np.arange(r0, r1) % 2, 1.0, -1.0).astype(np.float32)[:, None, None, None]
    return sign * base + 2.0 * rng.standard_normal((r1 - r0, *base.shape), dtype=np.float32)


def build(path: Path, records: int, tensors: int, heads: int, seed: int = 0) -> None:
    """The store of *records* records (see the module docstring)."""
    import shutil

    import gradforensics as gf

    base_path = path.with_name(f"base-T{tensors}-H{heads}.zarr")
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((tensors, heads, 2), dtype=np.float32)
    names = _names(tensors)
    if not base_path.exists():
        g = _grads(rng, base, 0, BASE)
        with gf.Recorder(base_path, sources=["a", "b"], mode="training", overwrite=True, records_per_chunk=BASE,
                         heads={"*.q_proj.weight": heads}) as rec:
            for i in range(BASE):
                rec.record(step=i, loss=2.0 + 0.1 * np.sin(i), source="ab"[i % 2], n_samples=32,
                           grads={n: g[i, k] for k, n in enumerate(names)})
    shutil.copytree(base_path, path)
    _grow(path, records, names, base, rng)


def _grow(path: Path, records: int, names: list[str], base: np.ndarray, rng: np.random.Generator) -> None:
    """Grow the copied base store to *records* records in place: chunk-aligned writes, then ``n_records``."""
    import zarr

    zarr.config.set({"array.write_empty_chunks": True})       # a chunk of zeros (batches/rank) is a chunk too
    root = zarr.open_group(str(path), mode="r+")
    arrays = {f"grads/{n}": root[f"grads/{n}"] for n in names}
    batches = {k: a for k, a in root["batches"].arrays()}
    first = {k: a[:BASE] for k, a in batches.items()}
    for a in (*arrays.values(), *batches.values()):
        a.resize((records, *a.shape[1:]))
    for r0 in range(BASE, records, BASE):
        r1 = min(records, r0 + BASE)
        g = _grads(rng, base, r0, r1)
        for k, a in enumerate(arrays.values()):
            a[r0:r1] = g[:, k].reshape((r1 - r0, *a.shape[1:]))
        for k, a in batches.items():
            v = first[k][:r1 - r0]
            if k in ("step", "time"):
                v = v + (r0 if k == "step" else float(r0))
            a[r0:r1] = v
    attrs = dict(root.attrs["gradforensics"])
    attrs["n_records"] = int(records)
    root.attrs["gradforensics"] = attrs


def child(args: argparse.Namespace) -> None:
    t0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    import gradforensics as gf

    f = gf.analyze(args.store, only=tuple(args.only.split(",")), progress=False,
                   options={"engine": {"persist": False}})
    t = f.table("oscillation") if "oscillation" in f.results else None
    r = resource.getrusage(resource.RUSAGE_SELF)
    out = {"cpu_s": r.ru_utime + r.ru_stime - t0.ru_utime - t0.ru_stime, "wall_s": time.perf_counter() - w0,
           "rss_mb": r.ru_maxrss / 1024, "regime": f.header["regime"]["name"],
           "flags": sorted([fl.kind, fl.tensor, -1 if fl.head is None else fl.head] for fl in f.flags),
           "p": [] if t is None else [None if not np.isfinite(v) else float(v) for v in t["p_value"]],
           "cc": [] if t is None else [None if not np.isfinite(v) else float(v) for v in t["consec_cos"]],
           "digest": findings_digest(f)}
    print(json.dumps(out))


def run_child(store: Path, pythonpath: str, only: str) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    p = subprocess.run([sys.executable, __file__, "--child", "--store", str(store), "--only", only], env=env,
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"analyze {store} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _rel(a: list, b: list) -> float:
    x = np.array([np.nan if v is None else v for v in a], dtype=float)
    y = np.array([np.nan if v is None else v for v in b], dtype=float)
    if x.shape != y.shape or not np.array_equal(np.isfinite(x), np.isfinite(y)):
        return float("inf")
    ok = np.isfinite(x)
    return float(np.max(np.abs(x[ok] - y[ok]) / np.maximum(np.abs(y[ok]), 1e-300), initial=0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/gf-longmem")
    ap.add_argument("--records", default="16384,32768,65536")
    ap.add_argument("--tensors", default="100", help="tensors (a comma list: the units sweep), 10 units each")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--only", default="oscillation,drift,nonfinite",
                    help="analyses run (default: the long-history Gram analyses whose per-record state this bounds)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--before", default=None, metavar="DIR", help="a directory holding an older gradforensics/")
    ap.add_argument("--before-max", type=int, default=None, metavar="N", help="old code only up to N records")
    parsed = parse_or_child(ap, child)
    if parsed is None:
        return None
    args, root = parsed
    stores = []
    for tensors in (int(v) for v in args.tensors.split(",")):
        for n in (int(v) for v in args.records.split(",")):
            p = root / f"lm-T{tensors}-H{args.heads}-N{n}.zarr"
            if not p.exists():
                t = time.perf_counter()
                build(p, n, tensors, args.heads)
                print(f"built {p} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
            stores.append(((tensors * (args.heads + 1), n), p))
    codes = [("after", str(HERE.parent))] + ([("before", str(Path(args.before).resolve()))] if args.before else [])
    res: dict[tuple[tuple[int, int], str], list[dict]] = {}
    for _ in range(args.repeat):                      # interleaved: load drift hits every cell alike
        for n, p in stores:
            for code, pp in codes:
                if code == "before" and args.before_max is not None and n[1] > args.before_max:
                    continue
                res.setdefault((n, code), []).append(run_child(p, pp, args.only))
                print(f"  {n} {code}: {json.dumps({k: v for k, v in res[(n, code)][-1].items() if k in ('cpu_s', 'wall_s', 'rss_mb')})}",
                      file=sys.stderr)
    print(f"{'units':>6} {'records':>8} {'code':7} {'cpu min':>8} {'cpu med':>8} {'wall min':>8} {'rss MB':>7}  "
          "regime / flags")
    for ((units, n), code), rows in sorted(res.items()):
        print(f"{units:6d} {n:8d} {code:7} {min(r['cpu_s'] for r in rows):8.1f} "
              f"{statistics.median(r['cpu_s'] for r in rows):8.1f} "
              f"{min(r['wall_s'] for r in rows):8.1f} {max(r['rss_mb'] for r in rows):7.0f}  "
              f"{rows[0]['regime']}, {len(rows[0]['flags'])} flags")
    for n, _ in stores:
        if (n, "before") in res:
            a, b = res[(n, "after")][0], res[(n, "before")][0]
            print(f"{n[0]} units, {n[1]} records: flags {'same' if a['flags'] == b['flags'] else 'DIFFER'}, "
                  f"oscillation p max rel diff {_rel(a['p'], b['p']):.2e}, consec_cos max rel diff "
                  f"{_rel(a['cc'], b['cc']):.2e}, digest {'same' if a['digest'] == b['digest'] else 'DIFFERS'}")
    after = [max(r["rss_mb"] for r in res[(n, "after")]) for n, _ in stores]
    print(f"after: peak RSS {min(after):.0f} - {max(after):.0f} MB, spread {100 * (max(after) / min(after) - 1):.1f} %")


if __name__ == "__main__":
    main()
