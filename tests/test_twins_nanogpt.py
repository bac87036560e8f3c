"""The nanoGPT twins (issue 40): attention-logit growth at a high LR / the same LR behind a q/k LayerNorm / a
low LR, each measured in plain torch (the family's own q.k^T), recorded through the SDPA tap.

The sick arm's first flag is ``attention_logits`` on a head that the truth shows grew and collapsed (in the
layer of the largest measured logit, or the head of the lowest entropy); the q/k-LayerNorm twin's weights grow
as much, but behind a norm and with measured logits they are context (< 0.5), and neither twin raises
anything of the attention kinds or q/k growth at 0.5 or more.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from gradforensics.testing.twins import FAMILIES, describe, judge


@pytest.mark.slow
def test_nanogpt_sick_arm_leads_with_logit_growth_and_its_twins_are_quiet(tmp_path) -> None:
    fam = FAMILIES["nanogpt"]
    out = judge("nanogpt", tmp_path, seed=0)
    sick, qk, low = out["high-lr"], out["qk-ln"], out["low-lr"]
    # the truth separates the arms: logits grow tens-fold and attention goes one-hot only in the sick arm
    assert sick.truth["max_logit_last"] > 10 * sick.truth["max_logit_first"] and sick.truth["max_logit_last"] > 100
    assert sick.truth["entropy_min_last"] < 0.1
    for twin in (qk, low):
        assert twin.truth["max_logit_last"] < 20 and twin.truth["entropy_min_last"] > 0.3, describe(twin)
    first = sick.first()
    assert first is not None and fam.expect.matches(first), describe(sick)
    layer, head = int(first.tensor.split(".")[2]), first.head
    assert first.tensor == f"transformer.h.{layer}.attn"
    assert sick.truth[f"max_logit/{layer}.{head}"] > 10 * max(qk.truth["max_logit_last"], low.truth["max_logit_last"])
    assert sick.truth[f"entropy/{layer}.{head}"] < 0.1, describe(sick)
    # the q/k weights of the LayerNorm twin grow like the sick arm's: context, and it says why
    grown = [f for f in qk.flags if f.kind == "spectral" and f.evidence.get("cause") == "attention"]
    assert grown and all(f.severity < 0.5 and f.evidence.get("context") for f in grown), describe(qk)
    for twin in (qk, low):
        assert twin.first() is None, describe(twin)      # no flag of any kind at or above 0.5
