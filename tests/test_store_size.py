"""A store takes about the bytes of its data (issue 27): 24 records in chunks of 64 took 2.7x, since
both formats store the last, partly filled chunk whole; a writer that knows how many records come
(``expected_records``: replay, whatif) sizes the chunks so that they fill evenly, and (issue 28) a
capture that closes before its first flush gets chunks of its records whatever it announced; one
that flushed before (``Recorder.flush()``) keeps its chunks of R."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from gradforensics.recording import Recorder
from gradforensics.store.layout import LayoutPolicy, records_per_chunk
from gradforensics.store.reader import Store

SHAPES = {f"l{i}.w": (256, 96) for i in range(4)}
DATA_BYTES = 24 * sum(int(np.prod(s)) for s in SHAPES.values()) * 4        # 9.4 MB of float32 gradients


def _on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _write(path: Path, expected: int | None, flush_at: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(0)
    first = None
    with Recorder(path, sources=["a", "b", "c"], background=False, expected_records=expected) as rec:
        for i in range(24):
            g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
            first = g["l2.w"] if i == 23 else first
            rec.record(step=i, source="abc"[i % 3], loss=1.0, grads=g)
            if i == flush_at:
                rec.flush()
    return first


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".h5", ".zarr"])
def test_bytes_on_disk_are_the_bytes_of_the_data_when_the_count_is_known(tmp_path, suffix):
    padded, even, unknown = tmp_path / f"padded{suffix}", tmp_path / f"even{suffix}", tmp_path / f"unknown{suffix}"
    _write(padded, None, flush_at=9)            # flushed before close: chunks of R = 64 on disk from then on
    last = _write(even, 24)
    assert _write(unknown, None) is not None    # no count given, closed before the first flush
    assert _on_disk(padded) > 2.5 * DATA_BYTES                       # the bug, measured: one 64-record chunk
    assert _on_disk(even) < 1.05 * DATA_BYTES + (256 << 10)          # now: the data and a little metadata
    assert _on_disk(unknown) < 1.05 * DATA_BYTES + (256 << 10)       # chunks fitted at close
    for p in (even, unknown):
        store = Store(p)
        assert store.n_records == 24 and store.meta.records_per_chunk == 24
        np.testing.assert_array_equal(store.grad("l2.w")[23].compute(), last)        # the data, unchanged


@pytest.mark.parametrize(("n", "want"), [(24, 24), (64, 64), (65, 33), (100, 50), (192, 64), (1, 1), (7, 7)])
def test_records_per_chunk_spreads_a_known_count_evenly(n, want):
    r = records_per_chunk(1024, LayoutPolicy(), expected=n)
    assert r == want and r <= 64
    chunks = -(-n // r)
    assert chunks == -(-n // 64) and chunks * r - n < chunks             # as few chunks, under a row each of padding


def test_replay_passes_its_count(tmp_path):
    torch = pytest.importorskip("torch")
    from torch import nn

    from gradforensics.replay import replay

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    data = {s: [torch.randn(4, 64) for _ in range(8)] for s in ("a", "b", "c")}
    store = replay(model, data, lambda m, b: m(b).pow(2).mean(), tmp_path / "r.h5", n_per_source=8,
                   progress=False)
    assert store.n_records == 24 and store.meta.records_per_chunk == 24
    data_bytes = 24 * sum(p.numel() * 4 for p in model.parameters() if p.ndim == 2)
    assert _on_disk(tmp_path / "r.h5") < 1.1 * data_bytes + (256 << 10)
