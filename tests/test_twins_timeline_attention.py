"""The timeline on the zoo's runs without a loss spike (issue 44): nanogpt (attention-logit growth) and
mixture (a broken source), seed 0, against what each family measures in its own torch code.

Truth: nanogpt's attention modules recompute q·kᵀ/√d from the q and k they hand to SDPA every step; a head's
onset is the first step from which its max logit stays above 3x its opening level (the mean of the first 10
steps).  The growth starts at steps 9–20, barely past the departure test's burn-in (8 values), and then
compounds: a test against each series' own trailing window dates its first departure for one head within
a record (the first to move, head 2 of layer 1) and sees the others' later acceleration, never before the
torch onset.  What is asserted: the first series to depart is a max attention logit, within 2 records of its
torch onset; no departure is dated before its head's torch onset; only heads whose logits grew 3x depart;
the healthy twins (q/k LayerNorm, low LR) show nothing.  mixture's broken source is broken from the first
record: nothing departs from an earlier level (the conflict analysis flags it), and the loss never spikes.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from gradforensics.testing.twins.timeline_truth import rows, timeline_of


@pytest.mark.slow
def test_nanogpt_the_first_to_move_is_an_attention_logit_at_its_torch_onset(tmp_path) -> None:
    truth, tl = timeline_of("nanogpt", "high-lr", tmp_path)
    found = [r for r in rows("nanogpt", "high-lr", truth, tl) if r["signal"].startswith("max_logit/")]
    assert tl["spikes"] == [], tl
    first = tl["departures"][0]
    assert first["signal"] == "attn_max_logit", tl
    head = f"max_logit/{first['tensor'].split('.')[2]}.{first['head']}"
    assert abs(first["record"] - truth[f"onset/{head}"]) <= 2, (first, truth[f"onset/{head}"])
    departed = [r for r in found if r["timeline"] is not None]
    assert len(departed) >= 3, found
    for r in departed:
        assert r["measured"] is not None and r["timeline"] >= r["measured"] - 2, r
    for arm in ("qk-ln", "low-lr"):
        _, healthy = timeline_of("nanogpt", arm, tmp_path)
        assert healthy["spikes"] == [] and healthy["departures"] == [], (arm, healthy)


@pytest.mark.slow
def test_mixture_a_source_broken_from_the_start_departs_from_nothing(tmp_path) -> None:
    truth, tl = timeline_of("mixture", "broken", tmp_path)
    # the truth: the broken source's loss is as high late as early (it never learns), the others fall
    assert math.isclose(truth["loss_early_broken"], truth["loss_late_broken"], rel_tol=0.05), truth
    assert tl["spikes"] == [] and not [e for e in tl["departures"] if e["signal"] == "loss"], tl
    _, clean = timeline_of("mixture", "clean", tmp_path)
    assert clean["spikes"] == [] and clean["departures"] == [], clean
