"""Shared by the tests that run one pass two ways (spilled or in memory, a client or threads, a regime
forced or fallen back to): the same findings within a stated tolerance, and the store they run on."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import gradforensics as gf
from gradforensics.analysis.contract.model import Findings

__all__ = ["close_findings", "close_values", "spill_heads_store", "use_tmp_root"]

#: Two passes over the same store read the same float64 Gram matrices; their statistics may differ only by
#: the order float64 sums were taken in (threads, a client): ~1e-15 relative, so 1e-9 is loose and still
#: catches any real difference (a wrong unit, a lost record, a float32 round trip at ~1e-7).
RTOL = 1e-9
ATOL = 1e-12


def close_values(a: Any, b: Any, where: str, rtol: float, atol: float) -> None:
    """*a* and *b* (JSON-like: numbers, strings, lists, dicts, None) equal, numbers within tolerance."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        assert sorted(a) == sorted(b), where
        for k in a:
            close_values(a[k], b[k], f"{where}.{k}", rtol, atol)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close_values(x, y, f"{where}[{i}]", rtol, atol)
    elif isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), where
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rtol, abs_tol=atol), (where, a, b)
    else:
        assert a == b, (where, a, b)


def close_findings(a: Findings, b: Findings, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Every table, series and flag of *a* and *b* the same: numbers within *rtol*/*atol*, the rest equal.

    The flags are the same findings (kind, tensor, head, sources, records), their severity and
    evidence within the tolerance.
    """
    assert sorted(a.results) == sorted(b.results)
    for name in a.results:
        pd.testing.assert_frame_equal(a.results[name].table, b.results[name].table, check_exact=False,
                                      rtol=rtol, atol=atol, obj=name)
        sa, sb = a.results[name].series, b.results[name].series
        assert sorted(sa) == sorted(sb), name
        for k in sa:
            x, y = np.asarray(sa[k]), np.asarray(sb[k])
            if x.dtype.kind in "fc" or y.dtype.kind in "fc":
                np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"{name}: {k}")
            else:
                np.testing.assert_array_equal(x, y, err_msg=f"{name}: {k}")

    def key(f: dict[str, Any]) -> tuple[Any, ...]:
        return f["kind"], f["tensor"], -1 if f["head"] is None else f["head"], f["sources"], f["records"]

    fa, fb = sorted((f.to_dict() for f in a.flags), key=key), sorted((f.to_dict() for f in b.flags), key=key)
    assert [key(f) for f in fa] == [key(f) for f in fb]
    for x, y in zip(fa, fb, strict=True):
        assert abs(x.pop("severity") - y.pop("severity")) <= 1.0001e-4, key(x)    # to_dict rounds it to 4 decimals
        close_values(x, y, f"flag {key(x)}", rtol, atol)


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


def use_tmp_root(tmp_path: Path, monkeypatch: Any) -> Path:
    """A fresh temporary directory for the pass (what TMPDIR sets), to see what is left in it."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d
