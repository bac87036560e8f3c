"""Issue 28: chunks sized by bytes for head-split tensors, stores written one head a chunk still read the same.

The oracle of "stored meaning unchanged" is the store itself: the same gradients
rewritten with the old chunking (one head a chunk) through the backend's own
``create`` / ``write_rows`` give the same arrays, the same Gram matrices and the same
analysis tables and flags; and the new layout's chunks hold whole heads up to
``chunk_bytes``.
"""

from __future__ import annotations

import numpy as np
import pytest

import gradforensics as gf
from gradforensics.analysis.engine.gram import gram_graph
from gradforensics.store.backends import open_backend
from gradforensics.store.layout import LayoutPolicy, MiB, chunk_shape
from gradforensics.store.reader import Store
from gradforensics.testing.planted import write_store

P = LayoutPolicy()


def test_head_split_chunks_hold_whole_heads_up_to_chunk_bytes() -> None:
    # 8 heads of 4 x 32 float32 = 512 B each; 64 records: every head in one chunk of 256 KiB
    assert chunk_shape((8, 4, 32), 4, 64, P, head_split=True) == (64, 8, 4, 32)
    # 32 heads of 128 x 128: 64 KiB a head, 64 records = 4 MiB a head: two heads a chunk (8 MiB)
    assert chunk_shape((32, 128, 128), 4, 64, P, head_split=True) == (64, 2, 128, 128)
    # 12 heads that fit 5 a chunk: balanced to 4, 4, 4 (no chunk of 2 heads and padding)
    per_head = (P.chunk_bytes // 5) // (64 * 4)
    assert chunk_shape((12, per_head), 4, 64, P, head_split=True) == (64, 4, per_head)
    # a head larger than chunk_bytes: slabs of its rows, one head a chunk, as before
    c = chunk_shape((32, 128, 4096), 4, 64, P, head_split=True)
    assert c[:2] == (64, 1) and 64 * c[2] * 4096 * 4 <= 8 * MiB
    # arrays not split by heads keep their chunks
    assert chunk_shape((4096, 4096), 4, 64, P) == (64, 8, 4096)
    assert chunk_shape((16,), 4, 64, P) == (4096, 16)


def _rewrite_one_head_a_chunk(path) -> None:
    """Rewrite every head-split ``grads/`` array with the pre-issue-28 chunks ``(R, 1, ...)``."""
    b = open_backend(str(path), "a")
    try:
        for name in [n for n in b.names() if n.startswith("grads/")]:
            attrs = b.attrs(name)
            if not attrs.get("heads"):
                continue
            data = b.read(name)
            _, _, chunks = b.info(name)
            b.delete(name)
            b.create(name, (0, *data.shape[1:]), data.dtype.str, (chunks[0], 1, *data.shape[2:]), attrs, "none", True)
            b.truncate(name, data.shape[0])
            b.write_rows(name, 0, data)
        b.flush()
    finally:
        b.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    rng = np.random.default_rng(5)
    base = {"l.0.attn.q": rng.standard_normal((8, 16)), "l.0.mlp": rng.standard_normal((16, 16))}

    def grads(i, src, r):
        sign = 1.0 if src == "a" else -1.0
        return {k: (sign * v + r.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}

    paths = []
    for name in ("new.zarr", "old.zarr"):
        p = root / name
        write_store(p, grads, 24, ("a", "b"), seed=1, heads={"l.0.attn.q": 4})
        paths.append(p)
    _rewrite_one_head_a_chunk(paths[1])
    return paths


def test_new_layout_holds_heads_together_and_old_one_head_a_chunk(pair) -> None:
    new, old = (Store(p).grads["l.0.attn.q"] for p in pair)
    assert new.heads == old.heads == 4
    assert new.chunks[1] == 4 and old.chunks[1] == 1
    np.testing.assert_array_equal(Store(pair[0]).read("grads/l.0.attn.q"), Store(pair[1]).read("grads/l.0.attn.q"))


def test_old_layout_is_read_in_slabs_of_many_heads(pair) -> None:
    import dask

    for p in pair:
        s = Store(p)
        chunks = s.grad("l.0.attn.q", slab_bytes=64 << 20).chunks
        assert chunks[1] == (4,), chunks            # one task reads every head, whatever the disk chunks
    (a,), (b,) = (dask.compute(gram_graph(Store(p), "l.0.attn.q")) for p in pair)
    assert len(a) == len(b) == 5                     # the whole tensor, then each head
    for ga, gb in zip(a, b, strict=True):
        assert (ga.tensor, ga.head) == (gb.tensor, gb.head)
        np.testing.assert_array_equal(ga.gram, gb.gram)


@pytest.mark.slow
def test_old_and_new_layouts_give_the_same_findings(pair) -> None:
    fa, fb = (gf.analyze(p, progress=False, only=["conflict", "drift", "oscillation", "noise"]) for p in pair)
    for name in fa.results:
        ta, tb = fa.results[name].table, fb.results[name].table
        assert ta.drop(columns=[c for c in ta.columns if c == "store"]).equals(tb.drop(
            columns=[c for c in tb.columns if c == "store"])), name
    key = lambda f: (f.kind, f.tensor, f.head, tuple(f.sources), f.severity)  # noqa: E731
    assert sorted(map(key, fa.flags)) == sorted(map(key, fb.flags))
    assert any(f.kind == "conflict" for f in fa.flags)   # the planted opposition is found in both
