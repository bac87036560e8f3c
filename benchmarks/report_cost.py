"""``gradforensics report`` before -> after: CPU seconds, and every output file compared byte for byte.

Each store is analysed once (by the code under test, unless it already holds results);
then ``gradforensics report STORE --out DIR`` runs in its own process for each code,
repeats interleaved, each code into its own directory.  Every file the two codes write
(``flags.json``, ``report.md``, ``report.html``, ``tables/*.csv``, ``figures/*.png``)
is compared byte for byte: ``same`` when both wrote the same set of files with the same
bytes.  Stores: the 2,000-small-tensor store of ``benchmarks/shape.py --small 2000``
(``--small``) and planted stores of the test suite (``--planted``: a conflict with heads,
a drift, an oscillation with a non-finite record, a healthy control; all analyses).

    python benchmarks/report_cost.py --before /tmp/old --small 2000 --planted --repeat 2 --dir /tmp/gf-report
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
os.environ.setdefault("MPLBACKEND", "Agg")

from _common import parse_or_child  # noqa: E402

HERE = Path(__file__).resolve().parent


def child(args: argparse.Namespace) -> None:
    t0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if args.child == "analyze":
        import gradforensics as gf

        gf.analyze(args.store, progress=False)
        out: dict = {}
    else:
        from gradforensics.cli import main

        out = {"rc": main(["report", args.store, "--out", args.out])}
    r = resource.getrusage(resource.RUSAGE_SELF)
    out.update(cpu_s=r.ru_utime + r.ru_stime - t0.ru_utime - t0.ru_stime, wall_s=time.perf_counter() - w0)
    print(json.dumps(out))


def run_child(verb: str, store: Path, pythonpath: str, out: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    cmd = [sys.executable, __file__, "--child", verb, "--store", str(store), *(["--out", str(out)] if out else [])]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"{verb} {store} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def planted_stores(root: Path) -> list[tuple[str, Path]]:
    """The planted stores (written once under *root*, analysed by the code under test)."""
    from gradforensics.testing.planted_directions import (
        healthy_directions,
        planted_conflict,
        planted_drift,
        planted_oscillation,
        with_nonfinite,
    )

    made = {"conflict": lambda: planted_conflict(seed=0, n=96), "drift": lambda: planted_drift(seed=1),
            "healthy": lambda: healthy_directions(seed=2)}

    def osc():
        p = planted_oscillation(seed=3)
        return with_nonfinite(p, sorted(p.grads)[0], [5])

    made["oscillation"] = osc
    out = []
    for label, make in made.items():
        path = root / f"planted-{label}.zarr"
        if not path.exists():
            make().write(path)
            run_child("analyze", path, str(HERE.parent))
        out.append((label, path))
    return out


def files_of(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def differences(a: Path, b: Path) -> list[str]:
    fa, fb = files_of(a), files_of(b)
    only = sorted(set(fa) ^ set(fb))
    return [f"only in one: {n}" for n in only] + [n for n in sorted(set(fa) & set(fb)) if fa[n] != fb[n]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/gf-report-cost")
    ap.add_argument("--before", required=False, metavar="DIR", help="a directory holding an older gradforensics/")
    ap.add_argument("--small", type=int, default=None, metavar="T",
                    help="the store of T tensors of 32 floats (shape.py's; built there when absent)")
    ap.add_argument("--planted", action="store_true", help="the planted stores as well")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parsed = parse_or_child(ap, child, verb=True)
    if parsed is None:
        return
    args, root = parsed
    stores: list[tuple[str, Path]] = []
    if args.small:
        p = root / f"small-{args.small}.zarr"
        if not p.exists():
            sys.path.insert(0, str(HERE))
            from shape import build

            build(p, "small", args.small, 0, 32, None)
            run_child("analyze", p, str(HERE.parent))
        stores.append((f"small-{args.small}", p))
    if args.planted:
        stores += planted_stores(root)
    codes = [("after", str(HERE.parent))] + ([("before", str(Path(args.before).resolve()))] if args.before else [])
    res: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeat):                     # interleaved: drift in the machine's load hits both alike
        for label, path in stores:
            for code, pp in codes:
                res.setdefault((label, code), []).append(run_child("report", path, pp, root / f"{label}.{code}"))
    print(f"{'store':18} {'code':7} {'cpu min':>8} {'cpu med':>8} {'wall min':>8} {'wall med':>8}")
    for (label, code), rows in res.items():
        cpu, wall = [r["cpu_s"] for r in rows], [r["wall_s"] for r in rows]
        print(f"{label:18} {code:7} {min(cpu):8.2f} {statistics.median(cpu):8.2f} {min(wall):8.2f} "
              f"{statistics.median(wall):8.2f}")
    if args.before:
        for label, _ in stores:
            a, b = res[(label, "after")], res[(label, "before")]
            diff = differences(root / f"{label}.after", root / f"{label}.before")
            n = len(files_of(root / f"{label}.after"))
            same = f"{n} files, every one the same bytes" if not diff else f"DIFFER: {diff[:6]}"
            print(f"{label}: after/before cpu {min(r['cpu_s'] for r in a) / min(r['cpu_s'] for r in b):.2f} (min) / "
                  f"{statistics.median(r['cpu_s'] for r in a) / statistics.median(r['cpu_s'] for r in b):.2f} "
                  f"(median); outputs: {same}")


if __name__ == "__main__":
    main()
