"""Twin family gru-lm: a byte-level GRU LM whose gradients explode without clipping, beside its clipped twin."""

from __future__ import annotations

import pytest

from gradforensics.testing.twins import FAMILIES, describe, judge

pytest.importorskip("torch")


@pytest.mark.slow
def test_gru_lm_sick_run_names_its_recurrent_weight_and_the_clipped_twin_is_quiet(tmp_path) -> None:
    fam = FAMILIES["gru-lm"]
    out = judge("gru-lm", tmp_path, seed=0)
    sick, twin = out[fam.sick], out["clip"]
    # the truth, from plain torch: the unclipped run's loss climbs far above its start, its W_hh is thrown
    assert sick.truth["finite"] == 1.0 and twin.truth["finite"] == 1.0
    assert sick.truth["loss_max"] > 2 * twin.truth["loss_max"], describe(sick)
    assert sick.truth["weight_hh_sn_last"] > 3 * twin.truth["weight_hh_sn_last"], describe(sick)
    assert sick.truth["grad_hh_max_over_median"] > 10.0
    assert twin.first() is None, describe(twin)
    first = sick.first()
    assert first is not None and fam.expect.matches(first), describe(sick)
    assert first.evidence["reason"] == "recurrent_jump"
