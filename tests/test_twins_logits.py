"""The logits twins (issue 40): a byte LM whose output logits diverge at a high LR / the same model at a low LR.

The truth is log Z (``torch.logsumexp`` of the logits of each training batch) and the loss, measured in the
family's own torch code.  The sick arm's first flag is ``logits`` on ``lm_head``, since about the step the truth
says log Z left its opening level; the low-LR twin raises no flag >= 0.5 of any kind.  The z-loss arm (the high
LR plus 1e-4 * log^2 Z) is information only: it is trained and judged, nothing is asserted of it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("torch")

from gradforensics.store.reader import open_store
from gradforensics.testing.twins import FAMILIES, describe, judge
from gradforensics.testing.twins.logit_divergence import EDGE, VOCAB


@pytest.mark.slow
def test_logits_sick_arm_leads_with_log_z_growth_on_the_head_and_the_low_lr_twin_is_quiet(tmp_path) -> None:
    fam = FAMILIES["logits"]
    out = judge("logits", tmp_path, seed=0, arms=("high-lr", "low-lr"))
    sick, low = out["high-lr"], out["low-lr"]
    # the truth separates the arms: log Z grows by tens of nats and the loss climbs only in the sick arm
    assert sick.truth["logz_mean_last"] - sick.truth["logz_mean_first"] > 10 * math.log(VOCAB), describe(sick)
    assert sick.truth["loss_last"] > 3 * sick.truth["loss_first"]
    assert abs(low.truth["logz_mean_last"] - low.truth["logz_mean_first"]) < math.log(VOCAB), describe(low)
    assert low.truth["loss_last"] < low.truth["loss_first"] and math.isnan(low.truth["onset_step"])
    # the store's log Z is torch's (the recorder's tap against the family's own logsumexp)
    stored = open_store(tmp_path / "logits-high-lr-0.zarr").logits("lm_head", "logz_mean")
    assert float(np.mean(stored[-EDGE:])) == pytest.approx(sick.truth["logz_mean_last"], rel=1e-4)
    first = sick.first()
    assert first is not None and fam.expect.matches(first), describe(sick)
    assert abs(first.evidence["since_record"] - sick.truth["onset_step"]) <= 10, describe(sick)   # one window
    assert not [f for f in low.flags if f.severity >= 0.5], describe(low)
    assert sick.first().severity - low.largest("logits") >= 0.5
