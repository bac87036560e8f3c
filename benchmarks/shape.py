"""The pass at a real model's shape: many tensors and heads against the same bytes in a few tensors.

Stores (built once under ``--dir``, reused when present):

* ``heads``: shaped like a ``--layers``-layer LLaMA block stack - per layer ``q/k/v/o_proj``
  (``d x d``, stored in 8 heads, ``o_proj`` split along its input axis) and
  ``gate/up/down_proj`` (``2d x d``): 7 tensors a layer (168 at 24 layers), 39 units a
  layer (936);
* ``flat``: the same bytes in 8 square tensors (8 units);
* with ``--sketch K`` both capture per-head sketches of dimension K instead of the
  full gradients (``sk-heads`` / ``sk-flat``);
* ``small``: ``--small`` tensors of 32 floats, 32 records (``analyze`` and ``report`` wall).

The heads of the ``heads`` store are ``d/8`` rows of ``d`` floats: at the default ``--d 32``
a head holds 128 floats, far fewer than conflict's ``B·S = 1,998`` permuted mixture columns,
so the per-unit statistics dominate; a real model's heads (128 x 4,096 in a 7B LLaMA) hold
more floats than that, and the pass's bytes dominate.  ``--layers 4 --d 256`` (heads of
32 x 256 = 8,192 floats, 1.3 GB a store at 128 records) is the pair at a real head width.
``--breakdown`` adds each analysis's own CPU seconds (its ``compute`` and ``flags``, timed
inside ``gf.analyze``), min over the repeats, per store and code.

Each measurement runs ``gf.analyze`` in its own process (peak RSS is its own) and
prints CPU seconds (user + system, every thread), wall seconds and peak RSS.  With
``--before DIR`` (a copy of an older ``gradforensics`` package, e.g. ``git archive
<commit> gradforensics | tar -x -C DIR``) every store is analysed by both codes,
repeats interleaved, and the findings of the two are compared (a digest of every
table and flag: ``same`` when they are identical).  Ratios are what to trust on a
shared machine: min and median over ``--repeat``.

    python benchmarks/shape.py --records 256 --before /tmp/old          # full gradients
    python benchmarks/shape.py --records 1024 --sketch 256 --before /tmp/old
    python benchmarks/shape.py --small 2000 --before /tmp/old
    python benchmarks/shape.py --layers 4 --d 256 --records 128 --breakdown --before /tmp/old   # real head width
    python benchmarks/shape.py --records 512 --engine '{"long_history": 512}' --before /tmp/old   # exact in both
"""

from __future__ import annotations

import argparse
import hashlib
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

HERE = Path(__file__).resolve().parent
HEADS = {"*.q_proj.weight": 8, "*.k_proj.weight": 8, "*.v_proj.weight": 8,
         "*.o_proj.weight": {"heads": 8, "axis": 1}}


