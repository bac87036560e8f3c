"""The long-history regime's super-record Gram matrices spilled to disk, and the exact regime's disk peak.

:mod:`gradforensics.analysis.engine.spill`: a long-history pass writes each unit's
super-record Gram matrix (``m × m`` float64, 512 KiB a unit by default) under ``TMPDIR`` as
the pass computes it and reads it back one unit at a time; the tables, series and flags
are the in-memory pass's within float64 rounding (heads, a non-finite record, planted trouble
and a healthy control), under the local scheduler and a ``dask.distributed`` client.  Too little
room under ``TMPDIR`` holds them in memory with a one-line warning, or refuses in one line
when spilling was asked for.  Saving the exact regime's spilled matrices into the store frees
each file once its bytes are written there: the bytes on disk (spill + store) peak at one
copy and a batch, not two copies.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from _findings import close_findings, spill_heads_store, use_tmp_root

import gradforensics as gf
from gradforensics.analysis import registered
from gradforensics.analysis.contract.grams import LongGram
from gradforensics.analysis.contract.model import Analysis, AnalysisResult, Context, Need
from gradforensics.analysis.engine import spill as spill_mod
from gradforensics.analysis.engine.results import load_grams
from gradforensics.analysis.engine.spill import SPILL_RESERVE, GramSpill, write_spilled
from gradforensics.errors import WriteRefusedError
from gradforensics.store import results as store_results
from gradforensics.store.reader import Store
from gradforensics.store.zarr_backend import ZarrBackend
from gradforensics.testing.planted_long import CONFLICT, DRIFT, HEALTHY, OSC, long_history_store

N = 512
READERS = "drift,oscillation,conflict,noise,nonfinite,toy_long_probe"
FEW = {"conflict": {"permutations": 99}}
LONG = {"long_history": 0, "persist": False}


@pytest.fixture(scope="module")
def heads_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """3 tensors, two in 4 heads (11 units), 512 records; source b's mean opposes a's; one non-finite record."""
    return spill_heads_store(tmp_path_factory.mktemp("spill") / "heads.zarr", N, 200)


@pytest.fixture
def tmp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return use_tmp_root(tmp_path, monkeypatch)



def _files(root: Path) -> int:
    return sum(len(list(d.iterdir())) for d in root.glob("gradforensics-grams-*"))


def _probe(seen: list[Any]) -> Analysis:
    """An analysis that notes, in the long regime, where each unit's super-record Gram matrix is."""
    def compute(ctx: Context) -> AnalysisResult:
        assert ctx.long is not None
        held = sum(g.super_gram is not None for g in ctx.long.grams.values())
        seen.append((held, _files(Path(tempfile.gettempdir()))))
        return AnalysisResult(table=pd.DataFrame({"n": [len(ctx.long.grams)]}))

    return Analysis("toy_long_probe", (Need.GRAM,), compute, lambda res, ctx: [], lambda res, ax: None,
                    long_history=True)


def test_a_spilled_long_gram_is_the_one_held_in_memory(tmp_root: Path) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 4))
    K = x @ x.T
    K.flags.writeable = False
    held = LongGram("w", 1, K, np.zeros(6, np.int64), None, 40, np.array([3]), np.array([2]), 4)  # type: ignore[arg-type]
    with GramSpill() as spill:
        assert spill.start(1, 6, True) is None and spill.directory is not None
        [spilled] = write_spilled(spill.directory, 7, [held])
        assert isinstance(spilled, LongGram) and spilled.super_gram is None and spilled.super_path is not None
        assert Path(spilled.super_path).parent == Path(spill.directory)
        got = spilled.super_matrix()
        assert got.dtype == np.float64 and np.array_equal(got, K) and not got.flags.writeable     # stored float64: exact
        assert (spilled.tensor, spilled.head, spilled.n_records, spilled.bad.tolist()) == ("w", 1, 40, [3])
        assert np.array_equal(spilled.nonfinite, held.nonfinite) and held.super_matrix() is K
    assert list(tmp_root.iterdir()) == []
    with pytest.raises(ValueError, match="neither its super-record Gram matrix nor its file"):
        LongGram("w", None, None, K, None, 1, K, K, 1).super_matrix()  # type: ignore[arg-type]


