"""The pass's own work (issue 28, outside the per-unit statistics): a slab reduction with a ``finish``.

Spectral's gradient-window spectra are a slab reduction whose ``finish`` builds one task per
tensor on the window means.  A one-slab tensor is now read and reduced in a fused task
(:mod:`gradforensics.analysis.engine.plan_small`) with the finish built on that task's output;
these tests pin that the fused path is taken, that its spectra are those of the same steps run
by hand on the whole stored array, and that they are the singular values of the window-mean
gradients (NumPy's SVD as the oracle).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gradforensics.analysis.contract.registry import REGISTRY
from gradforensics.analysis.engine.options import split_options
from gradforensics.analysis.engine.run import compute_pass
from gradforensics.analysis.kinds.spectral import reads, spectra
from gradforensics.analysis.toolkit.kspace import window_edges
from gradforensics.store import handles
from gradforensics.store.heads import HeadSpec
from gradforensics.store.reader import Store
from gradforensics.testing.planted_units import planted_spectral_store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    path = planted_spectral_store(tmp_path_factory.mktemp("outside") / "s.zarr", collapse=True, n_records=24,
                                  d=32).path
    return Store(path)


def _pass(store: Store, monkeypatch: pytest.MonkeyPatch, slab_bytes: int | None = None) -> tuple[dict, set]:
    """Spectral's computed values from one pass (no Gram matrices), and the tensors read by fused tasks."""
    fused: set[str] = set()
    original = handles.read_zarr_many

    def counting(many):
        fused.update(name for _, name, _ in many)
        return original(many)

    monkeypatch.setattr(handles, "read_zarr_many", counting)
    a = REGISTRY["spectral"]
    engine, _ = split_options({"engine": {"slab_bytes": slab_bytes}} if slab_bytes else None, [a])
    _, computed = compute_pass(store, [a], engine, None, False, grams=False)
    monkeypatch.undo()
    return computed["spectral"], fused


def _by_hand(store: Store, tensor: str) -> list[dict]:
    """The reduction's chunk, aggregate and finish steps on the whole stored array, in this thread."""
    info = store.grads[tensor]
    x = store.read(info.name)
    edges = window_edges(store.n_records, reads.WINDOWS)
    sel = tuple(slice(0, s) for s in x.shape)
    means = reads.window_means(reads.window_sums(x, sel, edges), edges, tuple(info.shape[1:]))
    return reads.window_spectra(means, len(edges) - 1, HeadSpec.from_attrs(info.attrs))


def _close(a: list[dict], b: list[dict]) -> bool:
    """The same spectra within 1e-6 of σ_1² (the same steps on the same float32 data)."""
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(x[h].exact == y[h].exact and x[h].sv.shape == y[h].sv.shape
                                     and np.allclose(x[h].sv ** 2, y[h].sv ** 2, rtol=0,
                                                     atol=1e-6 * max(float(y[h].sv[0]) ** 2, 1e-300))
                                     and np.isclose(x[h].fro2, y[h].fro2, rtol=1e-6) for h in x)
        for x, y in zip(a, b, strict=True))


def test_fused_window_spectra_are_the_steps_floats_and_the_svd(store, monkeypatch) -> None:
    got, fused = _pass(store, monkeypatch)
    tensors = sorted(t for t in store.grads if f"gradient|{t}" in got)
    assert len(tensors) == 8
    assert {f"grads/{t}" for t in tensors} <= fused, "the one-slab tensors were not read by fused tasks"
    edges = window_edges(store.n_records, reads.WINDOWS)
    for t in tensors:
        points = got[f"gradient|{t}"]
        assert _close(points, _by_hand(store, t)), t
        x = store.read(store.grads[t].name).astype(np.float64)
        x = x.reshape(x.shape[0], *store.grads[t].attrs["shape"]) if store.grads[t].heads is None else x
        for w, (lo, hi) in enumerate(itertools.pairwise(edges)):
            mean = x[int(lo):int(hi)].mean(axis=0)
            whole = mean if store.grads[t].heads is None else HeadSpec.from_attrs(
                store.grads[t].attrs).merge(mean)
            sv = np.linalg.svd(whole, compute_uv=False)
            assert points[w][None].sv[0] == pytest.approx(sv[0], rel=1e-5)
            assert points[w][None].fro2 == pytest.approx(float(np.sum(whole ** 2)), rel=1e-5)
        last = points[-1][None]
        # the float32 Gram side's eigenvalues: sigma^2 to ~1e-6 sigma_max^2 (singular_values' docstring)
        assert last.exact and np.allclose(last.sv ** 2, sv ** 2, rtol=1e-4, atol=1e-5 * sv[0] ** 2)


