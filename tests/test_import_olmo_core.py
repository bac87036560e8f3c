"""OLMo-core: its ``step<N>/`` checkpoints and its gradient dumps, imported or refused.

Layouts read from OLMo-core's own source, allenai/OLMo-core at commit
fa6c5014c9f6e9ee789da2d9c20d5126fee8df0d (2026-06-22):

* ``src/olmo_core/distributed/checkpoint/filesystem.py``: ``RemoteFileSystemWriter`` writes each
  chunk with ``torch.save`` into ``__<rank>_<n>.distcp`` and pickles ``.metadata`` (torch's
  ``Metadata``) with its own dataclass ``olmo_core.distributed.checkpoint.filesystem._StorageInfo
  (relative_path, offset, length)`` per chunk - the class that made the importer refuse the
  checkpoint as hostile before (it allowed only torch's ``_StorageInfo``);
* ``src/olmo_core/train/checkpoint.py``: ``Checkpointer`` saves ``<save folder>/step<N>/`` with
  ``train/rank<r>.pt`` (``torch.save`` of the trainer state), ``model_and_optim/`` (the DCP of
  ``train_module.state_dict_to_save()``) and ``.metadata.json``; ``src/olmo_core/train/train_module/
  transformer/train_module.py`` ``_get_state_dict`` is ``{"model": get_model_state_dict(...),
  "optim": get_optimizer_state_dict(...)}`` with ``flatten_optimizer_state_dict=True``; the save
  folder holds OLMo-core's ``config.json`` (``callbacks/config_saver.py``), not a Hugging Face one;
* ``src/olmo_core/train/callbacks/gap_monitor.py`` ``_dump_gradients``: ``gradients/step<N>/
  full_gradients/`` (``save_state_dict`` of ``{name: p.grad}``) or, with
  ``dump_gradients_save_first_n=N``, ``gradients/step<N>/sampled_gradients/<name>.safetensors``
  holding ``{"gradient": g[:N, :N, ...]}``.

ai2-olmo-core is not installed (its dependencies are heavy): the DCP parts are written by torch's own
``dcp.save`` (the same ``torch.save`` chunk bytes at the same offsets and file names) and the
``.metadata`` is re-pickled with OLMo-core's class at its dotted name - a throwaway module object in
``sys.modules`` during the pickling only; the import side never has it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import gradforensics as gf  # noqa: E402
from gradforensics.cli import main  # noqa: E402
from gradforensics.importing import detect_format  # noqa: E402

OLMO_MODULE = "olmo_core.distributed.checkpoint.filesystem"
STEPS = (10, 20, 30)


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickle_as_olmo_core(md, extra=None) -> bytes:
    """*md* pickled as OLMo-core's writer does: each storage entry an ``olmo_core...filesystem._StorageInfo``."""
    @dataclasses.dataclass
    class _StorageInfo:
        relative_path: str
        offset: int
        length: int

    _StorageInfo.__module__, _StorageInfo.__qualname__ = OLMO_MODULE, "_StorageInfo"
    parts = OLMO_MODULE.split(".")
    names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    assert not any(n in sys.modules for n in names)
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules[OLMO_MODULE]._StorageInfo = _StorageInfo  # type: ignore[attr-defined]
    try:
        md.storage_data = {k: _StorageInfo(v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()}
        if extra is not None:
            md.storage_meta = extra           # pickled after storage_data: OLMo-core's class is met first
        return pickle.dumps(md)
    finally:
        for n in names:
            del sys.modules[n]


@dataclasses.dataclass
class _Info:
    relative_path: str
    offset: int
    length: int


class _Reload(pickle.Unpickler):
    def find_class(self, module, name):
        return _Info if (module, name) == (OLMO_MODULE, "_StorageInfo") else super().find_class(module, name)


def _save(state: dict, d: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(d))
    md = pickle.loads((d / ".metadata").read_bytes())     # our own file, just written
    (d / ".metadata").write_bytes(_pickle_as_olmo_core(md))


def _model():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.fixture(scope="module")
def olmo_run(tmp_path_factory):
    """A save folder with ``step<N>/`` checkpoints and full gradient dumps; the saved tensors by step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    root = tmp_path_factory.mktemp("olmo") / "run"
    root.mkdir()
    (root / "config.json").write_text('{"run_name": "tiny", "model": {"d_model": 8}, "trainer": {}}')
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights, moments, grads = {}, {}, {}
    for step in range(STEPS[-1] + 1):
        model(torch.randn(16, 6)).pow(2).mean().backward()
        if step in STEPS:                 # GAPMonitorCallback.pre_optim_step: before the optimizer step
            g = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            _save(dict(g), root / "gradients" / f"step{step}" / "full_gradients")
            grads[step] = g
        opt.step()
        opt.zero_grad()
        if step in STEPS:                 # Checkpointer.save after the step
            d = root / f"step{step}"
            optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
            _save({"model": get_model_state_dict(model), "optim": optim}, d / "model_and_optim")
            (d / "train").mkdir()
            torch.save({"global_step": step, "rng": torch.get_rng_state()}, d / "train" / "rank0.pt")
            (d / ".metadata.json").write_text('{"ephemeral": false}')
            weights[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            moments[step] = {k[len("state."):-len(".exp_avg")]: v.double().norm().item()
                             for k, v in optim.items() if k.startswith("state.") and k.endswith(".exp_avg")}
    return root, weights, moments, grads


def _checkpoints_only(root: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(root, dst, ignore=shutil.ignore_patterns("gradients"))
    return dst


def test_step_checkpoints_import_weights_and_the_optimizer_by_name(olmo_run, tmp_path):
    root, weights, moments, _ = olmo_run
    src = _checkpoints_only(root, tmp_path / "ckpts")
    assert detect_format(src) == "checkpoints"
    store = gf.import_run(src, tmp_path / "imp.zarr", tensors=["*"])
    assert set(store.grads) == set(weights[10]), sorted(store.grads)      # no optim.state.* among them
    assert store.batches()["step"].tolist() == [20, 30]
    assert store.meta.extra["import"]["kind"] == "olmo-core"
    upd = store.read("grads/2.weight")
    assert torch.equal(torch.from_numpy(upd[1]), weights[30]["2.weight"] - weights[20]["2.weight"])
    assert np.array_equal(store.read("weights/0.weight")[0], weights[10]["0.weight"].numpy())
    table = store.meta.extra["import"]["optimizer"]
    for name in ("0.weight", "2.weight", "2.bias"):
        assert table[name]["exp_avg_norm"] == pytest.approx([moments[s][name] for s in STEPS], rel=1e-9)


def test_full_gradient_dumps_are_one_record_per_step(olmo_run, tmp_path):
    root, _, _, grads = olmo_run
    assert detect_format(root) == "olmo-core" and detect_format(root / "gradients") == "olmo-core"
    out = tmp_path / "g.zarr"
    assert main(["import", str(root), "--out", str(out), "--quiet", "--tensors", "*"]) == 0
    store = gf.open_store(out)
    assert store.batches()["step"].tolist() == list(STEPS)
    assert store.meta.extra["import"]["format"] == "olmo-core"
    for name in ("0.weight", "2.weight", "2.bias"):
        got = store.read(f"grads/{name}")
        for i, s in enumerate(STEPS):
            assert torch.equal(torch.from_numpy(np.asarray(got[i])), grads[s][name]), (name, s)
    assert "partial" not in store.grads["0.weight"].attrs


def test_sampled_gradients_are_stored_as_the_partial_tensors_they_are(olmo_run, tmp_path):
    from safetensors.torch import save_file

    _, _, _, grads = olmo_run
    n = 4
    for s in STEPS:                      # _dump_gradients with dump_gradients_save_first_n=4
        d = tmp_path / "run" / "gradients" / f"step{s}" / "sampled_gradients"
        d.mkdir(parents=True)
        for name, g in grads[s].items():
            save_file({"gradient": g[tuple(slice(0, min(n, k)) for k in g.shape)].contiguous()},
                      str(d / f"{name}.safetensors"))
    store = gf.import_run(tmp_path / "run", tmp_path / "s.zarr", tensors=["*"])
    assert store.meta.extra["import"]["kind"] == "sampled_gradients"
    info = store.grads["0.weight"]                        # the full gradient is 8 x 6
    assert info.attrs["partial"] is True and info.attrs["partial_region"] == [[0, 4], [0, 4]]
    assert store.grads["2.weight"].attrs["partial_region"] == [[0, 3], [0, 4]]      # 3 x 8: all 3 rows
    got = store.read("grads/0.weight")
    for i, s in enumerate(STEPS):
        assert torch.equal(torch.from_numpy(np.asarray(got[i])), grads[s]["0.weight"][:4, :4])


def test_a_hostile_global_beside_olmo_cores_class_is_refused(olmo_run, tmp_path, capsys):
    root, *_ = olmo_run
    src = _checkpoints_only(root, tmp_path / "src")
    marker = tmp_path / "PWNED"
    f = src / "step20" / "model_and_optim" / ".metadata"
    md = _Reload(f.open("rb")).load()                    # our own fixture, re-read to add the payload
    f.write_bytes(_pickle_as_olmo_core(md, extra=Payload(marker)))
    out = tmp_path / "out.zarr"
    assert main(["import", str(src), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "posix.system" in err[0] and "refused" in err[0], err
    assert not marker.exists()


def test_model_and_optim_directories_saved_alone_import(olmo_run, tmp_path):
    """``save_model_and_optim_state`` output (``Checkpointer.dir_is_checkpoint``: a ``.metadata`` at the top,
    "just model (and maybe optim state)"): before, refused as hostile for OLMo-core's ``_StorageInfo``."""
    import shutil

    root, weights, *_ = olmo_run
    src = tmp_path / "bare"
    src.mkdir()
    for s in STEPS:
        shutil.copytree(root / f"step{s}" / "model_and_optim", src / f"step{s}")
    store = gf.import_run(src, tmp_path / "bare.zarr", tensors=["*"])
    assert store.meta.extra["import"]["kind"] == "dcp"
    upd = store.read("grads/0.weight")
    assert torch.equal(torch.from_numpy(upd[0]), weights[20]["0.weight"] - weights[10]["0.weight"])


def _sharded_dump(d: Path, grads: dict[str, torch.Tensor]) -> None:
    """``full_gradients/`` as two FSDP ranks write it: each gradient's rows split, rank r's chunks in
    ``__<r>_0.distcp`` (``RemoteFileSystemWriter``'s names), the ``.metadata`` naming OLMo-core's class."""
    import io

    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    d.mkdir(parents=True)
    blobs: dict[str, list[bytes]] = {"__0_0.distcp": [], "__1_0.distcp": []}
    tensors, storage = {}, {}
    for name, g in grads.items():
        rows = g.shape[0]
        chunks = []
        for rank, (lo, hi) in enumerate(((0, (rows + 1) // 2), ((rows + 1) // 2, rows))):
            buf = io.BytesIO()
            torch.save(g[lo:hi].clone(), buf)
            file = f"__{rank}_0.distcp"
            offsets = torch.Size([lo] + [0] * (g.ndim - 1))
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([hi - lo, *g.shape[1:]])))
            storage[MetadataIndex(name, offsets)] = types.SimpleNamespace(
                relative_path=file, offset=sum(map(len, blobs[file])), length=len(buf.getvalue()))
            blobs[file].append(buf.getvalue())
        tensors[name] = TensorStorageMetadata(TensorProperties(dtype=g.dtype), g.shape, chunks)
    for file, parts in blobs.items():
        (d / file).write_bytes(b"".join(parts))
    md = Metadata(tensors, planner_data={n: (n,) for n in grads}, storage_data=storage)
    (d / ".metadata").write_bytes(_pickle_as_olmo_core(md))


def test_sharded_full_gradients_are_joined_from_their_ranks(olmo_run, tmp_path):
    _, _, _, grads = olmo_run
    for s in STEPS[:2]:
        _sharded_dump(tmp_path / "run" / "gradients" / f"step{s}" / "full_gradients",
                      {n: g.to(torch.bfloat16) for n, g in grads[s].items()})
    store = gf.import_run(tmp_path / "run", tmp_path / "sh.zarr", tensors=["*"])
    assert store.grads["0.weight"].encoding == "bfloat16-as-uint16"
    for name in ("0.weight", "2.weight", "2.bias"):
        got = store.read(f"grads/{name}")
        for i, s in enumerate(STEPS[:2]):
            want = grads[s][name].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            assert np.array_equal(np.asarray(got[i]), want), (name, s)


@pytest.mark.parametrize("case", ["mixed", "empty", "missing"])
def test_dumps_that_cannot_be_one_store_are_refused_in_one_line(olmo_run, tmp_path, capsys, case):
    import shutil

    root, *_ = olmo_run
    src = tmp_path / "run"
    shutil.copytree(root / "gradients", src / "gradients")
    step20 = src / "gradients" / "step20"
    shutil.rmtree(step20 / "full_gradients")
    if case == "mixed":
        (step20 / "sampled_gradients").mkdir()
        expect = ("full gradients", "sampled ones")
    elif case == "empty":
        expect = ("step20", "neither full_gradients/")
    else:
        keep = {"0.weight": torch.zeros(8, 6)}
        _sharded_dump(step20 / "full_gradients", keep)
        expect = ("step20/full_gradients", "0.bias is missing")
    assert main(["import", str(src), "--out", str(tmp_path / "x.zarr"), "--quiet", "--tensors", "*"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(e in err[0] for e in expect), err
