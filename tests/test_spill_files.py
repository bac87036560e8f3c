"""Issue 28: the exact regime's spill writes one file per tensor, not one per unit.

A tensor's Gram matrices (whole, then its heads) are appended to one raw float64 file,
each memory-mapped back at its offset; a new file is begun where one would pass
``SPILL_FILE_BYTES``.  Oracles: every matrix read back equals the one written, bit for
bit (``tobytes``); a file is removed exactly when the last of its units is released.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gradforensics.analysis.contract.grams import GramResult
from gradforensics.analysis.engine import spill as spill_mod
from gradforensics.analysis.engine.spill import GramSpill, SpilledGrams, write_spilled


def _results(rng, tensor: str, heads: list[int | None], n: int) -> list[GramResult]:
    out = []
    for h in heads:
        x = rng.standard_normal((n, 5))
        bad = np.zeros(n, np.int64)
        bad[rng.integers(n)] = 1
        out.append(GramResult(tensor, h, x @ x.T, bad, 5))
    return out


def test_a_tensors_units_share_one_file_and_read_back_bit_for_bit(tmp_path):
    rng = np.random.default_rng(0)
    w = _results(rng, "w", [None, 0, 1, 2, 3], 9)
    v = _results(rng, "v", [None], 9)
    entries = write_spilled(str(tmp_path), 0, w) + write_spilled(str(tmp_path), 1, v)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.0.f8", "1.0.f8"]
    assert [e.offset for e in entries[:5]] == [i * 9 * 9 * 8 for i in range(5)]
    assert (tmp_path / "0.0.f8").stat().st_size == 5 * 9 * 9 * 8
    grams = GramSpill.grams({"w": entries[:5], "v": entries[5:]})
    for r in w + v:
        g = grams[(r.tensor, r.head)]
        assert g.gram.tobytes() == r.gram.tobytes() and g.gram.shape == (9, 9)
        assert np.array_equal(g.nonfinite, r.nonfinite) and g.n_features == 5


def test_files_are_split_at_the_file_bound_and_a_big_matrix_has_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(spill_mod, "SPILL_FILE_BYTES", 3 * 8 * 8 * 8)      # three 8 x 8 matrices a file
    rng = np.random.default_rng(1)
    small = _results(rng, "t", [None, 0, 1, 2, 3, 4, 5], 8)
    entries = write_spilled(str(tmp_path), 7, small)
    assert [Path(e.path).name for e in entries] == ["7.0.f8"] * 3 + ["7.1.f8"] * 3 + ["7.2.f8"]
    assert [e.offset for e in entries] == [0, 512, 1024, 0, 512, 1024, 0]
    big = _results(rng, "b", [None, 0], 20)          # 3,200 B each: over the bound, one file each
    entries_b = write_spilled(str(tmp_path), 8, big)
    assert [Path(e.path).name for e in entries_b] == ["8.0.f8", "8.1.f8"]
    grams = SpilledGrams(entries + entries_b)
    for r in small + big:
        assert grams[(r.tensor, r.head)].gram.tobytes() == r.gram.tobytes()


def test_a_file_goes_when_its_last_unit_is_released(tmp_path):
    rng = np.random.default_rng(2)
    w = _results(rng, "w", [None, 0, 1], 6)
    grams = SpilledGrams(write_spilled(str(tmp_path), 0, w))
    f = tmp_path / "0.0.f8"
    grams.release([("w", None), ("w", 0)])
    assert f.exists()                                        # head 1 still lives there
    assert grams[("w", 1)].gram.tobytes() == w[2].gram.tobytes()
    with pytest.raises(ValueError, match="released"):
        grams[("w", 0)]
    grams.release([("w", 0)])                                 # twice: counted once
    assert f.exists()
    grams.release([("w", 1)])
    assert not f.exists()


def test_spilled_grams_pickle_for_the_workers_without_their_lock(tmp_path):
    """A ``dask.distributed`` client ships ``Context.grams`` to its workers: the copy reads the same bytes and
    releases with a lock of its own (the original's lock is not picklable)."""
    import pickle

    rng = np.random.default_rng(3)
    w = _results(rng, "w", [None, 0], 7)
    grams = SpilledGrams(write_spilled(str(tmp_path), 0, w))
    copy = pickle.loads(pickle.dumps(grams))
    for r in w:
        assert copy[(r.tensor, r.head)].gram.tobytes() == r.gram.tobytes()
    copy.release([("w", None)])
    assert (tmp_path / "0.0.f8").exists() and grams[("w", None)].gram.tobytes() == w[0].gram.tobytes()
