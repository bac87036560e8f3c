"""Issue 28, per-tensor overheads: the plans and readers taken for stores of many small tensors, each
against an oracle (dask's own chunks, NumPy's products and ``numpy.load``), and stores saved before
still load."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pandas as pd
import pytest

from gradforensics.analysis.engine.results import load_grams, save_grams
from gradforensics.analysis.engine.seriesimage import pack_series, parse_series
from gradforensics.errors import CorruptStoreError
from gradforensics.store.reader import Store
from gradforensics.testing.planted import write_store


def _many(path, n_tensors=6, n=40, seed=0):
    """A store of several small tensors (two of them split in heads) with a periodic loss."""
    rng = np.random.default_rng(seed)
    shapes = {f"model.layers.{i}.attn.q": (8, 4) for i in range(2)}
    shapes |= {f"model.layers.{i}.mlp.up": (6, 5) for i in range(n_tensors - 2)}
    base = {t: rng.standard_normal(s).astype(np.float32) for t, s in shapes.items()}

    def grads(i, src, rng):
        sign = 1.0 if src == "a" else -1.0
        return {t: sign * base[t] + rng.standard_normal(s).astype(np.float32) for t, s in shapes.items()}

    write_store(path, grads, n, ("a", "b"), heads={t: 4 for t in shapes if "attn" in t}, records_per_chunk=8)
    return path


# ------------------------------------------------------------------ planning without dask arrays
@pytest.mark.parametrize("slab_bytes", [None, 1 << 16, 1 << 20, 128 << 20])
def test_store_chunks_are_the_dask_arrays_chunks(tmp_path, slab_bytes) -> None:
    store = Store(_many(tmp_path / "s.zarr"))
    for name in store.arrays:
        assert store.chunks(name, slab_bytes) == store.lazy(name, slab_bytes).chunks, name


@pytest.mark.parametrize("slab_bytes", [None, 1 << 16])
def test_slab_outputs_are_the_gram_matrices_and_reductions_numpy_gives(tmp_path, slab_bytes) -> None:
    import dask

    from gradforensics.analysis.contract.grams import SlabReduction
    from gradforensics.analysis.engine.gram import slab_outputs

    store = Store(_many(tmp_path / "s.zarr"))
    tensor = store.tensors[0]                       # a head-split tensor (4 heads)
    reds = [SlabReduction(tensor, chunk=lambda x, sel: x.sum(axis=0), combine=lambda ps: sum(ps)),
            SlabReduction(tensor, chunk=lambda x, sel: float(np.abs(x).max()), combine=max)]
    kw = {} if slab_bytes is None else {"slab_bytes": slab_bytes}
    g, parts = slab_outputs(store, tensor, reds, **kw)
    got_g, total, most = dask.compute(g, *parts, scheduler="sync")
    x = np.asarray(store.read(store.grads[tensor].name), dtype=np.float64)
    n = x.shape[0]
    # float32 products (eps 6e-8) over a few features, summed in float64; sums of float32 over 40 records
    units = [x.reshape(n, -1)] + [x[:, h].reshape(n, -1) for h in range(x.shape[1])]
    assert [(r.tensor, r.head) for r in got_g] == [(tensor, None), *((tensor, h) for h in range(x.shape[1]))]
    for r, u in zip(got_g, units, strict=True):
        k = u @ u.T
        np.testing.assert_allclose(r.gram, k, rtol=1e-6, atol=1e-6 * k.diagonal().max())
    np.testing.assert_allclose(total, x.sum(axis=0), rtol=1e-5, atol=1e-5 * np.abs(x).sum(axis=0).max())
    assert most == np.abs(x).max()                 # a max of stored floats: exact
    none, only = slab_outputs(store, tensor, reds[:1], gram=False, **kw)
    assert none is None
    np.testing.assert_allclose(dask.compute(only[0], scheduler="sync")[0], total, rtol=1e-6)


# ------------------------------------------------------------------ series maths memoised
def _clear_signal_caches() -> None:
    from gradforensics.analysis.toolkit.signal import background, detrending, spectrum, trend, welch

    spectrum.detrender_grid.cache_clear()
    detrending.savgol_coeffs.cache_clear()
    trend.log_time_bases.cache_clear()
    welch.hann.cache_clear()
    background.welch_dof.cache_clear()


def test_shared_gain_grid_is_the_reference_autocovariance() -> None:
    from gradforensics.analysis.toolkit.signal import background as bg
    from gradforensics.analysis.toolkit.signal.detrending import detrend

    det = detrend(np.random.default_rng(1).standard_normal(64).cumsum())
    gain = det.gain_grid(1 << 14)
    grid = bg.GainGrid(gain)
    for a in (-0.95, -0.3, 0.0, 0.41, 0.9, 0.995, 0.41):        # 0.41 twice: the memoised value
        np.testing.assert_allclose(grid.acov_rows(np.array([a]))[0, :40], bg.filtered_ar1_acov(a, gain, 40), rtol=1e-12)
    r = np.random.default_rng(2).standard_normal(64)
    assert bg.fit_ar1(r, grid) == bg.fit_ar1(r, gain)


def test_series_tables_equal_the_per_series_reference(tmp_path) -> None:
    """loss_spectrum and fractal over a multi-tensor store: the stacked, memoised run equals the run with
    every cache emptied before each series, to 1e-9 (a stack's BLAS products may round differently)."""
    from gradforensics.analysis.kinds import fractal, loss_spectrum
    from gradforensics.analysis.toolkit.series import from_batches
    from gradforensics.analysis.toolkit.signal.spectrum import SpectrumOptions

    store = Store(_many(tmp_path / "s.zarr", n=64))
    rng = np.random.default_rng(3)
    grams = {}
    from gradforensics.analysis.contract.grams import GramResult

    for t in store.tensors:      # gradient norms of different shapes per tensor, all of the store's length
        x = rng.standard_normal((64, 5)) * (1 + 0.3 * np.sin(np.arange(64) / 3))[:, None]
        grams[(t, None)] = GramResult(t, None, x @ x.T, np.zeros(64, np.int64), 5, False)
    groups = from_batches(store.batches(), grams)
    assert len(groups) == len(store.tensors) + 1
    for mod in (loss_spectrum, fractal):
        for opt in (SpectrumOptions(), SpectrumOptions(detrend="diff")):
            _clear_signal_caches()
            shared = mod.analyze_series(groups, opt)
            ref_tables, ref_series = [], {}
            for g in groups:
                _clear_signal_caches()
                one = mod.analyze_series([g], opt)
                ref_tables.append(one.table)
                ref_series |= one.series
            ref = pd.concat(ref_tables, ignore_index=True)
            pd.testing.assert_frame_equal(shared.table, ref, check_exact=False, rtol=1e-9, check_dtype=False)
            assert sorted(shared.series) == sorted(ref_series)
            for k in ref_series:
                np.testing.assert_allclose(shared.series[k], ref_series[k], rtol=1e-9,
                                           atol=1e-9 * float(np.abs(ref_series[k]).max(initial=0)))


# ------------------------------------------------------------------ saved results
@pytest.mark.slow
def test_gram_matrices_many_a_chunk_and_the_old_layout_still_loads(tmp_path, monkeypatch) -> None:
    from gradforensics.analysis.contract.grams import GramResult
    from gradforensics.store import results as raw

    store = Store(_many(tmp_path / "s.zarr"))
    n = store.n_records
    rng = np.random.default_rng(4)
    grams = {(f"t{i}", None): GramResult(f"t{i}", None, rng.standard_normal((n, n)), rng.integers(0, 2, n), 7, False)
             for i in range(40)}
    save_grams(store, grams)
    saved = Store(store.path)
    assert saved.arrays[raw.GRAM_ARRAY].chunks[0] == 40           # 40 matrices of 40x40: one chunk
    back = load_grams(saved)
    assert all(back[k].gram.tobytes() == g.gram.tobytes() and np.array_equal(back[k].nonfinite, g.nonfinite)
               for k, g in grams.items())
    monkeypatch.setattr(raw, "gram_chunk_rows", lambda m, n: 1)   # the layout stores were saved with before
    save_grams(store, grams)
    old = Store(store.path)
    assert old.arrays[raw.GRAM_ARRAY].chunks[0] == 1
    assert all(load_grams(old)[k].gram.tobytes() == g.gram.tobytes() for k, g in grams.items())
    assert raw.gram_chunk_rows(3, 4096) == 1 and raw.gram_chunk_rows(0, 8) == 1


@pytest.mark.slow
def test_old_layout_results_still_report(tmp_path, monkeypatch) -> None:
    """A store analysed with one Gram matrix a chunk (the layout before) renders with the same flags."""
    import json

    from gradforensics.analysis.engine.run import analyze
    from gradforensics.cli import main
    from gradforensics.store import results as raw

    path = _many(tmp_path / "s.zarr")
    monkeypatch.setattr(raw, "gram_chunk_rows", lambda m, n: 1)
    found = analyze(path, only=["noise", "loss_spectrum"], progress=False)
    monkeypatch.undo()
    assert Store(path).arrays[raw.GRAM_ARRAY].chunks[0] == 1
    assert main(["report", str(path), "--out", str(tmp_path / "r")]) == 0
    flags = json.loads((tmp_path / "r" / "flags.json").read_text())
    assert json.loads(json.dumps(found.flags_json(), default=float)) == flags


def _reference_parse(raw: np.ndarray) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(raw.tobytes()), allow_pickle=False) as z:
        return {str(k): z[f"s{i}"] for i, k in enumerate(z["__keys__"])}


