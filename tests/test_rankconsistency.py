"""The rankconsistency analysis on stores with known truth (no processes: ranks written as ``rank=``).

A replicated store holds, for every "rank", the gradients of the same batches; a
planted rank gets a relative error on one tensor.  The oracle is the planted
size itself and, for the distances, a direct NumPy computation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.kinds.rankconsistency import relative_distances, replay_groups
from gradforensics.testing.contracts import AnalysisContract

SHAPES = {"a.weight": (16, 8), "b.weight": (12, 8)}


def replicated_store(path: Path, seed: int, *, world: int = 4, bad_rank: int | None = 2, error: float = 1e-2,
                     jitter: float = 0.0, n_batches: int = 3) -> Path:
    """*world* ranks replaying the same *n_batches*; *bad_rank* off by *error* (relative) on ``a.weight``."""
    rng = np.random.default_rng(seed)
    batches = [{k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(n_batches)]
    with gf.Recorder(path, sources=["a"], mode="replay", heads={"b.weight": 3}, extra={"replicated": True}) as rec:
        for i, g in enumerate(batches):
            for q in range(world):
                grads = {k: v * (1 + jitter * rng.standard_normal(v.shape)).astype(np.float32) for k, v in g.items()}
                if q == bad_rank:
                    grads["a.weight"] = grads["a.weight"] * np.float32(1 + error)
                rec.record(step=0, loss=1.0, source="a", rank=q, grads=grads)
            del i
    return path


class TestRankConsistencyContract(AnalysisContract):
    analysis_name = "rankconsistency"
    factory = staticmethod(replicated_store)


def test_a_difference_of_one_in_ten_thousand_is_found(tmp_path: Path) -> None:
    f = gf.analyze(replicated_store(tmp_path / "m.zarr", 4, bad_rank=3, error=1e-4), only=["rankconsistency"],
                   progress=False)
    assert [x.evidence["rank"] for x in f.flags] == [3]


def test_planted_rank_named_with_its_size(tmp_path: Path) -> None:
    f = gf.analyze(replicated_store(tmp_path / "s.zarr", 0, bad_rank=2, error=1e-2), only=["rankconsistency"],
                   progress=False)
    assert [(x.evidence["rank"], x.tensor) for x in f.flags] == [(2, "a.weight")]
    # |g - (1+e)g| / |(1+e)g| = e / (1+e)
    assert f.flags[0].evidence["max_rel_diff"] == pytest.approx(1e-2 / 1.01, rel=1e-4)
    t = f.table("rankconsistency")
    assert set(t[t["n_disagree"] > 0]["rank"]) == {2}
    assert (t[t["tensor"] == "b.weight"]["max_rel_diff"] == 0).all()      # the untouched tensor agrees exactly


def test_float_jitter_is_not_a_finding_and_two_ranks_cannot_be_told_apart(tmp_path: Path) -> None:
    quiet = gf.analyze(replicated_store(tmp_path / "q.zarr", 1, bad_rank=None, jitter=1e-7), only=["rankconsistency"],
                       progress=False)
    assert not quiet.flags and quiet.table("rankconsistency")["max_rel_diff"].max() < 1e-6
    two = gf.analyze(replicated_store(tmp_path / "t.zarr", 2, world=2, bad_rank=1), only=["rankconsistency"],
                     progress=False)
    assert sorted(x.evidence["rank"] for x in two.flags) == [0, 1]
    assert all("cannot be told" in x.summary for x in two.flags)


def test_not_replicated_store_gives_no_table_rows(tmp_path: Path) -> None:
    from gradforensics.testing.planted import healthy_store

    healthy_store(tmp_path / "h.zarr", 0)
    assert gf.analyze(tmp_path / "h.zarr", only=["rankconsistency"], progress=False).table("rankconsistency").empty


def test_distances_and_groups_against_numpy() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 40))
    d = relative_distances(x[[0, 2, 4]])
    want = np.array([[np.linalg.norm(x[a] - x[b]) / max(np.linalg.norm(x[a]), np.linalg.norm(x[b]))
                      for b in (0, 2, 4)] for a in (0, 2, 4)])
    np.testing.assert_allclose(d, want, rtol=1e-9, atol=1e-12)
    assert replay_groups(np.array([0, 1, 0, 1, 0])) == [{0: 0, 1: 1}, {0: 2, 1: 3}, {0: 4}]
