"""``gradforensics import`` of Hugging Face Trainer checkpoints written under FSDP, by accelerate's own writer.

Fixtures from the real writer (tests/_fsdp_workers.py): two gloo processes on CPU train a tiny MLP
under FSDP2 (``fully_shard``), FSDP1, and a peft LoRA adapter of it under FSDP2, and save ``checkpoint-{1,2,3}`` with accelerate 1.16's
``save_fsdp_model`` / ``save_fsdp_optimizer`` as ``Trainer._save_optimizer_and_scheduler`` calls
them: ``SHARDED_STATE_DICT`` -> ``pytorch_model_fsdp_0/`` + ``optimizer_0/`` (DCP),
``FULL_STATE_DICT`` -> ``pytorch_model_fsdp.bin`` + ``optimizer.bin`` (state keyed by parameter name) and
the Trainer's ``model.safetensors``,
``use_dcp=False`` -> per-rank ``pytorch_model_fsdp_0_rank{r}.bin``, FSDP1's ``LOCAL_STATE_DICT`` ->
``pytorch_model_fsdp_rank{r}.bin``.  The oracle is what the writing
processes measured themselves: full weights gathered by FSDP, and ‖m‖, ‖√v̂‖ from each rank's
local Adam shards all-reduced.  Before: every one of these series was refused as "not a checkpoint".
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from _fsdp_workers import LORA_TARGETS, STEPS, worker  # noqa: E402
from _hostile import import_refused  # noqa: E402
from test_multirank import run_ranks  # noqa: E402

import gradforensics as gf  # noqa: E402

WEIGHTS = ("0.weight", "2.weight", "4.weight", "6.weight")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("fsdp")
    assert run_ranks(worker, 2, str(root)) == [0, 0]
    return root, torch.load(root / "oracle.pt", weights_only=False)      # the test's own file


def _lora(adapter: str) -> dict[str, str]:
    """The LoRA tensors' names in the store -> the writer's own parameter names."""
    return {f"base_model.model.{t}.lora_{ab}{adapter}.weight": f"base_model.model.{t}.lora_{ab}.default.weight"
            for t in LORA_TARGETS for ab in "AB"}


def _check(store: Any, oracle: dict[str, Any], version: int, names: dict[str, str] | None = None) -> None:
    """The store against the writer's own measurements; *names*: store name -> the writer's name."""
    names = names or {n: n for n in WEIGHTS}
    ref = {s: oracle[f"fsdp{version}-{s}"] for s in STEPS}
    assert store.n_records == len(STEPS) - 1 and store.batches()["step"].tolist() == list(STEPS[1:])
    assert set(store.grads) == set(names)
    for name, own in names.items():
        snaps = store.read(f"weights/{name}")
        got = np.asarray(store.read(f"grads/{name}"))
        for j, s in enumerate(STEPS):
            assert np.array_equal(snaps[j], ref[s]["weights"][own].numpy()), (name, s)
        for i in range(len(STEPS) - 1):
            want = (ref[STEPS[i + 1]]["weights"][own] - ref[STEPS[i]]["weights"][own]).numpy()
            assert np.array_equal(got[i].reshape(want.shape), want), (name, i)
    table = store.meta.extra["import"]["optimizer"]
    assert set(table) == set(names)
    for name, own in names.items():        # the right layer's Adam state: 2.weight and 4.weight share a shape
        for key in ("exp_avg_norm", "sqrt_v_hat_norm", "step"):
            assert table[name][key] == pytest.approx([ref[s]["moments"][own][key] for s in STEPS], rel=1e-9), \
                (name, key)
    assert store.has("optim/summary") and store.arrays["optim/summary"].shape[0] == len(names)   # for `optimizer`
    m3 = [ref[3]["moments"][n]["exp_avg_norm"] for n in names.values()]
    assert len({round(v, 6) for v in m3}) == len(m3)          # distinct per layer: a swap would be seen


@pytest.mark.parametrize(("label", "version"), [("fsdp2-sharded", 2), ("fsdp2-full", 2), ("fsdp1-sharded", 1)])
def test_fsdp_checkpoints_import_the_writers_weights_updates_and_adam_state(written, tmp_path, label, version):
    root, oracle = written
    store = gf.import_run(root / label, tmp_path / "imp.zarr")
    assert store.meta.extra["import"]["kind"] == "hf-fsdp"
    _check(store, oracle, version)
    loss = store.batches()["loss"]
    assert np.isfinite(loss).all()                             # from the checkpoints' trainer_state.json


@pytest.mark.parametrize(("label", "adapter"), [("lora-sharded", ""), ("lora-full", ".default")])
def test_a_lora_model_under_fsdp_imports_its_adapter_and_its_adam_state(written, tmp_path, label, adapter):
    """``adapter_only=True`` (what the Trainer passes): SHARDED saves peft's names (``lora_A.weight``) while the
    optimizer keeps the parameters' (``lora_A.default.weight``): the state is still named, by dropping the
    adapter's name; FULL saves the parameters' names on both sides."""
    root, oracle = written
    _check(gf.import_run(root / label, tmp_path / "imp.zarr"), oracle, 0, _lora(adapter))


def test_optimizer_state_under_other_names_is_left_unnamed_and_said_so(written, tmp_path):
    """A name-keyed state whose names no weight has (here: one foreign segment per name, two different) is
    not attributed by position; the store says why there is no summary."""
    root, _ = written
    src = shutil.copytree(root / "fsdp2-full", tmp_path / "other")
    for ck in src.iterdir():
        opt = torch.load(ck / "optimizer.bin", weights_only=True)
        opt["state"] = {f"x{i}.{k}": v for i, (k, v) in enumerate(opt["state"].items())}
        torch.save(opt, ck / "optimizer.bin")
    store = gf.import_run(src, tmp_path / "imp.zarr")
    assert store.meta.extra["import"].get("optimizer", {}) == {}
    assert "keyed by names that are not the weights'" in store.meta.extra["import"]["optimizer_note"]


def test_the_layout_is_accelerates(written):
    root, oracle = written
    sharded = root / "fsdp2-sharded" / "checkpoint-2"
    assert {p.name for p in sharded.iterdir()} >= {"pytorch_model_fsdp_0", "optimizer_0"}
    assert (sharded / "pytorch_model_fsdp_0" / ".metadata").is_file() and \
        len(list((sharded / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2
    assert {p.name for p in (root / "fsdp2-full" / "checkpoint-2").iterdir()} >= {"pytorch_model_fsdp.bin",
                                                                                   "optimizer.bin"}
    full = torch.load(root / "fsdp2-full" / "checkpoint-2" / "optimizer.bin", weights_only=True)
    assert set(full["state"]) == {n for n in oracle["fsdp2-2"]["names"]}      # keyed by name, not by index
    # FSDP1's own parameter names carry its wrapper; the files it writes do not
    assert all(n.startswith("_fsdp_wrapped_module.") for n in oracle["fsdp1-2"]["names"])


def test_a_full_checkpoint_without_its_fsdp_bin_reads_model_safetensors(written, tmp_path):
    """The Trainer writes ``model.safetensors`` beside ``pytorch_model_fsdp.bin``; either gives the weights,
    and ``optimizer.bin``'s state, keyed by name, is attributed by name (no order guessed)."""
    root, oracle = written
    src = shutil.copytree(root / "fsdp2-full", tmp_path / "st")
    for ck in src.iterdir():
        assert (ck / "model.safetensors").is_file()
        (ck / "pytorch_model_fsdp.bin").unlink()
    _check(gf.import_run(src, tmp_path / "imp.zarr"), oracle, 2)


