"""Multi-rank stores: ``batches/rank`` values are checked, and rankconsistency runs above N₀.

* a rank outside ``0 .. world_size - 1`` of the root ``ranks`` field, or a negative
  one, is one :class:`CorruptStoreError` line when the batches are read (and one
  error line from every verb that reads them);
* the root ``ranks`` field's counts agree with ``n_records`` (their sum once rank 0
  has closed the store, their longest prefix before), or the store is refused at
  open with one line naming both numbers;
* :mod:`~gradforensics.analysis.kinds.rankconsistency` iterates the store's tensors,
  so it finds the planted rank in the long-history regime too (``ctx.grams`` is
  empty there).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _hostile import assert_error_line, edit_root_meta, run_cli

import gradforensics as gf
from gradforensics.errors import CorruptStoreError
from gradforensics.store.backends import open_backend
from gradforensics.store.reader import Store
from gradforensics.store.schema import ROOT_ATTR
from tests.test_rankconsistency import replicated_store

WORLD = 4


def _declare_ranks(path: Path, world: int, per_rank: int = 3) -> None:
    """Give the store the root ``ranks`` field a multi-rank capture commits."""
    edit_root_meta(path, lambda m: m.__setitem__(
        "ranks", {"world_size": world, "completed": list(range(world)), "records": [per_rank] * world}))


def test_ranks_inside_the_world_are_read(tmp_path: Path) -> None:
    p = replicated_store(tmp_path / "ok.zarr", 0, world=WORLD, bad_rank=None)
    _declare_ranks(p, WORLD)
    ranks = Store(p).batches()["rank"]
    assert sorted(np.unique(ranks).tolist()) == list(range(WORLD))


def test_rank_beyond_world_size_is_one_line(tmp_path: Path) -> None:
    p = replicated_store(tmp_path / "big.zarr", 0, world=WORLD, bad_rank=None)
    _declare_ranks(p, WORLD - 1, per_rank=4)      # records of rank 3 in a store of world size 3 (12 = 3 x 4)
    with pytest.raises(CorruptStoreError) as e:
        Store(p).batches()
    msg = str(e.value)
    assert "\n" not in msg and "batches/rank is 3 at record 3" in msg and "0..2" in msg and "world_size 3" in msg
    assert "3 record(s) out of range" in msg         # one record of rank 3 per replayed batch
    line = assert_error_line(run_cli(["analyze", str(p), "--only", "rankconsistency", "--out", str(tmp_path / "r")]))
    assert "batches/rank" in line


def _set_ranks(path: Path, ranks: dict[str, object]) -> None:
    """Edit the root ``ranks`` field through the store's own backend."""
    backend = open_backend(path, "a")
    try:
        meta = dict(backend.root_attrs()[ROOT_ATTR])
        backend.set_root_attr(ROOT_ATTR, {**meta, "ranks": ranks})
    finally:
        backend.close()


@pytest.mark.parametrize(("completed", "records", "want"), [
    ([0, 1, 2, 3], [3, 3, 3, 1000], 1009),      # the sum, once rank 0 closed the store
    ([0, 1, 2, 3], [3, 3, 3, 2], 11),
    ([], [3, 3, 3, 2], 11),                       # the longest prefix, while the ranks write: min(12, 13, 14, 11)
    ([], [30, 30, 30, 30], 120),
])
def test_rank_counts_that_disagree_with_n_records_are_refused_at_open(
        tmp_path: Path, completed: list[int], records: list[int], want: int) -> None:
    p = replicated_store(tmp_path / "counts.zarr", 0, world=WORLD, bad_rank=None)    # 12 records
    _set_ranks(p, {"world_size": WORLD, "completed": completed, "records": records})
    with pytest.raises(CorruptStoreError) as e:
        Store(p)
    msg = str(e.value)
    assert "\n" not in msg and "field 'ranks' commits" in msg and f"commits {want} records" in msg
    assert "field 'n_records' is 12" in msg and str(records) in msg
    for verb in (["inspect", str(p)], ["analyze", str(p), "--out", str(tmp_path / "r")]):
        assert "field 'ranks'" in assert_error_line(run_cli(verb))


@pytest.mark.parametrize(("completed", "records"), [([0, 1, 2, 3], [3, 3, 3, 3]), ([0, 2, 3], [4, 1, 4, 3]),
                                                     ([], [3, 3, 3, 3]), ([], [3, 3, 3, 5])])
def test_rank_counts_that_agree_with_n_records_open(tmp_path: Path, completed: list[int], records: list[int]) -> None:
    p = replicated_store(tmp_path / "counts.zarr", 0, world=WORLD, bad_rank=None)
    _set_ranks(p, {"world_size": WORLD, "completed": completed, "records": records})
    assert Store(p).n_records == 12 and Store(p).meta.ranks["records"] == records


def test_negative_rank_is_one_line(tmp_path: Path) -> None:
    p = tmp_path / "neg.zarr"
    with gf.Recorder(p, sources=["a"], mode="replay") as rec:
        for q in (0, -1, 1):
            rec.record(step=0, loss=1.0, source="a", rank=q, grads={"w": np.ones(4, np.float32)})
    with pytest.raises(CorruptStoreError, match=r"batches/rank is -1 at record 1 .*expected a rank >= 0"):
        Store(p).batches()


def test_rankconsistency_finds_the_rank_in_the_long_history_regime(tmp_path: Path) -> None:
    p = replicated_store(tmp_path / "long.zarr", 5, world=WORLD, bad_rank=1, error=1e-3)
    exact = gf.analyze(p, only="rankconsistency", options={"engine": {"persist": False}}, progress=False)
    long = gf.analyze(p, only="rankconsistency", options={"engine": {"long_history": 0, "persist": False}},
                      progress=False)
    assert long.header["regime"]["name"] == "long-history" and exact.header["regime"]["name"] == "exact"
    assert [(x.kind, x.evidence["rank"], x.tensor) for x in long.flags] == [("rank_disagreement", 1, "a.weight")]
    assert long.flags[0].evidence["max_rel_diff"] == pytest.approx(1e-3 / 1.001, rel=1e-3)
    # the same table in both regimes: every tensor whole and every head of the head-split b.weight (3 heads)
    t_long, t_exact = long.table("rankconsistency"), exact.table("rankconsistency")
    assert len(t_long) == WORLD * (1 + 1 + 3)
    key = ["tensor", "head", "rank"]
    assert t_long.sort_values(key, na_position="first").reset_index(drop=True).equals(
        t_exact.sort_values(key, na_position="first").reset_index(drop=True))
