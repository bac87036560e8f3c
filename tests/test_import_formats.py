"""The other shapes a source comes in: safetensors series, sharded HF checkpoints, bfloat16, dgrads, a URL store."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import save_file  # noqa: E402
from test_import_megatron import Layout  # noqa: E402

import gradforensics as gf  # noqa: E402
from gradforensics.store.schema import decode_bf16  # noqa: E402


def _weights(step: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"enc.w": torch.randn(6, 4, generator=g).to(dtype), "enc.b": torch.randn(4, generator=g).to(dtype),
            "dec.w": torch.randn(4, 6, generator=g).to(dtype)}


def test_safetensors_series_in_bfloat16_is_kept_bit_for_bit(tmp_path):
    d = tmp_path / "st"
    d.mkdir()
    steps = (0, 50, 100)
    for s in steps:
        save_file(_weights(s, torch.bfloat16), str(d / f"model-{s}.safetensors"))
    store = gf.import_run(d, tmp_path / "imp.zarr")
    assert set(store.grads) == {"enc.w", "dec.w"} and store.batches()["step"].tolist() == [50, 100]
    info = store.weights["enc.w"]
    assert info.encoding == "bfloat16-as-uint16" and info.attrs["source_dtype"] == "bfloat16"
    snaps = store.read("weights/enc.w")
    for j, s in enumerate(steps):
        assert np.array_equal(snaps[j], _weights(s, torch.bfloat16)["enc.w"].view(torch.int16).numpy().view(np.uint16))
    upd = store.read("grads/enc.w")
    want = _weights(100, torch.bfloat16)["enc.w"].float() - _weights(50, torch.bfloat16)["enc.w"].float()
    assert np.array_equal(upd[1], want.numpy())
    assert np.array_equal(decode_bf16(snaps[2]) - decode_bf16(snaps[1]), upd[1])


def test_sharded_hf_checkpoints_and_a_url_store(tmp_path):
    root = tmp_path / "hf"
    for s in (0, 10):
        c = root / f"checkpoint-{s}"
        c.mkdir(parents=True)
        w = _weights(s)
        save_file({"enc.w": w["enc.w"], "enc.b": w["enc.b"]}, str(c / "model-00001-of-00002.safetensors"))
        save_file({"dec.w": w["dec.w"]}, str(c / "model-00002-of-00002.safetensors"))
        (c / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "enc.w": "model-00001-of-00002.safetensors", "enc.b": "model-00001-of-00002.safetensors",
            "dec.w": "model-00002-of-00002.safetensors"}}))
    url = f"memory://{tmp_path.name}/imp.zarr"
    store = gf.import_run(root, url, tensors=["*.w", "enc.b"])
    assert store.location.is_url and set(store.grads) == {"enc.w", "enc.b", "dec.w"}
    assert np.array_equal(store.read("grads/dec.w")[0], (_weights(10)["dec.w"] - _weights(0)["dec.w"]).numpy())


def test_megatron_dgrads_join_the_partitioned_side(tmp_path):
    lay = Layout(tp=2)
    rows = lay.groups * (lay.heads // lay.groups + 2) * lay.head_dim
    g = torch.Generator().manual_seed(3)
    full = {"decoder.layers.0.self_attention.linear_qkv/output0": torch.randn(5, 2, rows, generator=g),
            "decoder.layers.0.self_attention.linear_proj/input0": torch.randn(5, 2, lay.hidden, generator=g),
            "decoder.layers.0.self_attention.linear_proj/output0": torch.randn(5, 2, lay.hidden, generator=g)}
    d = tmp_path / "save" / "dgrads" / "iter_0000003"
    d.mkdir(parents=True)
    for t in range(2):
        part = {k: (v.chunk(2, -1)[t].clone() if k.endswith(("qkv/output0", "proj/input0")) else v.clone())
                for k, v in full.items()}
        torch.save({"model_chunk0": part}, d / f"mp_rank_{t:02d}.pth")
    store = gf.import_run(tmp_path / "save", tmp_path / "imp.zarr", format="megatron", kind="dgrads")
    for k, v in full.items():
        assert np.array_equal(store.read(f"grads/{k.replace('/', '.')}")[0], v.numpy()), k