def test_a_full_disk_while_spilling_is_one_line_naming_the_unit(tmp_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    K = np.eye(4)
    g = LongGram("w", 2, K, np.zeros(4, np.int64), None, 8, np.zeros(0, np.int64), np.zeros(0, np.int64), 4)  # type: ignore[arg-type]

    class Full:                                           # a file on a disk that fills up at the first write
        def __init__(self, path: str, mode: str) -> None:
            self._f = open(path, mode)                     # noqa: SIM115

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self._f.close()

        def write(self, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with GramSpill() as spill:
        assert spill.start(1, 4, True) is None and spill.directory is not None
        monkeypatch.setattr(spill_mod, "open", Full, raising=False)   # between the room check and the write
        with pytest.raises(WriteRefusedError) as info:
            write_spilled(spill.directory, 0, [g])
    msg = str(info.value)
    assert "\n" not in msg and "the Gram matrix of w head 2 could not be spilled (No space left on device)" in msg
    assert msg.endswith("point TMPDIR at a disk with room, or pass options={'engine': {'spill': False}} "
                        "(hold them in memory).")


@pytest.mark.slow                   # about 6 s: four long-history passes of 11 units
def test_the_spilled_long_pass_matches_the_pass_in_memory(heads_store: str, tmp_root: Path) -> None:
    seen: list[Any] = []
    with registered(_probe(seen)):
        mem = gf.analyze(heads_store, only=READERS, options={"engine": {**LONG, "spill": False}, **FEW},
                         progress=False)
        disk = gf.analyze(heads_store, only=READERS, options={"engine": {**LONG, "spill": True}, **FEW},
                          progress=False)
    assert seen == [(11, 0), (0, 11)]           # all 11 in memory; then none, 11 files while the analyses ran
    assert mem.header["regime"]["name"] == disk.header["regime"]["name"] == "long-history"
    assert any(f.kind == "conflict" for f in mem.flags) and any(f.kind == "nonfinite" for f in mem.flags)
    close_findings(mem, disk)
    assert list(tmp_root.iterdir()) == []


@pytest.mark.slow                   # about 10 s: the planted long store, written and analysed twice
def test_planted_trouble_and_healthy_controls_are_the_same_spilled(tmp_path: Path, tmp_root: Path) -> None:
    planted = long_history_store(tmp_path / "planted.zarr", n=3000, seed=1)
    opts = {"engine": {"long_history": 1000, "persist": False}, **FEW}
    mem = gf.analyze(planted.path, only="drift,oscillation,conflict,noise",
                     options={**opts, "engine": {**opts["engine"], "spill": False}}, progress=False)
    disk = gf.analyze(planted.path, only="drift,oscillation,conflict,noise",
                      options={**opts, "engine": {**opts["engine"], "spill": True}}, progress=False)
    close_findings(mem, disk)
    flagged = {(f.kind, f.tensor) for f in disk.flags if f.severity >= 0.5}
    assert {("conflict", CONFLICT), ("drift", DRIFT), ("oscillation", OSC[0]), ("oscillation", OSC[1])} <= flagged
    assert not {t for _, t in flagged} & set(HEALTHY)          # the healthy controls: no flag >= 0.5
    assert list(tmp_root.iterdir()) == []


def test_no_room_under_tmpdir_holds_them_in_memory_or_refuses_in_one_line(heads_store: str, tmp_root: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=SPILL_RESERVE + 100_000))
    # spilling asked for: refused before anything is read, in one line
    with pytest.raises(WriteRefusedError) as info:
        gf.analyze(heads_store, only="drift", options={"engine": {**LONG, "spill": True}}, progress=False)
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_root) in msg
    assert "the long-history regime's super-record Gram matrices (11 tensors and heads x 256² super-records" in msg
    assert "and spilling them was asked for (engine option spill = true); point TMPDIR at a disk with room" in msg
    assert list(tmp_root.iterdir()) == []
    # by default (above the size kept in memory anyway): held in memory, said in one line
    monkeypatch.setattr(spill_mod, "SPILL_ABOVE", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = gf.analyze(heads_store, only="drift,noise", options={"engine": LONG}, progress=False)
    [w] = [w for w in caught if "TMPDIR" in str(w.message)]
    assert "\n" not in str(w.message) and "do not fit the 256.1 MiB free" in str(w.message)
    assert "holding them in memory instead" in str(w.message)
    monkeypatch.setattr(shutil, "disk_usage", real)
    mem = gf.analyze(heads_store, only="drift,noise", options={"engine": {**LONG, "spill": False}}, progress=False)
    close_findings(mem, held)
    assert list(tmp_root.iterdir()) == []


@pytest.mark.slow
def test_under_a_distributed_client_the_long_pass_spills_as_results_arrive(heads_store: str, tmp_root: Path) -> None:
    distributed = pytest.importorskip("distributed")
    seen: list[Any] = []
    only = "drift,conflict,toy_long_probe"
    with registered(_probe(seen)):
        mem = gf.analyze(heads_store, only=only, options={"engine": {**LONG, "spill": False}, **FEW}, progress=False)
        with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                      dashboard_address=None) as cluster, distributed.Client(cluster) as client:
            disk = gf.analyze(heads_store, client=client, only=only,
                              options={"engine": {**LONG, "spill": True}, **FEW}, progress=False)
    assert seen == [(11, 0), (0, 11)] and disk.header["scheduler"] == "distributed"
    close_findings(mem, disk)
    assert list(tmp_root.glob("gradforensics-grams-*")) == []


