"""The pass's own work (issue 28, outside the per-unit statistics): a slab reduction with a ``finish``.

Spectral's gradient-window spectra are a slab reduction whose ``finish`` builds one task per
tensor on the window means.  A one-slab tensor is read and reduced in a fused task
(:mod:`gradforensics.analysis.engine.plan_small`) with the finish built on that task's output;
these tests pin that the fused path is taken and that its spectra are the singular values of
the window-mean gradients (NumPy's SVD as the oracle), whether the tensor was fused or read in
several slabs; and that the stacked singular values are NumPy's too.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gradforensics.analysis.contract.registry import REGISTRY
from gradforensics.analysis.engine.options import split_options
from gradforensics.analysis.engine.run import compute_pass
from gradforensics.analysis.kinds import spectral
from gradforensics.analysis.toolkit.kspace import window_edges
from gradforensics.store import handles
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


def test_fused_window_spectra_are_the_svd(store, monkeypatch) -> None:
    got, fused = _pass(store, monkeypatch)
    tensors = sorted(t for t in store.grads if f"gradient|{t}" in got)
    assert len(tensors) == 8
    assert {f"grads/{t}" for t in tensors} <= fused, "the one-slab tensors were not read by fused tasks"
    edges = window_edges(store.n_records, spectral.WINDOWS)
    for t in tensors:
        spectra = got[f"gradient|{t}"]
        x = store.read(store.grads[t].name).astype(np.float64)
        x = x.reshape(x.shape[0], *store.grads[t].attrs["shape"]) if store.grads[t].heads is None else x
        for w, (lo, hi) in enumerate(itertools.pairwise(edges)):
            mean = x[int(lo):int(hi)].mean(axis=0)
            whole = mean if store.grads[t].heads is None else spectral.HeadSpec.from_attrs(
                store.grads[t].attrs).merge(mean)
            sv = np.linalg.svd(whole, compute_uv=False)
            assert spectra[w][None].sv[0] == pytest.approx(sv[0], rel=1e-5)
            assert spectra[w][None].fro2 == pytest.approx(float(np.sum(whole ** 2)), rel=1e-5)
        last = spectra[-1][None]
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


def test_stacked_singular_values_are_numpys() -> None:
    """Every matrix of a stack (shapes shared and not, float32 and float64, rank one, zero): its singular
    values are ``np.linalg.svd``'s and its ``‖W‖_F²`` NumPy's, or its largest alone where only that is asked."""
    rng = np.random.default_rng(28)
    for _ in range(10):
        ms, tops = _random_matrices(rng, int(rng.integers(1, 60)))
        keep = [i for i, m in enumerate(ms) if np.isfinite(m).all()]
        ms, tops = [ms[i] for i in keep], [tops[i] for i in keep]
        got = spectral.stacked_singular_values(ms, tops)
        assert len(got) == len(ms)
        for m, top, g in zip(ms, tops, got, strict=True):
            m64 = m.astype(np.float64)
            sv = np.linalg.svd(m64, compute_uv=False)
            scale = max(float(sv[0]) ** 2, 1e-300)
            # eigenvalues of the Gram side in the matrix's precision: sigma^2 to ~1e-6 sigma_max^2 in float32
            tol = 1e-5 if m.dtype == np.float32 else 1e-12
            np.testing.assert_allclose(g.fro2, float(np.sum(m64 ** 2)), rtol=tol)
            want = sv[:1] if top and not g.exact else sv
            np.testing.assert_allclose(g.sv[:want.size] ** 2, want ** 2, rtol=0, atol=tol * scale)
    assert spectral.stacked_singular_values([], []) == []
