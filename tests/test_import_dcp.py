"""``gradforensics import`` of torch distributed checkpoints (DCP), read without unpickling anything hostile.

The series is written here with ``torch.distributed.checkpoint.save`` (one process, no
process group) from a small MLP trained a few steps with Adam, each ``step_N/`` holding
``{"model": ..., "optimizer": ...}``; the oracle is the model's own ``state_dict()`` at
each save: the store's weight snapshots equal it exactly (a lossless copy), its records the differences.
A sharded save is planted by hand (a tensor written as two row chunks) to check assembly.
Hostile: a ``.metadata`` pickle payload, a truncated ``.distcp``, an offset past the end,
a storage path escaping the directory.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from _hostile import import_refused  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics.cli import main  # noqa: E402
from gradforensics.errors import CheckpointError  # noqa: E402
from gradforensics.importing.dcp import read_dcp  # noqa: E402

STEPS = (0, 3, 6)


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_series(root: Path) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, dict]]:
    """Train a tiny MLP, DCP-save ``root/step_N`` at STEPS; the saved model and optimizer state dicts by step."""
    import copy

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    saved, opts = {}, {}
    for step in range(STEPS[-1] + 1):
        if step in STEPS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                         checkpoint_id=str(root / f"step_{step}"))
            saved[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            opts[step] = copy.deepcopy(opt.state_dict())
        x = torch.randn(16, 6)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return saved, opts


@pytest.fixture(scope="module")
def series(tmp_path_factory) -> tuple[Path, dict, dict]:
    root = tmp_path_factory.mktemp("dcp")
    return (root / "run", *write_series(root / "run"))


def test_weights_are_the_saved_state_dicts_and_updates_the_differences(series, tmp_path):
    root, saved, _ = series
    store = gf.import_run(root, tmp_path / "imp.zarr")
    assert store.n_records == len(STEPS) - 1 and store.batches()["step"].tolist() == list(STEPS[1:])
    assert set(store.grads) == {"0.weight", "2.weight"}
    for name in ("0.weight", "2.weight"):
        snaps = store.read(f"weights/{name}")
        for j, s in enumerate(STEPS):
            assert np.array_equal(snaps[j].view(np.uint32), saved[s][name].numpy().view(np.uint32)), (name, s)  # copies
        got = np.asarray(store.read(f"grads/{name}"))
        for i in range(len(STEPS) - 1):
            want = (saved[STEPS[i + 1]][name] - saved[STEPS[i]][name]).numpy()
            assert np.array_equal(got[i].reshape(want.shape), want), (name, i)


def test_read_dcp_gives_every_model_tensor_exactly(series):
    root, saved, opts = series
    got, opt = read_dcp(root / "step_3")
    assert set(got) == set(saved[3])
    for n, t in saved[3].items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    want = opts[3]
    assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in want["param_groups"]]
    assert opt["param_groups"][0]["betas"] == want["param_groups"][0]["betas"]
    assert opt["param_groups"][0]["eps"] == want["param_groups"][0]["eps"]
    assert set(opt["state"]) == set(want["state"]) == {0, 1, 2, 3}
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(opt["state"][i][k], v), (i, k)


def test_optimizer_summaries_from_the_dcp_optimizer_entry(series, tmp_path):
    root, _, opts = series
    store = gf.import_run(root, tmp_path / "imp.zarr")
    table = store.meta.extra["import"]["optimizer"]
    for pid, name in ((0, "0.weight"), (2, "2.weight")):
        for j, s in enumerate(STEPS):
            st = opts[s]["state"].get(pid)
            if st is None:                     # step 0: no state yet
                assert table[name]["exp_avg_norm"][j] is None
                continue
            v_hat = st["exp_avg_sq"].double() / (1 - 0.999 ** float(st["step"]))
            assert table[name]["exp_avg_norm"][j] == pytest.approx(float(st["exp_avg"].double().norm()), rel=1e-9)
            assert table[name]["sqrt_v_hat_norm"][j] == pytest.approx(float(v_hat.sqrt().norm()), rel=1e-9)
            assert table[name]["step"][j] == s


def test_a_flat_state_dict_keeps_names_that_begin_with_model(tmp_path):
    sd = {"model.embed.weight": torch.randn(4, 3), "lm_head.weight": torch.randn(2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(tmp_path / "flat"))
    got = read_dcp(tmp_path / "flat")[0]
    assert set(got) == set(sd) and all(torch.equal(got[n], sd[n]) for n in sd)


def _chunked(d: Path, full: torch.Tensor) -> None:
    """Write ``d`` as DCP would for ``{"model": {"w": full}}`` saved in two row shards."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    d.mkdir(parents=True)
    blobs, chunks, storage, pos = [], [], {}, 0
    for lo, hi in ((0, 3), (3, 5)):
        buf = io.BytesIO()
        torch.save(full[lo:hi].clone(), buf)
        b = buf.getvalue()
        chunks.append(ChunkStorageMetadata(offsets=torch.Size([lo, 0]), sizes=torch.Size([hi - lo, full.shape[1]])))
        storage[MetadataIndex("model.w", [lo, 0])] = _StorageInfo("__0_0.distcp", pos, len(b))
        blobs.append(b)
        pos += len(b)
    (d / "__0_0.distcp").write_bytes(b"".join(blobs))
    tmd = TensorStorageMetadata(TensorProperties(dtype=full.dtype), full.shape, chunks)
    (d / ".metadata").write_bytes(pickle.dumps(Metadata({"model.w": tmd}, storage_data=storage)))


