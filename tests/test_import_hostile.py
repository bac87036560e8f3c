"""Sources you did not write, handed to ``gradforensics import``: each one line on stderr, exit 2.

A pickle payload (it would create a marker file if anything in it ran), a truncated
file, an iteration with one rank's file missing, a shard of the wrong shape, a shard
index pointing out of its directory, a series whose tensor changes shape, a torch
distributed checkpoint whose metadata is a payload: the command refuses each in one line
naming the file, runs nothing from it, and writes nothing outside ``--out``.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_import_megatron import LAYOUTS, reference, write_dump  # noqa: E402

from gradforensics.cli import main  # noqa: E402


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _refused(tmp_path: Path, capsys, argv: list[str], *expect: str) -> str:
    """Run the CLI on a hostile source; one line, exit 2, and nothing written anywhere but --out."""
    out = tmp_path / "out.zarr"
    before = _tree(tmp_path)
    assert main(["import", *argv, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for e in expect:
        assert e in lines[0], lines[0]
    assert {p for p in _tree(tmp_path) - before if not p.startswith("out.zarr")} == set()
    return lines[0]


@pytest.fixture
def dump(tmp_path) -> Path:
    lay = LAYOUTS["tp2_pp2"]
    return write_dump(tmp_path / "save", lay, {it: reference(lay, it) for it in (1, 2)})


def _megatron(dump: Path) -> list[str]:
    return [str(dump), "--format", "megatron", "--gated-mlp"]


def test_pickle_payload_in_a_pth_runs_nothing(tmp_path, capsys, dump):
    marker = tmp_path / "PWNED"
    target = dump / "wgrads" / "iter_0000001" / "mp_rank_01_000.pth"
    torch.save({"model_chunk0": {"decoder.layers.0.mlp.linear_fc2.weight": Payload(marker)}}, target)
    _refused(tmp_path, capsys, _megatron(dump), "mp_rank_01_000.pth", "refused to unpickle", "nothing in the file")
    assert not marker.exists()
    assert not (tmp_path / "out.zarr").exists()


def test_truncated_pth(tmp_path, capsys, dump):
    target = dump / "wgrads" / "iter_0000002" / "mp_rank_00_001.pth"
    raw = target.read_bytes()
    target.write_bytes(raw[: len(raw) // 2])
    _refused(tmp_path, capsys, _megatron(dump), "mp_rank_00_001.pth", "truncated")


def test_one_rank_missing(tmp_path, capsys, dump):
    (dump / "wgrads" / "iter_0000001" / "mp_rank_01_001.pth").unlink()
    _refused(tmp_path, capsys, _megatron(dump), "mp_rank_01_001.pth is missing", "TP 2 x PP 2 x EP 1")


def test_shard_of_the_wrong_shape(tmp_path, capsys, dump):
    target = dump / "wgrads" / "iter_0000001" / "mp_rank_01_000.pth"
    chunks = torch.load(target, weights_only=True)
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    chunks["model_chunk0"][name] = torch.zeros(16, 5)
    torch.save(chunks, target)
    _refused(tmp_path, capsys, _megatron(dump), "mp_rank_01_000.pth", name, "(16, 5)", "(16, 4)")


def test_rank_files_that_do_not_belong_together(tmp_path, capsys, dump):
    target = dump / "wgrads" / "iter_0000001" / "mp_rank_01_000.pth"
    chunks = torch.load(target, weights_only=True)
    del chunks["model_chunk0"]["decoder.layers.1.self_attention.linear_proj.weight"]
    torch.save(chunks, target)
    _refused(tmp_path, capsys, _megatron(dump), "decoder.layers.1.self_attention.linear_proj.weight",
             "tensor-parallel rank 1")


def test_not_a_megatron_dump(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    _refused(tmp_path, capsys, [str(tmp_path / "empty"), "--format", "megatron"], "no iter_<7 digits>/")


# ------------------------------------------------------------------ checkpoint series
def _series(tmp_path: Path, n: int = 3) -> Path:
    d = tmp_path / "series"
    d.mkdir()
    torch.manual_seed(0)
    for s in range(n):
        torch.save({"model": {"w": torch.randn(4, 3), "b": torch.randn(3)}}, d / f"step_{s * 10}.pt")
    return d


def test_pickle_payload_in_a_series_runs_nothing(tmp_path, capsys):
    d = _series(tmp_path)
    marker = tmp_path / "PWNED"
    (d / "step_10.pt").write_bytes(pickle.dumps(Payload(marker), protocol=2))
    _refused(tmp_path, capsys, [str(d)], "step_10.pt", "refused to unpickle")
    assert not marker.exists()


def test_truncated_checkpoint_in_a_series(tmp_path, capsys):
    d = _series(tmp_path)
    raw = (d / "step_20.pt").read_bytes()
    (d / "step_20.pt").write_bytes(raw[:100])
    _refused(tmp_path, capsys, [str(d)], "step_20.pt")


def test_tensor_changing_shape_in_a_series(tmp_path, capsys):
    d = _series(tmp_path)
    torch.save({"model": {"w": torch.randn(5, 3), "b": torch.randn(3)}}, d / "step_20.pt")
    _refused(tmp_path, capsys, [str(d)], "step_20.pt", "tensor w has shape (5, 3)", "(4, 3)")


def test_shard_index_pointing_outside_is_refused(tmp_path, capsys):
    import json

    root = tmp_path / "hf"
    for s in (0, 10):
        c = root / f"checkpoint-{s}"
        c.mkdir(parents=True)
        (c / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../secret.bin"}}))
    _refused(tmp_path, capsys, [str(root)], "model.safetensors.index.json", "'../../secret.bin'", "refused")


def test_a_distributed_checkpoint_payload_is_refused_without_running(tmp_path, capsys):
    root = tmp_path / "dcp"
    marker = tmp_path / "PWNED"
    for s in (0, 10):
        (root / f"step_{s}").mkdir(parents=True)
        (root / f"step_{s}" / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=2))
    _refused(tmp_path, capsys, [str(root)], "step_0/.metadata", "global posix.system", "refused without running it")
    assert not marker.exists()


def test_an_import_the_disk_cannot_hold_is_refused_before_writing(tmp_path, capsys, monkeypatch):
    import shutil

    d = _series(tmp_path)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=100))
    out = tmp_path / "big.zarr"
    assert main(["import", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "estimate: 2 records x 120 B (grads 48 B, weights 72 B)" in err
    assert "needs ~240 B but only 100 B is free" in err and "--force" in err and not out.exists()
    assert main(["import", str(d), "--out", str(out), "--force", "--quiet"]) == 0 and out.exists()


def test_the_last_rank_missing_from_one_iteration(tmp_path, capsys):
    lay = LAYOUTS["tp2_pp2"]
    save = write_dump(tmp_path / "save", lay, {it: reference(lay, it) for it in (1, 2)})
    for name in ("mp_rank_01_000.pth", "mp_rank_01_001.pth"):     # the whole of TP rank 1, in iteration 2 only
        (save / "wgrads" / "iter_0000002" / name).unlink()
    _refused(tmp_path, capsys, _megatron(save), "iter_0000002: mp_rank_01_000.pth is missing (iter_0000001 has it)")
