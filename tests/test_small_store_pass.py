"""Issue 28, the 2,000-small-tensor store: the pass, the open and the save of many small tensors.

* one-slab tensors read and reduced many a task (``engine/plan_small.py``): every Gram matrix
  is ``X Xᵀ`` of the stored gradients (NumPy's product in float64 as the oracle; heads, a
  non-finite record), in far fewer tasks than one task a step; a damaged chunk among them is
  still named alone;
* the inventory's one-``scandir`` walk lists what ``os.walk`` lists, refuses links, and still
  refuses dimension names zarr refuses;
* series images written in one piece are zip archives ``zipfile`` and ``numpy.load`` read back
  to the arrays written; the reads gathered in batches read what zarr reads.
"""

from __future__ import annotations

import io
import json
import os
import time
import zipfile
from pathlib import Path

import dask
import numpy as np
import pytest

from gradforensics.analysis.engine import plan
from gradforensics.analysis.engine.options import EngineOptions, select_analyses
from gradforensics.analysis.engine.run import analyze, compute_pass
from gradforensics.analysis.engine.seriesimage import pack_series, stored_zip
from gradforensics.errors import CorruptChunkError, CorruptStoreError
from gradforensics.store import inventory
from gradforensics.store.inventory import zarr_inventory
from gradforensics.store.reader import Store
from gradforensics.testing.planted import write_store