def _bytes(*roots: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for r in roots for d, _, fs in os.walk(r) for f in fs)


def test_saving_a_spilled_pass_does_not_double_the_disk(heads_store: str, tmp_path: Path, tmp_root: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes under TMPDIR and the store, sampled at every write of the save: one copy of the Gram matrices and a batch."""
    store = tmp_path / "copy.zarr"
    shutil.copytree(heads_store, store)
    monkeypatch.setattr(store_results, "GRAM_BATCH", 2)                   # batches of 2 matrices, one a chunk
    monkeypatch.setattr(store_results, "GRAM_CHUNK_BYTES", 8 * N * N)
    monkeypatch.setattr(spill_mod, "SPILL_FILE_BYTES", 2 * 8 * N * N)     # a tensor's units share files of 2
    samples: list[int] = []
    real = ZarrBackend.write_rows

    def sampled(self: Any, name: str, start: int, data: np.ndarray) -> None:
        real(self, name, start, data)
        samples.append(_bytes(tmp_root, store))

    monkeypatch.setattr(ZarrBackend, "write_rows", sampled)
    base = _bytes(store)
    gf.analyze(store, only="drift", options={"engine": {"spill": True, "long_history": N, "save_grams": "all"}},
               progress=False)
    unit = 8 * N * N                                                     # one Gram matrix: 2 MiB
    grams = 11 * unit
    assert len(samples) > 6                                              # 6 batches of k, then the rest
    peak = max(samples) - base
    # one copy, the batch being written (2 units) and the saved part of one spill file (under 2 units);
    # before the save freed the spill: 2 x grams (both copies whole)
    assert grams <= peak <= grams + 2 * unit + 2 * unit + (1 << 20), (peak, grams)
    saved = load_grams(Store(store))
    assert len(saved) == 11 and all(g.gram.shape == (N, N) for g in saved.values())
    assert list(tmp_root.iterdir()) == []
