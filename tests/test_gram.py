"""The Gram pass against plain NumPy: whole tensors, heads, record-split slabs, the
tree-combine path (split_every=2), non-finite records, sketches, both backends."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest

from gradforensics.analysis.engine.gram import gram_graph, gram_of_array, gram_of_handle
from gradforensics.analysis.engine.gramkernel import aggregate_partial, chunk_partial, combine_partials
from gradforensics.analysis.engine.results import load_grams, save_grams
from gradforensics.errors import MissingArrayError, SpecError
from gradforensics.recording.sketch import Sketcher
from gradforensics.store.heads import HeadSpec
from gradforensics.store.reader import Store
from gradforensics.testing.planted import write_store


def oracle(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K with non-finite elements zeroed and bad records' rows/cols zeroed; per-record counts."""
    flat = x.reshape(x.shape[0], -1).astype(np.float64)
    bad = ~np.isfinite(flat)
    counts = bad.sum(axis=1)
    clean = np.where(bad, 0.0, flat)
    k = clean @ clean.T
    k[counts > 0, :] = 0
    k[:, counts > 0] = 0
    return k, counts


def data(n: int = 12, shape: tuple[int, ...] = (6, 20), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *shape)).astype(np.float32)


@pytest.mark.parametrize("split_every", [2, 3, 8])
@pytest.mark.parametrize("chunks", [(12, 2, 5), (12, 6, 20), (4, 3, 7), (5, 6, 20)])
def test_whole_tensor_matches_numpy(chunks: tuple[int, ...], split_every: int) -> None:
    x = data()
    (res,) = dask.compute(gram_of_array(da.from_array(x, chunks=chunks), "t", split_every=split_every))
    k, counts = oracle(x)
    assert len(res) == 1 and res[0].head is None and res[0].n_features == 120
    np.testing.assert_allclose(res[0].gram, k, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(res[0].nonfinite, counts)
    np.testing.assert_array_equal(res[0].gram, res[0].gram.T)


def test_float64_precision_is_exact_to_rounding() -> None:
    x = data(shape=(50, 300))
    (res,) = dask.compute(gram_of_array(da.from_array(x, chunks=(12, 7, 300)), "t", split_every=2,
                                        precision="float64"))
    np.testing.assert_allclose(res[0].gram, oracle(x)[0], rtol=1e-12)


@pytest.mark.parametrize("chunks", [(12, 1, 3, 20), (12, 2, 6, 20), (5, 1, 6, 7)])
def test_heads_and_whole_from_head_blocks(chunks: tuple[int, ...]) -> None:
    x = data(shape=(4, 6, 20), seed=1)   # (N, H, ...) head-split
    x[3, 2, 1, 4] = np.nan
    x[7, 0, 0, 0] = np.inf
    (res,) = dask.compute(gram_of_array(da.from_array(x, chunks=chunks), "t", heads=True, split_every=2))
    assert [r.head for r in res] == [None, 0, 1, 2, 3]
    k, counts = oracle(x)
    np.testing.assert_allclose(res[0].gram, k, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(res[0].nonfinite, counts)
    assert res[0].n_features == 4 * 120 and res[1].n_features == 120
    for h in range(4):
        kh, ch = oracle(x[:, h])
        np.testing.assert_allclose(res[h + 1].gram, kh, rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(res[h + 1].nonfinite, ch)
    # record 3 is bad in head 2 only: excluded from head 2 and from the whole tensor, not from head 0
    assert not res[3].finite[3] and res[1].finite[3] and not res[0].finite[3]


def test_nonfinite_records_zeroed_and_counted() -> None:
    x = data(n=9, shape=(40,))
    x[2, [1, 5, 9]] = [np.nan, np.inf, -np.inf]
    x[6, :] = np.nan
    (res,) = dask.compute(gram_of_array(da.from_array(x, chunks=(3, 16)), "t", split_every=2))
    g = res[0]
    assert g.nonfinite.tolist() == [0, 0, 3, 0, 0, 0, 40, 0, 0]
    assert np.isfinite(g.gram).all()
    assert not g.gram[[2, 6]].any() and not g.gram[:, [2, 6]].any()
    np.testing.assert_allclose(g.gram, oracle(x)[0], rtol=1e-5, atol=1e-4)


def test_float32_overflow_falls_back_to_float64() -> None:
    x = np.ones((3, 10), np.float32)
    x[1, 0] = 1e25                      # finite, but its square overflows float32
    (res,) = dask.compute(gram_of_array(da.from_array(x, chunks=(3, 5)), "t"))
    assert res[0].nonfinite.tolist() == [0, 0, 0]
    np.testing.assert_allclose(res[0].gram[1, 1], 1e50 + 9, rtol=1e-6)


def test_kernel_steps_compose() -> None:
    """chunk -> combine -> aggregate by hand equals the oracle (the reduction's algebra)."""
    x = data(n=6, shape=(30,))
    a, b = x[:3], x[3:]
    parts = []
    for lo, hi in ((0, 10), (10, 30)):
        parts += [chunk_partial(a[:, lo:hi], None, 0, 0, 0, False), chunk_partial(b[:, lo:hi], None, 1, 1, 0, False),
                  chunk_partial(a[:, lo:hi], b[:, lo:hi], 0, 1, 0, False)]
    before = {k: v.copy() for k, v in parts[0].items()}
    total = combine_partials([combine_partials(parts[:2]), combine_partials(parts[2:])])
    assert all(np.array_equal(before[k], parts[0][k]) for k in before), "combine must not modify its inputs"
    (g,) = aggregate_partial(total, "t", (3, 3), None, 30, False)
    np.testing.assert_allclose(g.gram, oracle(x)[0], rtol=1e-5)


def test_bad_arguments() -> None:
    x = da.zeros((4, 5), chunks=(4, 5))
    with pytest.raises(SpecError, match="split_every"):
        gram_of_array(x, "t", split_every=1)
    with pytest.raises(SpecError, match="precision"):
        gram_of_array(x, "t", precision="float16")


# ----------------------------------------------------------------- stores
def _store(path, n=20, seed=0, **kw):
    rng = np.random.default_rng(seed)
    tensors = {"attn.q": (16, 8), "mlp.up": (24, 10)}
    recs = {i: {t: rng.standard_normal(s).astype(np.float32) for t, s in tensors.items()} for i in range(n)}
    recs[4]["mlp.up"][3, 3] = np.nan

    def grads(i, src, rng):
        return recs[i]

    write_store(path, grads, n, ("a", "b"), heads={"attn.q": 4}, records_per_chunk=4, **kw)
    return recs


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_store_grams_match_numpy_both_backends(tmp_path, suffix) -> None:
    path = tmp_path / f"s{suffix}"
    recs = _store(path)
    store = Store(path)
    (res,) = dask.compute(gram_graph(store, "attn.q", slab_bytes=1 << 16, split_every=2))
    q = np.stack([recs[i]["attn.q"] for i in range(20)])
    np.testing.assert_allclose(res[0].gram, oracle(q)[0], rtol=1e-5, atol=1e-4)
    blocks = np.stack([HeadSpec(4).split(q[i]) for i in range(20)])
    for h in range(4):
        np.testing.assert_allclose(res[h + 1].gram, oracle(blocks[:, h])[0], rtol=1e-5, atol=1e-4)
    (up,) = dask.compute(gram_graph(store, "mlp.up", split_every=2))
    k, counts = oracle(np.stack([recs[i]["mlp.up"] for i in range(20)]))
    np.testing.assert_allclose(up[0].gram, k, rtol=1e-5, atol=1e-4)
    assert up[0].nonfinite.tolist() == counts.tolist() and counts[4] == 1


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_handle_reads_fused_and_record_split(tmp_path, suffix) -> None:
    """Reading through the handle inside tasks: fused slabs, and paired record blocks when split."""
    path = tmp_path / f"s{suffix}"
    recs = _store(path)
    store = Store(path)
    info = store.grads["attn.q"]
    q = np.stack([recs[i]["attn.q"] for i in range(20)])
    for chunks in (((20,), (1,) * 4, (2, 2), (8,)), ((6, 6, 8), (2, 2), (4,), (8,))):
        (res,) = dask.compute(gram_of_handle(store.handle(info), chunks, "attn.q", heads=True, split_every=2))
        np.testing.assert_allclose(res[0].gram, oracle(q)[0], rtol=1e-5, atol=1e-4)
        blocks = np.stack([HeadSpec(4).split(q[i]) for i in range(20)])
        np.testing.assert_allclose(res[3].gram, oracle(blocks[:, 2])[0], rtol=1e-5, atol=1e-4)


def test_graph_stays_small(tmp_path) -> None:
    path = tmp_path / "s.zarr"
    _store(path, n=8)
    store = Store(path)
    g = gram_graph(store, "attn.q", slab_bytes=64 << 20)
    info = store.grads["attn.q"]
    n_blocks = int(np.prod([len(c) for c in store.grad("attn.q", slab_bytes=64 << 20).chunks]))
    # reads + chunk tasks + combine tree + aggregate: a few tasks per slab
    assert len(g.__dask_graph__()) <= 3 * n_blocks + 2
    assert info.heads > 1 and n_blocks == 1   # all heads in one slab here: everything fits (issue 28: by bytes)


def test_sketch_only_tensor(tmp_path) -> None:
    path = tmp_path / "s.zarr"
    rng = np.random.default_rng(3)
    base = rng.standard_normal((32, 64)).astype(np.float32)
    recs = [(base + 0.7 * rng.standard_normal(base.shape)).astype(np.float32) for _ in range(10)]
    write_store(path, lambda i, s, r: {"w": recs[i]}, 10, ("a",), sketch={"k": 512, "seed": 1},
                heads={"w": 4})
    store = Store(path)
    assert "w" not in store.grads and "w" in store.sketches
    (res,) = dask.compute(gram_graph(store, "w", split_every=2))
    assert all(r.from_sketch for r in res)
    sk = store.read("sketch/w")                                   # (N, H, k)
    np.testing.assert_allclose(res[0].gram, oracle(sk)[0], rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(res[2].gram, oracle(sk[:, 1])[0], rtol=1e-5, atol=1e-3)
    # and the sketch K estimates the true K: cosines within a few JL standard errors
    sketcher = Sketcher(k=512, seed=1)
    assert np.allclose(sk[0, 0], sketcher.project(HeadSpec(4).split(recs[0])[0]), atol=1e-5)
    true = oracle(np.stack(recs))[0]
    cos = lambda k: k / np.sqrt(np.outer(np.diag(k), np.diag(k)))  # noqa: E731
    assert np.abs(cos(res[0].gram) - cos(true)).max() < 4 * np.sqrt(2 / (4 * 512))


def test_missing_tensor_names_what_is_there(tmp_path) -> None:
    path = tmp_path / "s.zarr"
    _store(path, n=6)
    with pytest.raises(MissingArrayError, match="no grads/nope"):
        gram_graph(Store(path), "nope")


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_save_and_load_roundtrip(tmp_path, suffix) -> None:
    path = tmp_path / f"s{suffix}"
    _store(path, n=6)
    store = Store(path)
    res = {}
    for t in store.tensors:
        (r,) = dask.compute(gram_graph(store, t))
        res.update({(g.tensor, g.head): g for g in r})
    save_grams(store, res)
    back = load_grams(Store(path, check_chunks=False))
    assert set(back) == set(res)
    for key, g in res.items():
        np.testing.assert_array_equal(back[key].gram, g.gram)
        np.testing.assert_array_equal(back[key].nonfinite, g.nonfinite)
        assert back[key].n_features == g.n_features and back[key].from_sketch == g.from_sketch
