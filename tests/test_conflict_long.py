"""Conflict above N₀ on a store of mixed batches: every pair gets a stretch, none crashes on an empty segment."""

from __future__ import annotations

import numpy as np

import gradforensics as gf


def test_mixed_batches_in_the_long_regime_with_few_windows(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "mixed.zarr"
    base = rng.standard_normal((2, 16)).astype(np.float32)
    with gf.Recorder(path, sources=["a", "b"], mode="training", background=False) as rec:
        for i in range(300):
            w = float(rng.uniform(0.2, 0.8))            # every batch a mixture of both sources
            g = w * base[0] - (1 - w) * base[1] + 0.5 * rng.standard_normal(16).astype(np.float32)
            rec.record(step=i, loss=1.0, mixture={"a": w, "b": 1 - w}, grads={"w": g.astype(np.float32)})
    f = gf.analyze(path, only="conflict", progress=False,
                   options={"engine": {"long_history": 0, "band": 5, "windows": 7}, "conflict": {"permutations": 99}})
    assert f.header["regime"]["name"] == "long-history"
    t = f.table("conflict")
    assert len(t) == 1
    first, last = int(t["record_first"].iloc[0]), int(t["record_last"].iloc[0])
    assert 0 <= first <= last <= 299
