"""The curvature probe runs its double backward on eager attention and hands the model its own back after."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gradforensics.replay.optimstate import hyper_of  # noqa: E402
from gradforensics.replay.probe import CheckpointProbe, CurvatureSpec  # noqa: E402


def test_a_kernel_without_double_backward_is_switched_to_eager_for_the_probe_only(monkeypatch) -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    calls: list[str] = []

    def fused(module, *args, **kwargs):      # stands for a fused kernel (no double backward)
        calls.append("fused")
        return eager_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("gf_test_fused", fused)
    AttentionMaskInterface.register("gf_test_fused", eager_mask)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager"))
    model.set_attn_implementation("gf_test_fused")
    ids = torch.randint(0, 64, (2, 8))

    def forward() -> list[str]:
        calls.clear()
        model(input_ids=ids)
        return list(calls)

    seen: list[list[str]] = []
    monkeypatch.setattr(CheckpointProbe, "curvature", lambda self, m, fn: seen.append(forward()))
    monkeypatch.setattr(CheckpointProbe, "optim", lambda self, m: None)
    monkeypatch.setattr("gradforensics.store.probes.write_probes", lambda *a: None)
    assert forward() == ["fused"]
    spec = CurvatureSpec(optimizer="sgd", lr=0.1)
    probe = CheckpointProbe(spec, hyper_of(None, spec.overrides()))
    probe.finish(model, lambda m, b: m(input_ids=b).logits.sum(), None)
    assert seen == [[]]                           # during the probe: eager, not the kernel
    assert forward() == ["fused"]             # after: the model's own implementation again