def test_series_image_read_in_place_equals_np_load() -> None:
    rng = np.random.default_rng(5)
    series = {"a/x": rng.standard_normal(5), "b": np.asfortranarray(rng.standard_normal((3, 4))),
              "c": np.zeros(0), "d": np.array(3.0), "e": np.array(["x", "yy"]), "f": np.arange(6).reshape(2, 3),
              "g": np.ones(3, np.uint8), **{f"many/{i}": rng.standard_normal(7) for i in range(300)}}
    raw = pack_series(series)
    got, ref = parse_series(raw), _reference_parse(raw)
    assert list(got) == list(ref) == list(series)
    for k, v in ref.items():
        assert (got[k].dtype, got[k].shape, got[k].tobytes()) == (v.dtype, v.shape, v.tobytes()), k
        assert got[k].flags.f_contiguous == v.flags.f_contiguous and got[k].flags.writeable
    got["a/x"][0] = 1.0                                            # writable, and its own
    old = io.BytesIO()                                             # an image as np.savez wrote it (stores before)
    np.savez(old, **{f"s{i}": v for i, v in enumerate(series.values())}, __keys__=np.asarray(list(series), dtype=str))
    before = parse_series(np.frombuffer(old.getvalue(), np.uint8))
    assert all(before[k].tobytes() == v.tobytes() and before[k].shape == v.shape for k, v in ref.items())
    assert parse_series(raw)["a/x"][0] == series["a/x"][0]