@pytest.mark.parametrize(("label", "file"), [("fsdp2-per-rank", "optimizer_0_rank0.bin"),
                                             ("fsdp1-local", "pytorch_model_fsdp_rank0.bin")])
def test_per_rank_files_are_refused_in_one_line(written, tmp_path, capsys, label, file):
    """``use_dcp=False`` and FSDP1's LOCAL_STATE_DICT: each rank's own (flat) shard, not joined."""
    import_refused(tmp_path, capsys, written[0] / label, file, "per-rank files are not read")


def test_wrapper_segments_in_names_are_dropped(written, tmp_path):
    """A full state dict saved from a compiled or FSDP1-wrapped module keeps ``_orig_mod.`` /
    ``_fsdp_wrapped_module.``: the import names the tensors (and their Adam state) as the model does."""
    root, oracle = written
    src = shutil.copytree(root / "fsdp2-full", tmp_path / "wrapped")
    for ck in src.iterdir():
        sd = torch.load(ck / "pytorch_model_fsdp.bin", weights_only=True)
        torch.save({f"_orig_mod.{k}": v for k, v in sd.items()}, ck / "pytorch_model_fsdp.bin")
        opt = torch.load(ck / "optimizer.bin", weights_only=True)
        opt["state"] = {f"_fsdp_wrapped_module.{k}": v for k, v in opt["state"].items()}
        for g in opt["param_groups"]:
            g["params"] = [f"_fsdp_wrapped_module.{p}" for p in g["params"]]
        torch.save(opt, ck / "optimizer.bin")
    _check(gf.import_run(src, tmp_path / "imp.zarr"), oracle, 2)


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(("label", "file"), [("fsdp2-full", "optimizer.bin"), ("fsdp2-full", "pytorch_model_fsdp.bin"),
                                             ("fsdp2-sharded", "optimizer_0/.metadata"),
                                             ("fsdp2-sharded", "pytorch_model_fsdp_0/.metadata")])