def shapes(kind: str, layers: int, d: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the ``heads`` or ``flat`` store (same float count, to a rounding)."""
    if kind == "heads":
        out: dict[str, tuple[int, ...]] = {}
        for L in range(layers):
            for p in "qkvo":
                out[f"model.layers.{L}.self_attn.{p}_proj.weight"] = (d, d)
            out[f"model.layers.{L}.mlp.gate_proj.weight"] = (2 * d, d)
            out[f"model.layers.{L}.mlp.up_proj.weight"] = (2 * d, d)
            out[f"model.layers.{L}.mlp.down_proj.weight"] = (d, 2 * d)
        return out
    if kind == "small":
        return {f"model.layers.{i}.tiny.weight": (32,) for i in range(layers)}
    side = round(float(np.sqrt(layers * 10 * d * d / 8)))
    return {f"model.layers.{i}.mlp.weight": (side, side) for i in range(8)}


def build(path: Path, kind: str, layers: int, d: int, records: int, sketch: int | None, seed: int = 0) -> None:
    import gradforensics as gf

    rng = np.random.default_rng(seed)
    names = shapes(kind, layers, d)
    base = {n: rng.standard_normal(s, dtype=np.float32) for n, s in names.items()}
    kw = {"sketch": sketch} if sketch else {}
    with gf.Recorder(path, sources=["a", "b"], mode="training", overwrite=True,
                     heads=HEADS if kind == "heads" else None, **kw) as rec:
        for i in range(records):
            sign = 1.0 if i % 2 else -1.0            # source b's mean gradient opposes a's: conflict to find
            rec.record(step=i, loss=2.0 + 0.1 * np.sin(i), source="ab"[i % 2], n_samples=32,
                       grads={n: sign * base[n] + 2 * rng.standard_normal(s, dtype=np.float32)
                              for n, s in names.items()})


def _digest(findings) -> str:
    """A digest of every table (as CSV) and flag (kind, where, severity, evidence) of *findings*."""
    h = hashlib.sha256()
    for name in sorted(findings.results):
        t = findings.results[name].table
        h.update(name.encode())
        h.update(t.to_csv(index=False, float_format="%.17g").encode())
    for f in sorted(findings.flags, key=lambda f: (f.kind, f.tensor, -1 if f.head is None else f.head,
                                                     tuple(f.sources))):
        h.update(json.dumps([f.kind, f.tensor, f.head, list(f.sources), repr(f.severity),
                             {k: repr(v) for k, v in sorted(f.evidence.items())}]).encode())
    return h.hexdigest()[:16]


def child(args: argparse.Namespace) -> None:
    t0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out: dict = {}
    if args.child == "analyze":
        import gradforensics as gf

        spent = _time_analyses() if args.breakdown else {}
        f = gf.analyze(args.store, progress=False, options={"engine": json.loads(args.engine)} if args.engine else None)
        out = {"flags": len(f.flags), "digest": _digest(f), "analyses": spent}
    elif args.child == "report":
        from gradforensics.cli import main

        rc = main(["report", args.store, "--out", args.out or str(Path(args.store).with_suffix(".report"))])
        out = {"rc": rc}
    r = resource.getrusage(resource.RUSAGE_SELF)
    out.update(cpu_s=r.ru_utime + r.ru_stime - t0.ru_utime - t0.ru_stime, wall_s=time.perf_counter() - w0,
               rss_mb=r.ru_maxrss / 1024)
    print(json.dumps(out))


def _time_analyses() -> dict[str, float]:
    """Wrap every registered analysis's ``compute`` and ``flags`` with a CPU clock (the process's, every
    thread); returns the dict the seconds accumulate in, by analysis name, as ``gf.analyze`` runs them."""
    import dataclasses

    from _timing import cpu_timed

    from gradforensics.analysis.contract.registry import REGISTRY

    spent: dict[str, float] = {}

    for name, a in list(REGISTRY.items()):
        REGISTRY[name] = dataclasses.replace(a, compute=cpu_timed(spent, name, a.compute),
                                             flags=cpu_timed(spent, name, a.flags))
    return spent


def run_child(verb: str, store: Path, pythonpath: str, breakdown: bool = False,
              engine: str | None = None, out: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    p = subprocess.run([sys.executable, __file__, "--child", verb, "--store", str(store),
                        *(["--breakdown"] if breakdown else []),
                        *(["--engine", engine] if engine else []), *(["--out", str(out)] if out else [])], env=env,
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"{verb} {store} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _stats(xs: list[float]) -> str:
    return f"{min(xs):8.2f} {statistics.median(xs):8.2f}"


def compare(args: argparse.Namespace, stores: list[tuple[str, Path]], verbs: tuple[str, ...] = ("analyze",)) -> None:
    after = str(HERE.parent)
    codes = [("after", after)] + ([("before", str(Path(args.before).resolve()))] if args.before else [])
    res: dict[tuple[str, str, str], list[dict]] = {}
    for _ in range(args.repeat):                      # interleaved: drift in machine load hits every cell alike
        for verb in verbs:
            for label, path in stores:
                for code, pp in codes:
                    out = _report_dir(path, code) if verb == "report" else None     # each code its own report
                    res.setdefault((verb, label, code), []).append(run_child(verb, path, pp, args.breakdown,
                                                                                 args.engine, out))
    print(f"{'verb':8} {'store':9} {'code':7} {'cpu min':>8} {'cpu med':>8} {'wall min':>8} {'wall med':>8} "
          f"{'rss MB':>7}  findings")
    for (verb, label, code), rows in res.items():
        extra = f"{rows[0].get('flags', '')} flags, {rows[0].get('digest', '')}" if verb == "analyze" else ""
        print(f"{verb:8} {label:9} {code:7} {_stats([r['cpu_s'] for r in rows])} "
              f"{_stats([r['wall_s'] for r in rows])} {max(r['rss_mb'] for r in rows):7.0f}  {extra}")
    if args.breakdown:
        _print_breakdown(res)
    for verb in verbs:
        for label, _ in stores:
            if args.before:
                a, b = res[(verb, label, "after")], res[(verb, label, "before")]
                same = "" if verb != "analyze" else ("  findings same" if a[0]["digest"] == b[0]["digest"]
                                                     else "  FINDINGS DIFFER")
                if verb == "report":
                    same = "  " + _same_files(_report_dir(dict(stores)[label], "after"),
                                              _report_dir(dict(stores)[label], "before"))
                print(f"{verb} {label}: after/before cpu {_ratio(a, b, 'cpu_s')}, wall {_ratio(a, b, 'wall_s')}, "
                      f"rss {max(r['rss_mb'] for r in a) / max(r['rss_mb'] for r in b):.2f}{same}")
        pairs = [(x, y) for x in ("heads", "sk-heads") for y in ("flat", "sk-flat")
                 if x.replace("heads", "") == y.replace("flat", "") and any(s[0] == x for s in stores)
                 and any(s[0] == y for s in stores)]
        for x, y in pairs:
            for code, _ in codes:
                a, b = res[(verb, x, code)], res[(verb, y, code)]
                print(f"{verb} {code}: {x}/{y} cpu {_ratio(a, b, 'cpu_s')}, wall {_ratio(a, b, 'wall_s')}, "
                      f"rss {max(r['rss_mb'] for r in a) / max(r['rss_mb'] for r in b):.2f}")


def _report_dir(store: Path, code: str) -> Path:
    """Where *code*'s report of *store* goes: ``<store>.report`` for the code under test."""
    return store.with_suffix(".report" if code == "after" else f".report-{code}")