def test_chunks_are_assembled_into_the_full_tensor(tmp_path):
    full = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    _chunked(tmp_path / "s", full)
    assert torch.equal(read_dcp(tmp_path / "s")[0]["w"], full)


def _copy(root: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(root, dst)
    return dst


def test_a_metadata_payload_is_refused_and_never_runs(series, tmp_path, capsys):
    src = _copy(series[0], tmp_path / "src")
    marker = tmp_path / "PWNED"
    (src / "step_3" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    import_refused(tmp_path, capsys, src, "step_3/.metadata", "posix.system", "refused")
    assert not marker.exists()


def test_a_truncated_distcp_is_refused(series, tmp_path, capsys):
    src = _copy(series[0], tmp_path / "src")
    f = src / "step_6" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])
    import_refused(tmp_path, capsys, src, "step_6/__0_0.distcp", "past the end")


def test_an_offset_past_the_end_and_a_path_outside_are_refused(series, tmp_path, capsys):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    for rel, off, expect in (("__0_0.distcp", 10**9, "past the end"), ("../../outside.distcp", 0, "outside")):
        src = _copy(series[0], tmp_path / f"src{off}")
        md_file = src / "step_3" / ".metadata"
        md = pickle.loads(md_file.read_bytes())            # the test's own file: trusted here
        key = next(k for k in md.storage_data if k.fqn == "model.0.weight")
        info = md.storage_data[key]
        md.storage_data[key] = _StorageInfo(rel, off, info.length)
        md_file.write_bytes(pickle.dumps(md))
        import_refused(tmp_path, capsys, src, "model.0.weight", expect)


def test_a_missing_distcp_and_a_wrong_chunk_shape_are_refused(tmp_path, series):
    full = torch.ones(5, 4)
    _chunked(tmp_path / "a", full)
    (tmp_path / "a" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        read_dcp(tmp_path / "a")
    _chunked(tmp_path / "b", full)
    md = pickle.loads((tmp_path / "b" / ".metadata").read_bytes())
    md.state_dict_metadata["model.w"].chunks[0].sizes = torch.Size([2, 4])   # says 2 rows, holds 3
    md.state_dict_metadata["model.w"].chunks[1].offsets = torch.Size([2, 0])
    md.storage_data = {type(k)(k.fqn, [2, 0] if k.offset[0] == 3 else k.offset): v for k, v in md.storage_data.items()}
    (tmp_path / "b" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"holds torch.float32 \(3, 4\); the metadata says torch.float32 \(2, 4\)"):
        read_dcp(tmp_path / "b")


def test_bytes_that_are_not_a_tensor_are_refused(series, tmp_path, capsys):
    src = _copy(series[0], tmp_path / "src")
    md = pickle.loads((src / "step_3" / ".metadata").read_bytes())      # the test's own file: trusted here
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.2.weight")
    f = src / "step_3" / info.relative_path
    data = bytearray(f.read_bytes())
    data[info.offset:info.offset + info.length] = b"\0" * info.length
    f.write_bytes(bytes(data))
    import_refused(tmp_path, capsys, src, "step_3/__0_0.distcp", "model.2.weight", "are not a torch tensor")


def test_a_dcp_refusal_is_said_once_not_wrapped_again(series, tmp_path, capsys):
    """Issue 42: the chunk's own line, not "<.metadata>: a tensor entry is malformed (CheckpointError: <it>)"."""
    src = _copy(series[0], tmp_path / "src")
    f = src / "step_6" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])
    out = tmp_path / "out.zarr"
    assert main(["import", str(src), "--out", str(out), "--quiet"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"gradforensics import: error: {f}: "), line
    assert "CheckpointError" not in line and "malformed" not in line and line.count(str(f)) == 1, line