def test_fused_and_sliced_passes_give_the_same_spectral_table(store, monkeypatch) -> None:
    """Tiny slabs (several a tensor: no fusion) and the fused pass: the same spectra, within float32 sums."""
    fused_vals, fused = _pass(store, monkeypatch)
    sliced_vals, none = _pass(store, monkeypatch, slab_bytes=1 << 16)
    assert fused and not any(n.startswith("grads/") for n in none)
    assert fused_vals.keys() == sliced_vals.keys()
    for key, a in fused_vals.items():
        if not key.startswith("gradient|"):
            continue
        b = sliced_vals[key]
        for x, y in zip(a, b, strict=True):
            for h in x:
                np.testing.assert_allclose(x[h].sv ** 2, y[h].sv ** 2, rtol=1e-4, atol=1e-5 * y[h].sv[0] ** 2)


def _random_matrices(rng: np.random.Generator, n: int) -> tuple[list[np.ndarray], list[bool]]:
    """Matrices of a few shared shapes (and some one-offs), float32 and float64, with zeros, NaN, inf, ties."""
    shapes = [(4, 32), (32, 4), (32, 32), (1, 7), (7, 1), (70, 80), (3, 3)]
    ms, tops = [], []
    for i in range(n):
        shape = shapes[int(rng.integers(len(shapes)))] if i % 5 else tuple(int(v) for v in rng.integers(1, 12, 2))
        m = rng.standard_normal(shape) * float(rng.choice([1e-20, 1e-3, 1.0, 1e3]))
        kind = int(rng.integers(6))
        if kind == 1:
            m[..., : max(1, shape[-1] // 2)] = 0.0
        elif kind == 2:
            m.flat[int(rng.integers(m.size))] = np.nan
        elif kind == 3:
            m.flat[int(rng.integers(m.size))] = np.inf
        elif kind == 4:
            m[:] = 2.5                                  # rank one, tied zeros in the spectrum
        elif kind == 5:
            m = np.zeros(shape)
        ms.append(m.astype(np.float32) if rng.random() < 0.7 else m)
        tops.append(bool(rng.random() < 0.5))
    return ms, tops


def _svd_oracle(m: np.ndarray) -> np.ndarray:
    """NumPy's singular values of *m* in float64, non-finite entries as 0 (what the spectra read)."""
    a = np.asarray(m, dtype=np.float64)
    return np.linalg.svd(np.where(np.isfinite(a), a, 0.0), compute_uv=False)


def _check_spectrum(s, m: np.ndarray, top: bool) -> None:
    """One spectrum against the SVD: σ² to 1e-5 σ_1² (float32 Gram side; 1e-12 in float64), ``‖W‖_F²`` to 1e-6."""
    ref = _svd_oracle(m)
    tol = 1e-5 if np.asarray(m).dtype == np.float32 else 1e-12
    scale = max(ref[0] ** 2, np.finfo(np.float64).tiny)
    np.testing.assert_allclose(s.fro2, np.sum(ref ** 2), rtol=1e-6, atol=1e-300)
    if top and min(np.shape(m)) > spectra.TOP_MIN_DIM:
        assert s.sv.size == 1 and not s.exact
        np.testing.assert_allclose(s.sv[0] ** 2, ref[0] ** 2, rtol=tol, atol=tol * scale)
    else:
        assert s.exact and s.sv.size == ref.size
        np.testing.assert_allclose(s.sv ** 2, ref ** 2, rtol=0, atol=tol * scale)


def test_stacked_singular_values_are_numpys_svd() -> None:
    """Every matrix of a stack (shared shapes, one-offs, float32/float64, zeros, NaN, inf, ties) against
    ``np.linalg.svd``; the single-matrix call is a stack of one."""
    rng = np.random.default_rng(28)
    for _ in range(20):
        ms, tops = _random_matrices(rng, int(rng.integers(1, 60)))
        got = spectra.stacked_singular_values(ms, tops)
        assert len(got) == len(ms)
        for g, m, t in zip(got, ms, tops, strict=True):
            _check_spectrum(g, m, t)
    assert spectra.stacked_singular_values([], []) == []
    _check_spectrum(spectra.singular_values(ms[0], top_only=tops[0]), ms[0], tops[0])


def test_window_spectra_are_the_svd_of_each_window_mean(store) -> None:
    """All windows of a tensor in one stacked call: each window's whole matrix and heads against NumPy's SVD of
    the window-mean gradient (every window but the last: σ_1 alone)."""
    for t in sorted(store.grads):
        info = store.grads[t]
        if not reads.is_matrix(info.attrs, info.shape):
            continue
        x = store.read(info.name)
        edges = window_edges(store.n_records, reads.WINDOWS)
        sel = tuple(slice(0, s) for s in x.shape)
        means = reads.window_means(reads.window_sums(x, sel, edges), edges, tuple(info.shape[1:]))
        spec = HeadSpec.from_attrs(info.attrs)
        got = reads.window_spectra(means, len(edges) - 1, spec)
        for w, points in enumerate(got):
            keys, mats = spectra.block_matrices(np.asarray(means[w], dtype=np.float32), spec, spec is not None)
            assert list(points) == keys
            for h, m in zip(keys, mats, strict=True):
                _check_spectrum(points[h], m, w < len(edges) - 2)