SHAPES = {**{f"layers.{i}.tiny.weight": (8,) for i in range(12)},
          "layers.0.attn.q.weight": (8, 4), "layers.1.attn.q.weight": (8, 4), "layers.0.mlp.weight": (6, 5),
          "layers.0.mlp.big.weight": (64, 48)}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """15 small tensors (two split in 4 heads) and one of 3,072 floats, 24 records; source b's mean opposes a's; one NaN."""
    p = tmp_path_factory.mktemp("small") / "s.zarr"
    base = {k: np.random.default_rng(1).standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}

    def grads(i, src, rng):
        sign = 1.0 if i % 2 else -1.0
        g = {k: (sign * base[k] + 2 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
        if i == 5:
            g["layers.3.tiny.weight"][2] = np.nan
        return g

    write_store(p, grads, 24, ("a", "b"), source_of=lambda i: "ab"[i % 2], heads={"*.q.weight": 4})
    return p


def _unfused(monkeypatch) -> None:
    monkeypatch.setattr(plan, "one_slab", lambda *a, **k: None)


def _oracle(store: Store, tensor: str) -> dict[int | None, tuple[np.ndarray, np.ndarray]]:
    """``{head: (K, non-finite counts)}`` of *tensor* by NumPy: ``X Xᵀ`` in float64 of the stored float32
    gradients (non-finite elements zeroed), the rows and columns of records holding any zeroed."""
    info = store.grads[tensor]
    x = np.asarray(store.read(info.name), dtype=np.float64)
    n = x.shape[0]
    units = {None: x.reshape(n, -1)}
    if info.heads is not None:
        units |= {h: x[:, h].reshape(n, -1) for h in range(x.shape[1])}
    out = {}
    for h, u in units.items():
        bad = (~np.isfinite(u)).sum(axis=1)
        u = np.where(np.isfinite(u), u, 0.0)
        k = u @ u.T
        k[bad > 0, :] = 0.0
        k[:, bad > 0] = 0.0
        out[h] = (k, bad)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("slab_bytes", [None, 1 << 16])     # 64 KiB: the big tensor takes several slabs
def test_fused_small_tensors_give_the_gram_matrices_numpy_gives(small, slab_bytes) -> None:
    store = Store(small)
    engine = EngineOptions.parse({"persist": False, **({"slab_bytes": slab_bytes} if slab_bytes else {})}, "engine")
    grams, _ = compute_pass(store, select_analyses("drift"), engine, None, False)
    assert sorted({t for t, _ in grams}) == sorted(SHAPES)
    for tensor in SHAPES:
        for head, (k, bad) in _oracle(store, tensor).items():
            g = grams[(tensor, head)]
            # float32 products (eps 6e-8) over at most 4,096 features a block, summed in float64
            np.testing.assert_allclose(g.gram, k, rtol=1e-6, atol=1e-6 * max(k.diagonal().max(), 1.0),
                                       err_msg=f"{tensor} head {head}")
            np.testing.assert_array_equal(g.nonfinite, bad)
    assert grams[("layers.3.tiny.weight", None)].nonfinite[5] == 1


def test_fused_small_tensors_take_far_fewer_tasks(small, monkeypatch) -> None:
    tasks: list[int] = []

    def counting_get(dsk, keys, **kwargs):
        tasks.append(len(dsk.__dask_graph__() if hasattr(dsk, "__dask_graph__") else dsk))
        return dask.threaded.get(dsk, keys, **kwargs)

    opts = {"engine": {"persist": False}}
    with dask.config.set(scheduler=counting_get):
        fused = analyze(small, progress=False, options=opts)
        with monkeypatch.context() as m:
            _unfused(m)
            plain = analyze(small, progress=False, options=opts)
    # 15 one-slab tensors: 5 tasks each (read, aggregate, 3 outputs) become one fused task
    assert tasks[0] + 50 < tasks[1], f"fused pass has {tasks[0]} tasks, the one-tensor graph {tasks[1]}"
    assert [(f.kind, f.tensor, f.head) for f in fused.flags] == [(f.kind, f.tensor, f.head) for f in plain.flags]


def test_a_damaged_chunk_among_fused_tensors_is_named_alone(small, tmp_path) -> None:
    import shutil

    p = tmp_path / "s.zarr"
    shutil.copytree(small, p)
    chunk = next((p / "grads" / "layers.7.tiny.weight" / "c").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError, match=r"grads/layers\.7\.tiny\.weight: chunk 0\.0 \(records 0-"):
        analyze(p, progress=False, options={"engine": {"persist": False}})


# ------------------------------------------------------------------ the inventory
def _count_parses(monkeypatch) -> list[dict]:
    """The metadata zarr is asked to parse from now on (``zarr.AsyncArray`` built on a dict)."""
    import zarr

    parses: list[dict] = []
    real = zarr.AsyncArray

    def counting(metadata, *args, **kwargs):
        if isinstance(metadata, dict):
            parses.append(metadata)
        return real(metadata, *args, **kwargs)

    monkeypatch.setattr(zarr, "AsyncArray", counting)
    return parses


def _walked(inv) -> dict:
    return {n: (a.shape, a.chunks, a.dtype, a.attrs, a.nbytes_stored, a.chunk_files, a.chunk_file_bytes)
            for n, a in sorted(inv.arrays.items())}


def _os_walk_listing(root: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every array's chunk files (index -> size) and stored bytes, from ``os.walk`` (what the listing did)."""
    out = {}
    for top, _, files in os.walk(root):
        if "zarr.json" in files and json.loads((Path(top) / "zarr.json").read_text())["node_type"] == "array":
            rel = Path(top).relative_to(root).as_posix()
            chunks = {}
            for ctop, _, cfiles in os.walk(Path(top) / "c"):
                for f in cfiles:
                    parts = (*Path(ctop, f).relative_to(Path(top) / "c").parts,)
                    chunks[tuple(int(x) for x in parts)] = (Path(ctop) / f).stat().st_size
            out[rel] = (chunks, sum(chunks.values()))
    return out


def test_inventory_lists_every_array_and_chunk_os_walk_finds(small) -> None:
    inv = zarr_inventory(str(small))
    walked = _os_walk_listing(small)
    analysis = {n for n in walked if n.startswith("analysis/")}
    assert set(walked) - analysis == {n for n in inv.arrays if not n.startswith("analysis/")}
    for name, a in inv.arrays.items():
        if not name.startswith("analysis/"):
            assert (a.chunk_files, a.nbytes_stored) == walked[name], name
    assert inv.root_attrs["gradforensics"]["n_records"] == 24


@pytest.mark.parametrize("where", ["grads/layers.2.tiny.weight/c/0", "grads/layers.2.tiny.weight", "batches"])
def test_a_link_anywhere_is_refused_as_before(small, tmp_path, where) -> None:
    import shutil

    p = tmp_path / "s.zarr"
    shutil.copytree(small, p)
    (p / where / "evil").symlink_to(tmp_path)
    with pytest.raises(CorruptStoreError, match=rf"{where}/evil is a symbolic link"):
        zarr_inventory(str(p))
    with pytest.raises(CorruptStoreError, match=rf"{where}/evil is a symbolic link"):
        inventory.refuse_links(str(p))


@pytest.mark.parametrize("names", [["record"], ["record", 3], 7, ["record", "a", "b"]])
def test_bad_dimension_names_are_refused_though_the_rest_was_parsed_for_another_array(small, tmp_path,
                                                                                      names) -> None:
    import shutil

    p = tmp_path / "s.zarr"
    shutil.copytree(small, p)
    meta_file = p / "grads" / "layers.9.tiny.weight" / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["dimension_names"] = names
    meta_file.write_text(json.dumps(meta))
    zarr_inventory(str(small))           # the other arrays' metadata (same rest, other names) parsed first
    with pytest.raises(CorruptStoreError, match=r"layers\.9\.tiny\.weight/zarr\.json: .*dimension"):
        zarr_inventory(str(p))


# ------------------------------------------------------------------ series images
def test_series_image_is_a_zip_numpy_reads_back(monkeypatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)
    rng = np.random.default_rng(0)
    series = {f"t{i}|{'ab'[i % 2]}": rng.standard_normal(i % 9).astype([np.float64, np.float32][i % 2])
              for i in range(500)}
    series["fortran"] = np.asfortranarray(rng.standard_normal((3, 4)))
    series["ints"] = np.arange(6, dtype=np.int64).reshape(2, 3)
    image = pack_series(series).tobytes()
    with zipfile.ZipFile(io.BytesIO(image)) as zf:
        assert zf.testzip() is None and len(zf.infolist()) == len(series) + 1
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
        when = time.localtime(1_800_000_000.0)[:6]
        assert zf.infolist()[0].date_time == (*when[:5], when[5] // 2 * 2)        # DOS time: two-second steps
    with np.load(io.BytesIO(image), allow_pickle=False) as z:        # the oracle: numpy's own reader
        keys = [str(k) for k in z["__keys__"]]
        assert keys == list(series)
        for i, k in enumerate(keys):
            got = z[f"s{i}"]
            assert got.dtype == series[k].dtype and got.shape == series[k].shape, k
            np.testing.assert_array_equal(got, series[k])              # stored, not computed: exact


def test_stored_zip_leaves_what_needs_zip64_or_utf8_names_to_zipfile() -> None:
    dt = (2026, 12, 2, 1, 2, 4)        # DOS time: two-second steps
    assert stored_zip([("é.npy", b"x")], dt) is None
    assert stored_zip([(f"s{i}.npy", b"") for i in range(0x10000)], dt) is None
    image = stored_zip([("a.npy", b"12"), ("b.npy", b"")], dt)
    assert image is not None
    with zipfile.ZipFile(io.BytesIO(image)) as zf:
        assert zf.testzip() is None and [(i.filename, i.date_time) for i in zf.infolist()] == [("a.npy", dt), ("b.npy", dt)]
        assert zf.read("a.npy") == b"12" and zf.read("b.npy") == b""


@pytest.mark.parametrize("many_bytes", [1, 1 << 40])      # one read a gather, all reads in one gather
def test_reads_gathered_in_batches_read_what_zarr_reads(small, monkeypatch, many_bytes) -> None:
    import zarr

    from gradforensics.store import handles

    monkeypatch.setattr(handles, "MANY_BYTES", many_bytes)
    store = Store(small)
    reads = [(str(small), i.name, (slice(0, 24), *(slice(None),) * (len(i.shape) - 1)))
             for i in store.grads.values()]
    got = handles.read_zarr_many(reads)
    for (_, name, sel), x in zip(reads, got, strict=True):
        want = np.asarray(zarr.open_array(str(small / name), mode="r")[sel])
        assert x.dtype == want.dtype and x.tobytes() == want.tobytes(), name
