"""``gf.analyze(url, storage_options=...)`` and ``gradforensics capture --out s3://...``, on a real S3 server.

The server is moto's server mode on loopback (``tests/_s3.py``).  That the options
reach the file system is shown by taking the server's address out of the
environment: only ``storage_options`` then say where the store is.  The capture test reuses the tiny LLaMA fixtures of
``tests/test_capture_cli.py`` and compares the bytes at the URL with a local capture.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

import gradforensics as gf
from gradforensics.errors import SpecError
from gradforensics.store import url_reads
from gradforensics.store.reader import Store, open_store
from gradforensics.testing.planted import nonfinite_store
from tests._s3 import BUCKET, moto_server

ONLY = "nonfinite"


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    """Each test opens its own zarr stores for the pass's reads (one call's proxy endpoint must not reach the next)."""
    url_reads.clear_read_stores()
    yield
    url_reads.clear_read_stores()


@pytest.fixture(scope="module")
def s3() -> object:
    with moto_server() as endpoint:
        yield endpoint


def _key(findings: gf.analysis.engine.Findings) -> list[tuple]:
    return [(f.kind, f.tensor, f.head, round(f.severity, 9)) for f in findings.flags]


@pytest.mark.slow
def test_analyze_url_with_storage_options(s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    from gradforensics.analysis.engine.results import read_findings

    url = f"s3://{BUCKET}/opts/dump.zarr"
    local = nonfinite_store(tmp_path / "dump.zarr", n_records=6, records=(2, 4)).path
    s3fs.S3FileSystem().put(str(local), url.removeprefix("s3://"), recursive=True)   # the same bytes at the URL
    want = gf.analyze(local, only=ONLY, progress=False)
    # from here on only the options know where the server is: the environment no longer does
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    s3fs.S3FileSystem.clear_instance_cache()
    opts = {"endpoint_url": s3, "skip_instance_cache": True}
    got = gf.analyze(url, only=ONLY, progress=False, storage_options=opts)
    assert _key(got) == _key(want) and any(f.kind == "nonfinite" for f in got.flags)
    url_reads.clear_read_stores()
    saved = read_findings(Store(url, storage_options=opts))         # results written back to the URL
    assert [k[:3] for k in _key(saved)] == [k[:3] for k in _key(got)] and saved.header["regime"]["name"] == "exact"
    assert [f.severity for f in saved.flags] == pytest.approx([f.severity for f in got.flags], abs=1e-4)


def test_storage_options_need_a_url(s3: str, tmp_path: Path) -> None:
    local = nonfinite_store(tmp_path / "l.zarr", n_records=6, records=(2, 3)).path
    with pytest.raises(SpecError, match=r"storage_options are for a store at a URL.*local path"):
        gf.analyze(local, storage_options={"anon": True}, progress=False)
    with pytest.raises(SpecError, match="an open Store"):
        gf.analyze(Store(local), storage_options={"anon": True}, progress=False)


# ---------------------------------------------------------------- capture to s3://
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

# the tiny LLaMA and its data files of the capture CLI tests (module-scoped fixtures, reused here)
from tests.test_capture_cli import base_args, capture, files, llama_dir  # noqa: E402,F401


@pytest.mark.slow
def test_capture_cli_writes_to_s3(s3: str, tmp_path: Path, request: pytest.FixtureRequest,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    llama, data_files = request.getfixturevalue("llama_dir"), request.getfixturevalue("files")
    url = f"s3://{BUCKET}/capture/dump.zarr"
    tensors = ("--tensors", "*.layers.1.self_attn.q_proj.weight", "*.layers.0.mlp.down_proj.weight")
    rc, err = capture(*base_args(llama, data_files, url, *tensors), capsys=capsys)
    assert rc == 0, err
    rc, err = capture(*base_args(llama, data_files, tmp_path / "dump.zarr", *tensors), capsys=capsys)
    assert rc == 0, err
    remote_store, local_store = open_store(url), open_store(tmp_path / "dump.zarr")
    assert remote_store.n_records == local_store.n_records == 6 and remote_store.sources == ("en", "zh")
    assert sorted(remote_store.grads) == sorted(local_store.grads)
    for t in remote_store.grads:                                     # the same seeded batches, the same bytes
        np.testing.assert_array_equal(remote_store.grad(t).compute(), local_store.grad(t).compute())
    np.testing.assert_array_equal(remote_store.batches()["loss"], local_store.batches()["loss"])
    # a second capture to the same URL is refused (no overwrite), in one line
    rc, err = capture(*base_args(llama, data_files, url, *tensors), capsys=capsys)
    assert rc == 2 and err.count("\n") == 1 and "exists" in err
    assert open_store(url).n_records == 6                            # and the store is untouched