def test_series_image_damage_is_refused() -> None:
    raw = pack_series({"k": np.arange(64, dtype=np.float64)}).copy()
    with zipfile.ZipFile(io.BytesIO(raw.tobytes())) as zf:
        info = zf.getinfo("s0.npy")
    raw[info.header_offset + 200] ^= 0xFF                         # a flipped byte inside the data
    with pytest.raises(CorruptStoreError, match=r"is not a series image.*CRC"):
        parse_series(raw)
    with pytest.raises(CorruptStoreError, match="is not a series image"):
        parse_series(pack_series({"k": np.zeros(3)})[:-30])         # truncated


# ------------------------------------------------------------------ figures
def test_evidence_ticks_thinned_to_the_cap() -> None:
    from matplotlib.figure import Figure

    from gradforensics.reporting.figures import MAX_TICK_LABELS, thin_ticks

    fig = Figure()
    ax = fig.add_subplot()
    labels = [f"model.layers.{i}.w" for i in range(500)]
    ax.set_xticks(range(500), labels, rotation=90, fontsize=6)
    ax.set_yticks([0, 1, 2], ["a", "b", "c"])
    thin_ticks(ax)
    kept = [t.get_text() for t in ax.get_xticklabels()]
    step = -(-500 // MAX_TICK_LABELS)
    assert kept == labels[::step] and len(kept) <= MAX_TICK_LABELS
    assert {t.get_rotation() for t in ax.get_xticklabels()} == {90.0}
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]
