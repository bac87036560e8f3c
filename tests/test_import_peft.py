"""A LoRA run's Trainer checkpoints (``adapter_model.safetensors``), written by the real writers: transformers'
``Trainer`` saving a ``peft`` model.  Before, ``checkpoint-N`` holding only an adapter was "not a checkpoint".

The truth: the adapter tensors of the live model at each save, taken by a ``TrainerCallback``
in this test (not read back from the files).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

import gradforensics as gf  # noqa: E402


class _Keep(transformers.TrainerCallback):
    def __init__(self, model):
        self.model, self.at = model, {}

    def on_save(self, args, state, control, **kw):
        self.at[state.global_step] = {n: p.detach().clone() for n, p in self.model.named_parameters()
                                      if p.requires_grad}


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("lora") / "out"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg),
                                peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    keep = _Keep(model)
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=6, save_steps=2, logging_steps=1,
                                          per_device_train_batch_size=4, learning_rate=1e-2, report_to=[],
                                          use_cpu=True, disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[keep]).train()
    return out, keep.at


def test_adapter_checkpoints_import_as_the_updates_of_the_adapter_tensors(lora_run, tmp_path):
    out, at = lora_run
    store = gf.import_run(out, tmp_path / "imp.zarr", tensors=["*lora_*"])
    assert store.batches()["step"].tolist() == [4, 6]
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    live = name.replace("lora_B.weight", "lora_B.default.weight")      # the live module's adapter name
    got = store.read(f"grads/{name}")
    for i, (lo, hi) in enumerate(((2, 4), (4, 6))):
        np.testing.assert_allclose(got[i], (at[hi][live] - at[lo][live]).numpy(), rtol=0, atol=1e-7)
    assert len(store.grads) == 3 * 2 * 2                                # 3 layers x q,v x A,B
    adapter = store.meta.extra["import"]["adapter"]
    assert adapter["r"] == 2 and adapter["lora_alpha"] == 4 and adapter["peft_type"] == "LORA"
    losses = store.batches()["loss"]
    assert np.isfinite(losses).all()                                    # from the checkpoints' trainer_state.json
