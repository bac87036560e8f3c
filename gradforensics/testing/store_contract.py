"""``StoreContract``: the behaviour every store backend must show.

A test module opts a backend in with three lines::

    class TestZarr(StoreContract):
        suffix = ".zarr"

and a store at an fsspec URL with one more (``url = "memory://"``: every store
of the class lies under a fresh prefix there).  Each test builds its store
through the public :class:`~gradforensics.Recorder` and checks it against
NumPy, so a backend that passes is interchangeable with the others for
everything downstream.  Damage (a removed array, a removed or overwritten
chunk) is done through the file system of the store's location
(:func:`remove`, :func:`overwrite`), so the same test runs on a local
directory, an HDF5 file and object storage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradforensics.errors import (
    CorruptChunkError,
    MissingArrayError,
    NotAStoreError,
    SchemaVersionError,
    StoreMismatchError,
)
from gradforensics.recording import Recorder
from gradforensics.store import remote
from gradforensics.store.backends import open_backend
from gradforensics.store.layout import LayoutPolicy
from gradforensics.store.reader import Store
from gradforensics.store.schema import ROOT_ATTR, decode_bf16, encode_bf16

__all__ = ["StoreContract", "overwrite", "remove"]



def _records(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"attn.q": rng.standard_normal((16, 12)).astype(np.float32),
             "mlp.up": rng.standard_normal((24, 16)).astype(np.float32),
             "norm": rng.standard_normal(16).astype(np.float32)} for _ in range(n)]


def _grow(b: Any, name: str, n: int) -> None:
    """Resize an array to *n* rows without writing them (a writer killed mid-flush).

    ``truncate`` sets the record axis to *n*: here it grows the array.
    """
    b.truncate(name, n)


def remove(store: Path | str, name: str) -> None:
    """Delete node *name* (an array, or one chunk key ``grads/w/c/2/0/0``) of the store at *store*."""
    if str(store).endswith((".h5", ".hdf5")):
        import h5py

        with h5py.File(store, "a") as f:
            del f[name]
        return
    fs, root = remote.filesystem(str(store))
    fs.rm(f"{root}/{name}", recursive=True)


def overwrite(store: Path | str, key: str, data: bytes) -> None:
    """Replace the object *key* of the Zarr store at *store* with *data* (a damaged chunk)."""
    fs, root = remote.filesystem(str(store))
    fs.pipe_file(f"{root}/{key}", data)


class StoreContract:
    """Mix into a test class and set ``suffix`` (``".zarr"`` or ``".h5"``), and ``url`` for object storage."""

    suffix: str = ".zarr"
    #: an fsspec URL prefix (``"memory://"``) under which the class's stores lie; None: local files
    url: str | None = None

    def path(self, tmp_path: Path, name: str = "dump") -> Any:
        if self.url is not None:
            return f"{self.url}{tmp_path.parent.name}/{tmp_path.name}/{name}{self.suffix}"
        return tmp_path / f"{name}{self.suffix}"

    def write(self, path: Path, recs: list[dict[str, np.ndarray]], **kw: Any) -> None:
        kw.setdefault("heads", {"attn.q": 4})
        kw.setdefault("layout", LayoutPolicy(small_chunk_bytes=0))
        with Recorder(path, sources=["a", "b"], **kw) as rec:
            for i, g in enumerate(recs):
                rec.record(step=10 + i, loss=float(i), source="ab"[i % 2], n_samples=8, lr=1e-3, grads=g,
                           weights={"mlp.up": g["mlp.up"] * 2} if i % 4 == 0 else None)

    # ------------------------------------------------------------ round trip
    def test_round_trip(self, tmp_path: Path) -> None:
        recs = _records(37)
        p = self.path(tmp_path)
        self.write(p, recs, records_per_chunk=8)
        s = Store(p)
        assert s.n_records == 37 and s.sources == ("a", "b")
        np.testing.assert_array_equal(s.grad("mlp.up").compute(), np.stack([r["mlp.up"] for r in recs]))
        q = np.stack([r["attn.q"].reshape(4, 4, 12) for r in recs])
        np.testing.assert_array_equal(s.grad("attn.q").compute(), q)
        np.testing.assert_array_equal(s.grad("attn.q", head=2).compute(), q[:, 2])
        b = s.batches()
        np.testing.assert_array_equal(b["step"], np.arange(10, 47))
        np.testing.assert_array_equal(b["mixture"][:, 0], np.arange(37) % 2 == 0)
        np.testing.assert_array_equal(s.weight_records(), np.arange(0, 37, 4))
        np.testing.assert_array_equal(s.weight("mlp.up").compute()[1], recs[4]["mlp.up"] * 2)

    def test_slab_chunks_cover_all_records(self, tmp_path: Path) -> None:
        recs = _records(20)
        p = self.path(tmp_path)
        self.write(p, recs, records_per_chunk=4)
        s = Store(p)
        x = s.grad("attn.q", head=1, slab_bytes=1 << 20)
        assert x.chunks[0] == (20,)
        np.testing.assert_array_equal(x.compute(), np.stack([r["attn.q"].reshape(4, 4, 12)[1] for r in recs]))

    def test_dtypes_read_as_float32(self, tmp_path: Path) -> None:
        rng = np.random.default_rng(1)
        g32 = rng.standard_normal((5, 8, 8)).astype(np.float32)
        for dtype in ("float32", "float16", "bfloat16"):
            p = self.path(tmp_path, dtype)
            with Recorder(p, sources=["a"], dtype=dtype) as rec:
                for g in g32:
                    rec.record(source="a", grads={"w": g})
            s = Store(p)
            got = s.grad("w").compute()
            assert got.dtype == np.float32
            want = {"float32": g32, "float16": g32.astype(np.float16).astype(np.float32),
                    "bfloat16": decode_bf16(encode_bf16(g32))}[dtype]
            np.testing.assert_array_equal(got, want)
            assert s.grads["w"].attrs["encoding"] == {"float32": "float32", "float16": "float16",
                                                      "bfloat16": "bfloat16-as-uint16"}[dtype]

    def test_bfloat16_input_is_lossless(self, tmp_path: Path) -> None:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        rng = np.random.default_rng(2)
        g = rng.standard_normal((3, 6, 6)).astype(ml_dtypes.bfloat16)
        p = self.path(tmp_path)
        with Recorder(p, sources=["a"]) as rec:
            for x in g:
                rec.record(source="a", grads={"w": x})
        s = Store(p)
        np.testing.assert_array_equal(s.grad("w").compute(), g.astype(np.float32))
        assert s.grads["w"].attrs["source_dtype"] == "bfloat16"

    def test_mixture_rows(self, tmp_path: Path) -> None:
        p = self.path(tmp_path)
        with Recorder(p, sources=["zh", "en", "code"]) as rec:
            rec.record(mixture={"zh": 1, "en": 3}, grads={"w": np.ones(4, np.float32)})
            rec.record(source="code", grads={"w": np.ones(4, np.float32)})
        np.testing.assert_allclose(Store(p).batches()["mixture"], np.array([[0.25, 0.75, 0], [0, 0, 1]]))

    def test_exception_inside_with_leaves_readable_store(self, tmp_path: Path) -> None:
        p = self.path(tmp_path)
        recs = _records(5)
        with pytest.raises(RuntimeError, match="boom"), Recorder(p, sources=["a", "b"]) as rec:
            for g in recs:
                rec.record(source="a", grads=g)
            raise RuntimeError("boom")
        assert Store(p).n_records == 5

    # ----------------------------------------------------------- bad input
    def test_shape_mismatch_on_append(self, tmp_path: Path) -> None:
        with Recorder(self.path(tmp_path), sources=["a"]) as rec:
            rec.record(source="a", grads={"attn.q": np.zeros((512, 64), np.float32)})
            with pytest.raises(StoreMismatchError, match=r"grads\['attn.q'\] has shape \(512, 512\); the store holds \(512, 64\)"):
                rec.record(source="a", grads={"attn.q": np.zeros((512, 512), np.float32)})

    def test_dtype_mismatch_on_append(self, tmp_path: Path) -> None:
        with Recorder(self.path(tmp_path), sources=["a"]) as rec:
            rec.record(source="a", grads={"w": np.zeros(4, np.float32)})
            with pytest.raises(StoreMismatchError, match="dtype float16; the store holds float32"):
                rec.record(source="a", grads={"w": np.zeros(4, np.float16)})

    def test_not_a_store(self, tmp_path: Path) -> None:
        with pytest.raises(NotAStoreError, match="no such file"):
            Store(self.path(tmp_path, "absent"))
        p = self.path(tmp_path, "empty")
        open_backend(p, "w").close()
        with pytest.raises(NotAStoreError, match="not a gradforensics store"):
            Store(p)

    def test_unknown_schema_version(self, tmp_path: Path) -> None:
        p = self.path(tmp_path)
        self.write(p, _records(2))
        b = open_backend(p, "a")
        attrs = b.root_attrs()[ROOT_ATTR]
        b.set_root_attr(ROOT_ATTR, {**attrs, "schema": 2})
        b.close()
        with pytest.raises(SchemaVersionError, match="has schema 2; this gradforensics reads schema 1"):
            Store(p)

    def test_missing_array(self, tmp_path: Path) -> None:
        p = self.path(tmp_path)
        self.write(p, _records(2))
        remove(p, "batches/loss")
        with pytest.raises(MissingArrayError, match="batches/loss is missing"):
            Store(p)

    def test_missing_chunk_is_named(self, tmp_path: Path) -> None:
        p = self.path(tmp_path)
        self.write(p, _records(16), records_per_chunk=4)
        if self.suffix == ".zarr":
            remove(p, "grads/mlp.up/c/2/0/0")
            with pytest.raises(CorruptChunkError, match=r"grads/mlp.up: chunk 2.0.0 is missing on disk \(records 8-11"):
                Store(p)
        # Rows committed but never written (every backend): grow the arrays and the count.
        b = open_backend(p, "a")
        for name in b.names():
            if name.startswith(("grads/", "batches/")):
                shape, _, _ = b.info(name)
                b.write_rows(name, shape[0], np.zeros((0, *shape[1:]), dtype=b.read(name, slice(0, 1)).dtype))
                _grow(b, name, 20)
        attrs = b.root_attrs()[ROOT_ATTR]
        b.set_root_attr(ROOT_ATTR, {**attrs, "n_records": 20})
        b.close()
        with pytest.raises(CorruptChunkError, match=r"chunk .* is missing on disk \(records 16-19"):
            Store(p)

    def test_corrupt_compressed_chunk_is_named(self, tmp_path: Path) -> None:
        p = self.path(tmp_path)
        self.write(p, _records(16), records_per_chunk=4, compression="zstd" if self.suffix == ".zarr" else "gzip")
        if self.suffix == ".zarr":
            overwrite(p, "grads/mlp.up/c/1/0/0", b"garbage" * 10)
        else:
            import h5py

            with h5py.File(p, "r") as f:
                info = f["grads/mlp.up"].id.get_chunk_info(1)
            with open(p, "r+b") as fh:
                fh.seek(info.byte_offset)
                fh.write(b"\x00garbage" * (info.size // 8))
        s = Store(p)
        with pytest.raises(CorruptChunkError, match=r"grads/mlp.up: chunk 1\.0\.0 \(records 4-7\)"):
            s.grad("mlp.up", slab_bytes=None).compute(scheduler="sync")

    def test_inspect_json(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        from gradforensics.cli import main

        p = self.path(tmp_path)
        self.write(p, _records(6))
        assert main(["inspect", str(p), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["records"] == 6 and out["tensors"]["attn.q"]["heads"] == 4
        assert set(out["sources"]) == {"a", "b"}
        assert main(["inspect", str(self.path(tmp_path, "nope"))]) == 2
        assert "no such file" in capsys.readouterr().err