def test_a_hostile_fsdp_file_is_refused_and_never_runs(written, tmp_path, capsys, label, file):
    src = shutil.copytree(written[0] / label, tmp_path / "src")
    marker = tmp_path / "PWNED"
    target = src / "checkpoint-2" / file
    if target.name == ".metadata":
        target.write_bytes(pickle.dumps(Payload(marker)))
    else:
        torch.save({"state": {}, "x": Payload(marker)}, target)
    import_refused(tmp_path, capsys, src, f"checkpoint-2/{file}")
    assert not marker.exists()


def test_a_missing_dcp_metadata_is_refused(written, tmp_path, capsys):
    src = shutil.copytree(written[0] / "fsdp2-sharded", tmp_path / "src")
    (src / "checkpoint-3" / "optimizer_0" / ".metadata").unlink()
    import_refused(tmp_path, capsys, src, "checkpoint-3/optimizer_0", "no .metadata")


def test_a_full_state_dict_lora_run_imports_under_peft_names_when_its_adapter_config_says_which(written, tmp_path):
    """``FULL_STATE_DICT`` keeps the parameters' names (``lora_A.default.weight``) where SHARDED and a plain PEFT
    checkpoint give peft's (``lora_A.weight``).  The Trainer writes ``adapter_config.json`` beside a FULL one
    (``Trainer.save_model`` -> ``PeftModel.save_pretrained``; the ``default`` adapter's in the directory itself):
    written here by peft's own ``LoraConfig.save_pretrained``.  Before: the same run imported under two sets of
    names; now one, and without the config the store says why the names differ."""
    import peft

    root, oracle = written
    src = shutil.copytree(root / "lora-full", tmp_path / "full")
    bare = gf.import_run(src, tmp_path / "bare.zarr")
    note = bare.meta.extra["import"]["adapter_note"]
    assert "keep the adapter name 'default'" in note and "no adapter_config.json" in note
    for ck in src.iterdir():
        peft.LoraConfig(r=2, target_modules=LORA_TARGETS).save_pretrained(str(ck))
    store = gf.import_run(src, tmp_path / "imp.zarr")
    _check(store, oracle, 0, _lora(""))                         # the names of the SHARDED import, Adam state named
    sharded = gf.import_run(root / "lora-sharded", tmp_path / "sharded.zarr")
    assert sorted(store.grads) == sorted(sharded.grads)
    imp = store.meta.extra["import"]
    assert "adapter_note" not in imp and imp["adapter"]["r"] == 2 and imp["adapter"]["peft_type"] == "LORA"
