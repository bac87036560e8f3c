"""The timeline on the zoo's runs without a loss spike (issue 44): nanogpt (attention-logit growth) and
mixture (a broken source), seed 0, against what each family measures in its own torch code.

Truth: nanogpt's attention modules recompute q·kᵀ/√d from the q and k they hand to SDPA every step; a head's
onset is the first step from which its max logit stays above 3x its opening level (the mean of the first 10
steps).  The growth starts at steps 1–20 and compounds, dragging a trailing window along with it; the attention
series are also tested against their frozen opening level (the first 8 values), which dates it at its start.
What is asserted: every head whose logits grew 3x departs, within 6 records of its torch onset, or, when its
growth was already under way inside the 8-value burn-in (its onset is the first scored record), no later than
the torch onset; the healthy twins (q/k LayerNorm, low LR) show nothing.  mixture's broken source is broken from
the first record: nothing departs from an earlier level (the conflict analysis flags it), and the loss never
spikes.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from gradforensics.testing.twins.timeline_truth import rows, timeline_of


@pytest.mark.slow
def test_nanogpt_every_growing_head_is_dated_within_a_few_records_of_its_torch_onset(tmp_path) -> None:
    truth, tl = timeline_of("nanogpt", "high-lr", tmp_path)
    found = [r for r in rows("nanogpt", "high-lr", truth, tl) if r["signal"].startswith("max_logit/")]
    assert tl["spikes"] == [], tl
    burn_in = 8
    grown = [r for r in found if r["measured"] is not None]
    assert len(grown) == 8, found                        # all eight heads grow 3x at seed 0
    for r in found:
        assert (r["timeline"] is not None) == (r["measured"] is not None), r
    for r in grown:
        if r["timeline"] == burn_in:                      # already growing inside the burn-in
            assert r["timeline"] <= r["measured"], r
        else:
            assert abs(r["timeline"] - r["measured"]) <= 6, r
    assert sum(abs(r["timeline"] - r["measured"]) <= 6 for r in grown) >= 7, found
    first = min(tl["departures"], key=lambda e: e["record"])
    assert first["signal"] == "attn_max_logit" and first["record"] <= min(r["measured"] for r in grown), tl
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