def _same_files(a: Path, b: Path) -> str:
    """``outputs same (N files)`` when the two report directories hold the same files, byte for byte."""
    fa = {p.relative_to(a).as_posix(): p.read_bytes() for p in sorted(a.rglob("*")) if p.is_file()}
    fb = {p.relative_to(b).as_posix(): p.read_bytes() for p in sorted(b.rglob("*")) if p.is_file()}
    diff = sorted(set(fa) ^ set(fb)) + [n for n in sorted(set(fa) & set(fb)) if fa[n] != fb[n]]
    return f"outputs same ({len(fa)} files, byte for byte)" if not diff else f"OUTPUTS DIFFER: {diff[:6]}"


def _print_breakdown(res: dict[tuple[str, str, str], list[dict]]) -> None:
    """Each analysis's CPU seconds (compute + flags; min over the repeats), a column per store and code."""
    cells = [(k, rows) for k, rows in res.items() if k[0] == "analyze"]
    names = sorted({n for _, rows in cells for r in rows for n in r.get("analyses", {})},
                   key=lambda n: -max(r.get("analyses", {}).get(n, 0.0) for _, rows in cells for r in rows))
    print("\nCPU s per analysis (compute + flags), min over repeats")
    print(f"{'analysis':16}" + "".join(f" {label + '/' + code:>16}" for (_, label, code), _ in cells))
    for n in names:
        print(f"{n:16}" + "".join(f" {min(r['analyses'].get(n, 0.0) for r in rows):16.2f}" for _, rows in cells))
    print(f"{'(all analyses)':16}" + "".join(f" {min(sum(r['analyses'].values()) for r in rows):16.2f}"
                                            for _, rows in cells))
    print(f"{'(analyze)':16}" + "".join(f" {min(r['cpu_s'] for r in rows):16.2f}" for _, rows in cells))


def _ratio(a: list[dict], b: list[dict], key: str) -> str:
    return (f"{min(r[key] for r in a) / min(r[key] for r in b):.2f} (min) / "
            f"{statistics.median(r[key] for r in a) / statistics.median(r[key] for r in b):.2f} (median)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/gf-shape")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=32,
                    help="model width (default 32: heads of 4 x 32 floats; 256: 32 x 256, a real head's width)")
    ap.add_argument("--records", type=int, default=256)
    ap.add_argument("--sketch", type=int, default=None, metavar="K")
    ap.add_argument("--small", type=int, default=None, metavar="T", help="the store of T tensors of 32 floats")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--before", default=None, metavar="DIR", help="a directory holding an older gradforensics/")
    ap.add_argument("--breakdown", action="store_true", help="CPU seconds of each analysis as well")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)       # a report child's --out
    ap.add_argument("--engine", default=None, metavar="JSON",
                    help='engine options for every analyze, e.g. \'{"long_history": 512}\' (the exact regime for both codes)')
    parsed = parse_or_child(ap, child, verb=True)
    if parsed is None:
        return None
    args, root = parsed
    if args.small:
        p = root / f"small-{args.small}.zarr"
        if not p.exists():
            build(p, "small", args.small, 0, 32, None)
        return compare(args, [("small", p)], verbs=("analyze", "report"))
    stores = []
    for kind in ("heads", "flat"):
        label = f"sk-{kind}" if args.sketch else kind
        p = root / f"{label}-L{args.layers}-d{args.d}-N{args.records}-k{args.sketch or 0}.zarr"
        if not p.exists():
            t = time.perf_counter()
            build(p, kind, args.layers, args.d, args.records, args.sketch)
            print(f"built {p} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        stores.append((label, p))
    compare(args, stores)


if __name__ == "__main__":
    main()
