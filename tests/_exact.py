"""Shared by the engine-pass tests: a heads store to spill, a fresh temporary root, two passes' findings compared whole."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

import gradforensics as gf
from gradforensics.analysis.contract.model import Findings

__all__ = ["same_findings", "spill_heads_store", "use_tmp_root"]


SPILL_SHAPES = {"l0.q_proj.weight": (16, 8), "l0.mlp.weight": (12, 8), "l1.q_proj.weight": (16, 8)}


def spill_heads_store(path: Path, n: int, nan_at: int) -> str:
    """3 tensors, two in 4 heads (11 units), *n* records; source b's mean opposes a's; record *nan_at* non-finite."""
    rng = np.random.default_rng(0)
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in SPILL_SHAPES.items()}
    with gf.Recorder(path, sources=["a", "b"], mode="training", heads={"*.q_proj.weight": 4},
                     background=False) as rec:
        for i in range(n):
            sign = 1.0 if i % 2 else -1.0
            g = {k: (sign * base[k] + 2 * rng.standard_normal(s)).astype(np.float32) for k, s in SPILL_SHAPES.items()}
            if i == nan_at:
                g["l0.mlp.weight"][0, 0] = np.nan
            rec.record(step=i, loss=2.0 + 0.1 * np.sin(i), source="ab"[i % 2], n_samples=32, grads=g)
    return str(path)


def use_tmp_root(tmp_path: Path, monkeypatch: object) -> Path:
    """A fresh temporary directory for the pass (what TMPDIR sets), to see what is left in it."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))  # type: ignore[attr-defined]
    return d


def same_findings(a: Findings, b: Findings) -> None:
    """Every table, series and flag of *a* and *b* identical (floats exactly)."""
    assert sorted(a.results) == sorted(b.results)
    for name in a.results:
        pd.testing.assert_frame_equal(a.results[name].table, b.results[name].table, check_exact=True)
        sa, sb = a.results[name].series, b.results[name].series
        assert sorted(sa) == sorted(sb), name
        for k in sa:
            np.testing.assert_array_equal(np.asarray(sa[k]), np.asarray(sb[k]), err_msg=f"{name}: {k}")
    assert [f.to_dict() for f in a.flags] == [f.to_dict() for f in b.flags]
