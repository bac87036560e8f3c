"""The floor of the per-unit statistics: what one unit of N records costs whatever the code around it.

Per unit, on its N x N Gram matrix K (one BLAS thread, CPU seconds of this process):

* ``gemm``: conflict's permutation products ``K [A_pi1 ... A_pic]`` for B permutations of two pure
  sources (one column a permutation, chunks of 128): ``2 B N^2`` flops, the part of the exact
  permutation test no bookkeeping can remove (a unit in conflict runs all B);
* ``conflict``: the whole ``conflict_units`` of ``--group`` units sharing one stream (``streams="tensor"``;
  ``--group 1``: each unit its own, the default);
* ``eig``: oscillation's top eigenpairs of the centred K (``top_components``: ``dsyevr``, the top 3 only);
* ``eigvals``: every eigenvalue and no vector (``np.linalg.eigvalsh``): the dense reduction to
  tridiagonal form alone, which ``eig`` cannot go below with a dense method;
* ``eigh``: the full decomposition (``np.linalg.eigh``, the oracle ``top_components`` is tested against);
* ``subspace``: block subspace iteration, 8 vectors, 30 products ``K Q`` and QR (BLAS 3), for
  comparison; its directions 2 and 3 are not converged where the eigenvalues after the first
  are close (``gap``: the largest ``lam_2 / lam_4`` of the units measured);
* ``touch``: one read of K from a memory-mapped file (what each analysis pays to take a spilled unit).

Multiplied by ``--units`` (936: the realistic ``heads`` store of ``benchmarks/shape.py``) this is
the least the per-unit statistics cost, to compare with a whole ``analyze`` of the ``flat`` store.

    python benchmarks/unit_floor.py --records 256 --units 936
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402  (after the BLAS thread limits)


def _cpu(fn, repeat: int) -> float:
    """Least CPU seconds of *repeat* calls of *fn*."""
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def _subspace(K: np.ndarray, p: int = 8, steps: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """Top 3 Ritz pairs of *K* after *steps* block products (a comparison only: not converged without a gap)."""
    q = np.linalg.qr(np.random.default_rng(0).standard_normal((K.shape[0], p)))[0]
    for _ in range(steps):
        q = np.linalg.qr(K @ q)[0]
    w, v = np.linalg.eigh(q.T @ K @ q)
    return w[::-1][:3], (q @ v)[:, ::-1][:, :3]


def main() -> None:
    from gradforensics.analysis.kinds.conflict import permtest as pt
    from gradforensics.analysis.kinds.conflict import unit as cu
    from gradforensics.analysis.kinds.oscillation.stats import centred, top_components

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=256)
    ap.add_argument("--width", type=int, default=128, help="floats a unit (a d 32 head: 128)")
    ap.add_argument("--units", type=int, default=936)
    ap.add_argument("--group", type=int, default=9, help="units sharing one permutation stream (a tensor and its heads)")
    ap.add_argument("--permutations", type=int, default=999)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n, B, g = args.records, args.permutations, args.group
    rng = np.random.default_rng(0)
    sign = np.where(np.arange(n) % 2, 1.0, -1.0)
    grams = []
    for _ in range(g):                      # two sources in conflict: every unit runs all B permutations
        X = sign[:, None] * rng.standard_normal(args.width) + 2 * rng.standard_normal((n, args.width))
        grams.append(X @ X.T)
    mix = np.eye(2)[np.arange(n) % 2]
    perms = pt.permutations(n, B, (0, 1, 0), max(4, -(-n // 16)))
    A1 = mix[:, :1]

    def gemm() -> None:
        for s in range(0, B, 128):
            grams[0] @ np.take(A1, perms[s:s + 128].T, axis=0).reshape(n, -1)

    opts = cu.ConflictOptions()
    design = cu.source_design(mix, opts, training=True)
    seeds = [cu.unit_seed(0, "t", h, "tensor") for h in range(g)]     # one stream (streams="tensor")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k")
        grams[0].tofile(path)
        per = {
            "gemm": _cpu(gemm, args.repeat),
            "conflict": _cpu(lambda: cu.conflict_units(grams, mix, opts, True, seeds, design), args.repeat) / g,
            "eig": _cpu(lambda: top_components(centred(grams[0]), 3), args.repeat),
            "eigvals": _cpu(lambda: np.linalg.eigvalsh(centred(grams[0])), args.repeat),
            "eigh": _cpu(lambda: np.linalg.eigh(centred(grams[0])), args.repeat),
            "subspace": _cpu(lambda: _subspace(centred(grams[0])), args.repeat),
            "touch": _cpu(lambda: np.array(np.memmap(path, dtype=np.float64, mode="c", shape=(n, n))), args.repeat),
        }
    print(f"N = {n}, width {args.width}, B = {B}, {args.units} units ({g} a stream)")
    print(f"{'part':10} {'ms a unit':>10} {'s for all':>10}")
    for k, v in per.items():
        print(f"{k:10} {v * 1e3:10.3f} {v * args.units:10.2f}")
    w = [np.linalg.eigvalsh(centred(k))[::-1] for k in grams]
    print(f"gap: lam_2 / lam_4 at most {max(x[1] / x[3] for x in w):.3f} over the {g} units")
    gf = 2 * B * n * n / per["gemm"] / 1e9
    print(f"gemm runs at {gf:.0f} GFLOP/s; conflict's exact test is at least {per['gemm'] * args.units:.2f} s here")


if __name__ == "__main__":
    main()
