"""Issue 28, the 2,000-small-tensor store: each shortcut of the pass, the open and the save against what it replaces.

* one-slab tensors read and reduced many a task (``engine/plan_small.py``) give every Gram
  matrix, table, series and flag of the one-task-a-step graph, bit for bit, in far fewer tasks;
  a damaged chunk among them is still named alone;
* the inventory's one-``scandir`` walk lists what the ``os.walk`` one listed, refuses links as it
  did, and its metadata parse - shared across arrays whose dimension names differ - still refuses
  dimension names zarr refuses;
* series images written in one piece are byte for byte what ``zipfile`` writes, and images
  written the old way (``zipfile.writestr`` a member) read back as before.
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
from _exact import same_findings

from gradforensics.analysis.engine import EngineOptions, analyze, run, select_analyses
from gradforensics.analysis.engine import results as engine_results
from gradforensics.analysis.engine.results import pack_series, parse_series, read_findings, stored_zip
from gradforensics.analysis.engine.run import compute_pass
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
    monkeypatch.setattr(run, "one_slab", lambda *a, **k: None)


@pytest.mark.parametrize("slab_bytes", [None, 1 << 16])     # 64 KiB: the big tensor takes several slabs
def test_fused_small_tensors_give_every_number_of_the_one_tensor_graph(small, monkeypatch, slab_bytes) -> None:
    opts = {"engine": {"persist": False, **({"slab_bytes": slab_bytes} if slab_bytes else {})}}
    tasks: list[int] = []

    def counting_get(dsk, keys, **kwargs):
        tasks.append(len(dsk.__dask_graph__() if hasattr(dsk, "__dask_graph__") else dsk))
        return dask.threaded.get(dsk, keys, **kwargs)

    with dask.config.set(scheduler=counting_get):
        fused = analyze(small, progress=False, options=opts)
        with monkeypatch.context() as m:
            _unfused(m)
            plain = analyze(small, progress=False, options=opts)
    same_findings(fused, plain)
    # 15 one-slab tensors: 5 tasks each (read, aggregate, 3 outputs) become one fused task
    assert tasks[0] + 50 < tasks[1], f"fused pass has {tasks[0]} tasks, the one-tensor graph {tasks[1]}"

    store = Store(small)
    engine = EngineOptions.parse(opts["engine"], "engine")
    g_fused, lazy_fused = compute_pass(store, select_analyses(None), engine, None, False)
    with monkeypatch.context() as m:
        _unfused(m)
        g_plain, lazy_plain = compute_pass(store, select_analyses(None), engine, None, False)
    assert list(g_fused) == list(g_plain)           # the same order too (analyses iterate it)
    for key, g in g_plain.items():
        f = g_fused[key]
        assert f.gram.tobytes() == g.gram.tobytes() and f.nonfinite.tobytes() == g.nonfinite.tobytes(), key
        assert (f.n_features, f.from_sketch) == (g.n_features, g.from_sketch), key
    assert {a: list(v) for a, v in lazy_fused.items()} == {a: list(v) for a, v in lazy_plain.items()}
    assert g_plain[("layers.3.tiny.weight", None)].nonfinite[5] == 1


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


def test_inventory_of_a_store_equals_the_one_with_neutral_dimension_names(small, monkeypatch) -> None:
    """Dimension names are out of the parse's cache key: the listing is the same with or without them."""
    parses = _count_parses(monkeypatch)
    inventory.clear_parsed()
    inv = zarr_inventory(str(small))
    a = _walked(inv)
    assert len(parses) <= len(inv.arrays) - 11                # the 12 tensors of 8 floats: one parse
    assert a == _walked(zarr_inventory(str(small)))


# ------------------------------------------------------------------ series images
def _old_pack(series) -> np.ndarray:
    """``pack_series`` as 7cd1852 wrote it: ``zipfile.writestr`` one member at a time."""
    buf = io.BytesIO()
    arrays = {f"s{i}": np.asarray(v) for i, v in enumerate(series.values())}
    arrays["__keys__"] = np.asarray(list(series.keys()), dtype=str)
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, arr in arrays.items():
            out = io.BytesIO()
            np.lib.format.write_array(out, arr, allow_pickle=False)
            zf.writestr(f"{key}.npy", out.getvalue())
    return np.frombuffer(buf.getvalue(), dtype=np.uint8)


def test_series_image_is_byte_for_byte_what_zipfile_writes(monkeypatch) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)      # one timestamp for both writers
    rng = np.random.default_rng(0)
    series = {f"t{i}|{'ab'[i % 2]}": rng.standard_normal(i % 9).astype([np.float64, np.float32][i % 2])
              for i in range(500)}
    series["fortran"] = np.asfortranarray(rng.standard_normal((3, 4)))
    series["ints"] = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert pack_series(series).tobytes() == _old_pack(series).tobytes()


def test_stored_zip_leaves_what_needs_zip64_or_utf8_names_to_zipfile() -> None:
    dt = (2026, 12, 2, 1, 2, 3)
    assert stored_zip([("é.npy", b"x")], dt) is None
    assert stored_zip([(f"s{i}.npy", b"") for i in range(0x10000)], dt) is None
    members = [("a.npy", b"12"), ("b.npy", b"")]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members:
            zf.writestr(zipfile.ZipInfo(name, dt), data)
    assert stored_zip(members, dt) == buf.getvalue()


def test_results_saved_the_old_way_read_back_as_before(small, tmp_path, monkeypatch) -> None:
    import shutil

    p = tmp_path / "s.zarr"
    shutil.copytree(small, p)
    with monkeypatch.context() as m:
        m.setattr(engine_results, "pack_series", _old_pack)      # the store as the code before wrote it
        old = analyze(p, progress=False)
    back_old = read_findings(Store(p))
    new = analyze(p, progress=False)
    back_new = read_findings(Store(p))
    same_findings(old, new)
    same_findings(back_old, back_new)
    for res in back_old.results.values():
        assert list(res.series) == list(parse_series(pack_series(res.series)))


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
