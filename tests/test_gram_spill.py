"""The exact regime's Gram matrices spilled to disk as the pass computes them, and ``N₀`` by the largest tensor.

:mod:`gradforensics.analysis.engine.spill`: the spilled mapping gives the very Gram matrices
the in-memory pass holds; a spilled pass gives the same tables, series and flags (within
float64 rounding: :data:`_findings.RTOL`) and saved Gram matrices as one held in memory, under
the local scheduler and a ``dask.distributed`` client; its private directory under ``TMPDIR`` is gone after the pass, also when an
analysis raises; too little room there falls back to the long-history regime in one line
(the same tables as the forced long regime), or refuses in one line when the exact regime
was asked for; and ``N₀`` depends on the largest tensor's units, not on the store's count.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from _findings import close_findings, spill_heads_store, use_tmp_root

import gradforensics as gf
from gradforensics.analysis import registered
from gradforensics.analysis.contract.grams import GramResult
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Need
from gradforensics.analysis.engine.longhistory import threshold
from gradforensics.analysis.engine.options import EngineOptions, select_analyses
from gradforensics.analysis.engine.plan import n_units, units_at_once
from gradforensics.analysis.engine.results import gram_arrays, load_grams
from gradforensics.analysis.engine.run import compute_pass
from gradforensics.analysis.engine.spill import SPILL_RESERVE, GramSpill, SpilledGrams, fits_on_disk, write_spilled
from gradforensics.analysis.kinds.noise.table import noise_table
from gradforensics.analysis.toolkit.parallel import map_units, unit_threads
from gradforensics.analysis.toolkit.series import from_batches
from gradforensics.analysis.toolkit.units import Units as units_of
from gradforensics.errors import SpecError, WriteRefusedError
from gradforensics.store.reader import Store

N = 64
#: The analyses that read ``ctx.grams`` (every consumer of the spilled mapping), and the probe.
READERS = "drift,oscillation,conflict,noise,nonfinite,toy_spill_probe"
FEW = {"conflict": {"permutations": 99}}          # the same code path, a tenth of the permutations


@pytest.fixture(scope="module")
def heads_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """3 tensors, two in 4 heads (11 units), 64 records; source b's mean opposes a's; one non-finite record."""
    return spill_heads_store(tmp_path_factory.mktemp("spill") / "heads.zarr", N, 20)


@pytest.fixture
def tmp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return use_tmp_root(tmp_path, monkeypatch)




def _spills(root: Path) -> list[Path]:
    return sorted(root.glob("gradforensics-grams-*"))


def _probe(seen: list[Any], raise_: bool = False) -> Analysis:
    """An analysis that notes what ``ctx.grams`` is and what the spill directory holds (and may raise)."""
    def compute(ctx: Context) -> AnalysisResult:
        seen.append((type(ctx.grams).__name__, sum(len(list(d.iterdir())) for d in _spills(Path(tempfile.gettempdir())))))
        if raise_:
            raise RuntimeError("planted failure inside an analysis")
        return AnalysisResult(table=pd.DataFrame({"n": [len(ctx.grams)]}))

    return Analysis("toy_spill_probe", (Need.GRAM,), compute, lambda res, ctx: [], lambda res, ax: None)


def test_spilled_mapping_gives_the_grams_held_in_memory(tmp_root: Path) -> None:
    rng = np.random.default_rng(1)
    results = []
    for tensor, heads in (("w", [None, 0, 1]), ("v", [None])):
        for h in heads:
            x = rng.standard_normal((10, 7))
            bad = np.zeros(10, np.int64)
            bad[3] = 2
            results.append(GramResult(tensor, h, x @ x.T, bad, 7, from_sketch=tensor == "v"))
    with GramSpill() as spill:
        assert spill.start(4, 10, None) is None and not spill.on_disk       # 3 KiB: kept in memory
        assert spill.start(4, 10, True) is None and spill.on_disk
        assert spill.directory is not None and Path(spill.directory).parent == tmp_root
        entries = write_spilled(spill.directory, 0, results[:3]) + write_spilled(spill.directory, 1, results[3:])
        grams = GramSpill.grams({"w": entries[:3], "v": entries[3:]})
        # one file per tensor: w's three units share one, v has its own
        assert isinstance(grams, SpilledGrams) and len(list(Path(spill.directory).iterdir())) == 2
        assert list(grams) == [(r.tensor, r.head) for r in results] and len(grams) == 4
        assert ("w", 1) in grams and ("w", 2) not in grams and grams.get(("w", 2)) is None
        for r in results:
            g = grams[(r.tensor, r.head)]
            assert g.gram.dtype == np.float64 and np.array_equal(g.gram, r.gram)      # stored float64: exact
            assert np.array_equal(g.nonfinite, r.nonfinite) and np.array_equal(g.finite, r.finite)
            assert (g.tensor, g.head, g.n_features, g.from_sketch) == (r.tensor, r.head, 7, r.from_sketch)
        scribbled = grams[("w", 0)].gram
        scribbled[:] = -1.0                                  # copy-on-write: the file keeps the matrix
        assert np.array_equal(grams[("w", 0)].gram, results[1].gram)
    assert list(tmp_root.iterdir()) == []


@pytest.mark.slow                   # about 4 s warm; up to 10 s cold on a loaded machine (first analyze imports)
def test_spilled_pass_matches_the_pass_in_memory_and_leaves_nothing_behind(heads_store: str, tmp_root: Path) -> None:
    seen: list[Any] = []
    with registered(_probe(seen)):
        mem = gf.analyze(heads_store, only=READERS, options={"engine": {"spill": False, "persist": False}, **FEW},
                         progress=False)
        disk = gf.analyze(heads_store, only=READERS, options={"engine": {"spill": True, "save_grams": "all"}, **FEW},
                          progress=False)
    assert seen == [("dict", 0), ("SpilledGrams", 3)]      # 11 units on disk, a file a tensor (3)
    assert len(mem.flags) > 0 and disk.header["regime"] == mem.header["regime"] == {"name": "exact", "n0": 3663}
    close_findings(mem, disk)
    # the Gram matrices saved into the store (streamed from the spill) are the in-memory pass's
    store = Store(heads_store)
    held, _ = compute_pass(store, select_analyses("drift"), EngineOptions(persist=False), None, False)
    saved = load_grams(store)
    assert set(saved) == set(held)
    for k, g in held.items():
        assert np.array_equal(saved[k].gram, g.gram) and np.array_equal(saved[k].nonfinite, g.nonfinite)
    assert list(tmp_root.iterdir()) == []


def test_the_spill_directory_is_removed_when_an_analysis_raises(heads_store: str, tmp_root: Path) -> None:
    seen: list[Any] = []
    with registered(_probe(seen, raise_=True)), pytest.raises(RuntimeError, match="planted failure"):
        gf.analyze(heads_store, only="drift,toy_spill_probe", options={"engine": {"spill": True, "persist": False}},
                   progress=False)
    assert seen == [("SpilledGrams", 3)]
    assert list(tmp_root.iterdir()) == []


def test_no_room_under_tmpdir_falls_back_to_the_long_regime_in_one_line(heads_store: str, tmp_root: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.disk_usage
    free = SPILL_RESERVE + 100_000                           # room for 11 Gram matrices of 33 records, not 64
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free))
    only = "drift,noise,nonfinite"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fell = gf.analyze(heads_store, only=only, options={"engine": {"spill": True, "persist": False}},
                          progress=False)
    [w] = [w for w in caught if "TMPDIR" in str(w.message)]
    msg = str(w.message)
    assert "\n" not in msg and str(tmp_root) in msg and "= 353.4 KiB) do not fit the 256.1 MiB free" in msg and "11 tensors and heads x 64²" in msg
    assert "long-history regime instead (N₀ = 33 for this pass)" in msg
    assert fits_on_disk(11, free) == 33 == math.isqrt(((free - SPILL_RESERVE) // 11 - 128) // 8)
    assert fell.header["regime"]["name"] == "long-history" and fell.header["regime"]["n0"] == 33
    forced = gf.analyze(heads_store, only=only, options={"engine": {"long_history": 0, "persist": False}},
                        progress=False)
    close_findings(forced, fell)                                      # the long regime's tables, as if forced
    # the exact regime asked for: refused before anything is read, in one line
    with pytest.raises(WriteRefusedError, match=r"do not fit .*\(TMPDIR\), and the exact regime was asked for \(engine option long_history = 64\); point TMPDIR") as info:
        gf.analyze(heads_store, only="drift", options={"engine": {"spill": True, "long_history": 64, "persist": False}},
                   progress=False)
    assert "\n" not in str(info.value)
    assert list(tmp_root.iterdir()) == []


def test_n0_follows_the_largest_tensor_not_the_unit_count(heads_store: str) -> None:
    assert threshold(1) == 4096                 # a plain tensor: the cap
    assert threshold(5) == 3663 == math.isqrt(512 * 2**20 // (8 * 5))
    assert threshold(9) == 2730                 # 8 heads (the realistic-shape store, 936 units in all)
    assert threshold(33) == 1426                # 32 heads (a 7B shape, 4,320 units in all)
    assert threshold(4320) == 124 and threshold(936) == 267    # what N₀ was with every unit counted
    assert threshold(33, 10) == 10 and threshold(33, 0) == 0
    store = Store(heads_store)
    assert (n_units(store), units_at_once(store)) == (11, 5)
    assert EngineOptions().n0(units_at_once(store)) == 3663
    with pytest.raises(SpecError, match="engine option spill must be true, false or null"):
        EngineOptions(spill="yes")  # type: ignore[arg-type]


@pytest.mark.slow
def test_under_a_distributed_client_the_client_spills_as_results_arrive(heads_store: str, tmp_root: Path) -> None:
    distributed = pytest.importorskip("distributed")
    seen: list[Any] = []
    with registered(_probe(seen)):
        mem = gf.analyze(heads_store, only="drift,conflict,toy_spill_probe",
                         options={"engine": {"spill": False, "persist": False}, **FEW}, progress=False)
        with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                      dashboard_address=None) as cluster, distributed.Client(cluster) as client:
            disk = gf.analyze(heads_store, client=client, only="drift,conflict,toy_spill_probe",
                              options={"engine": {"spill": True, "persist": False}, **FEW}, progress=False)
    assert seen == [("dict", 0), ("SpilledGrams", 3)] and disk.header["scheduler"] == "distributed"
    close_findings(mem, disk)
    assert _spills(tmp_root) == []           # (the cluster leaves its own scratch space there)


class _Counted(SpilledGrams):
    """The spilled mapping, counting the Gram matrices alive at once (each loaded one, until freed)."""

    def __init__(self, entries: Any) -> None:
        super().__init__(entries)
        self.live = self.most = 0
        self._lock = threading.Lock()

    def __getitem__(self, key: Any) -> GramResult:
        g = super().__getitem__(key)
        with self._lock:
            self.live += 1
            self.most = max(self.most, self.live)
        weakref.finalize(g.gram, self._freed)
        return g

    def _freed(self) -> None:
        with self._lock:
            self.live -= 1


def test_the_consumers_take_one_unit_at_a_time(tmp_root: Path) -> None:
    rng = np.random.default_rng(2)
    n, results = 24, []
    for t in range(10):
        parts = [rng.standard_normal((n, 5)) for _ in range(3)]
        bad = np.zeros(n, np.int64)
        bad[t] = 1
        whole = np.hstack(parts)
        results.append(GramResult(f"layers.{t}.w", None, whole @ whole.T, bad, 15))
        results += [GramResult(f"layers.{t}.w", h, p @ p.T, bad, 5) for h, p in enumerate(parts)]
    held = {(r.tensor, r.head): r for r in results}
    n_samples, src = np.full(n, 8), np.arange(n) % 2
    with GramSpill() as spill:
        assert spill.start(len(results), n, True) is None and spill.directory is not None
        grams = _Counted(write_spilled(spill.directory, 0, results))
        with unit_threads(2):
            got = map_units(lambda u: (u.where(), float(u.gram.sum()), u.n), units_of(grams, np.arange(n)))
        assert got == [(u.where(), float(u.gram.sum()), u.n) for u in units_of(held, np.arange(n))]
        assert grams.most <= 2                   # one a thread, of 40
        for label, fn in (("series", lambda g: from_batches({"loss": np.ones(n)}, g)[1:]),
                          ("noise", lambda g: noise_table(g, n_samples, src, ("a", "b"))),
                          ("saving", lambda g: [a.sum() for a in gram_arrays(g, n).k])):
            grams.most = 0
            a, b = fn(grams), fn(held)
            if label == "noise":
                pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-9)      # float64 rounding
            elif label == "series":
                assert [(x.name, x.combined.y.tolist()) for x in a] == [(x.name, x.combined.y.tolist()) for x in b]
                assert len(a) == 10
            else:
                assert a == b
            assert grams.most <= 2, label          # the one in hand and the next, of 40
