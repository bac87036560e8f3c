"""Peak disk of the exact regime's Gram matrices: the spill under ``TMPDIR`` plus the store's saved copy.

A store of ``--tensors`` tensors (default 30) of ``heads x 2`` floats in ``--heads`` heads
(default 9: 300 units) over ``--records`` records (default 512: the exact regime, N₀ = 2,590
at 10 units a tensor) is written once through :class:`gradforensics.Recorder`.  Each run
copies it afresh (so no earlier ``analysis/`` generation is on disk), points ``TMPDIR`` at
an empty directory and runs ``gf.analyze(only=drift,nonfinite)`` with the results saved, in
its own process, while a thread samples the bytes allocated on disk (``st_blocks``, what
``du`` counts) under ``TMPDIR`` and the store every 20 ms.  It prints the peak above the
store's own bytes, the Gram bytes ``units x N² x 8``, and the peak RSS.  With ``--before DIR``
(an older ``gradforensics/`` package) both codes run, repeats interleaved, and a digest of
every table and flag says whether they found the same.

    python benchmarks/spilldisk.py --before /tmp/old
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402  (after the BLAS thread limits)
from _common import findings_digest, parse_or_child  # noqa: E402

HERE = Path(__file__).resolve().parent


def build(path: Path, records: int, tensors: int, heads: int, seed: int = 0) -> None:
    import gradforensics as gf

    rng = np.random.default_rng(seed)
    base = rng.standard_normal((tensors, heads, 2), dtype=np.float32)
    names = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(tensors)]
    with gf.Recorder(path, sources=["a", "b"], mode="training", overwrite=True, background=False,
                     heads={"*.q_proj.weight": heads}) as rec:
        for i in range(records):
            g = (1.0 if i % 2 else -1.0) * base + 2.0 * rng.standard_normal(base.shape, dtype=np.float32)
            rec.record(step=i, loss=2.0 + 0.1 * np.sin(i), source="ab"[i % 2], n_samples=32,
                       grads={n: g[k] for k, n in enumerate(names)})


def _disk(*roots: str) -> int:
    total = 0
    for root in roots:
        for d, _, files in os.walk(root):
            for f in files:
                with contextlib.suppress(FileNotFoundError):      # removed while walking
                    total += os.stat(os.path.join(d, f)).st_blocks * 512
    return total


def child(args: argparse.Namespace) -> None:
    import gradforensics as gf

    tmp, store = tempfile.gettempdir(), args.store
    base = _disk(store)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _disk(tmp, store) - base)
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    w0 = time.perf_counter()
    t.start()
    f = gf.analyze(store, only=args.only, progress=False)
    done.set()
    t.join()
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"peak_disk": peak[0], "saved": _disk(store) - base, "wall_s": time.perf_counter() - w0,
                      "rss_mb": r.ru_maxrss / 1024, "regime": f.header["regime"]["name"],
                      "flags": len(f.flags), "digest": findings_digest(f)}))


def run_child(base: Path, work: Path, pythonpath: str, only: str) -> dict:
    store, tmp = work / "store.zarr", work / "tmp"
    shutil.rmtree(work, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copytree(base, store)
    env = {**os.environ, "PYTHONPATH": pythonpath, "TMPDIR": str(tmp)}
    p = subprocess.run([sys.executable, __file__, "--child", "--store", str(store), "--only", only], env=env,
                       capture_output=True, text=True, check=False)
    shutil.rmtree(work, ignore_errors=True)
    if p.returncode != 0:
        raise SystemExit(f"analyze failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/gf-spilldisk")
    ap.add_argument("--records", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--only", default="drift,nonfinite")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--before", default=None, metavar="DIR", help="a directory holding an older gradforensics/")
    parsed = parse_or_child(ap, child)
    if parsed is None:
        return None
    args, root = parsed
    base = root / f"base-T{args.tensors}-H{args.heads}-N{args.records}.zarr"
    if not base.exists():
        build(base, args.records, args.tensors, args.heads)
    units = args.tensors * (args.heads + 1)
    grams = units * args.records ** 2 * 8
    codes = [("after", str(HERE.parent))] + ([("before", str(Path(args.before).resolve()))] if args.before else [])
    res: dict[str, list[dict]] = {}
    for _ in range(args.repeat):
        for code, pp in codes:
            res.setdefault(code, []).append(run_child(base, root / "run", pp, args.only))
            print(f"  {code}: {json.dumps(res[code][-1])}", file=sys.stderr)
    print(f"{units} units x {args.records}² records x 8 bytes = {grams / 2**20:.0f} MiB of Gram matrices")
    print(f"{'code':7} {'peak disk MiB':>14} {'/ grams':>8} {'saved MiB':>10} {'rss MB':>7} {'wall s':>7}  findings")
    for code, rows in res.items():
        peak = max(r["peak_disk"] for r in rows)
        print(f"{code:7} {peak / 2**20:14.0f} {peak / grams:8.2f} {rows[0]['saved'] / 2**20:10.0f} "
              f"{max(r['rss_mb'] for r in rows):7.0f} {min(r['wall_s'] for r in rows):7.1f}  "
              f"{rows[0]['regime']}, {rows[0]['flags']} flags, digest {rows[0]['digest']}")
    if "before" in res:
        same = res["after"][0]["digest"] == res["before"][0]["digest"]
        print(f"digest {'same' if same else 'DIFFERS'}")


if __name__ == "__main__":
    main()
