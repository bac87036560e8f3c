"""Twin family late-rows (issue 40): Adam with embedding rows first seen late / steady data, judged at seed 0."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from gradforensics.testing.twins import FAMILIES, describe, judge


@pytest.mark.slow
def test_late_rows_sick_first_flag_is_the_embeddings_stale_rows_and_the_twin_is_quiet(tmp_path) -> None:
    fam = FAMILIES["late-rows"]
    out = judge("late-rows", tmp_path, seed=0)
    sick, twin = out["late"], out["steady"]
    text = describe(sick) + "\n" + describe(twin)
    # the truth, measured in torch, separates the arms
    assert sick.truth["zero_v_rows"] >= 20 and twin.truth["zero_v_rows"] == 0, text
    assert sick.truth["loss_spike"] > 1.0 and twin.truth["loss_spike"] < 0.5, text
    assert sick.truth["late_update_ratio"] > 2 * twin.truth["late_update_ratio"], text
    first = sick.first()
    assert first is not None and fam.expect.matches(first), text
    assert first.evidence["cause"] == "optimizer state" and first.evidence["record"] == 90, text
    assert first.evidence["stale_rows"] == sick.truth["zero_v_rows"], text
    assert all(r >= 96 for r in first.evidence["rows"]), text        # the second script's rows
    assert twin.largest("optimizer") < 0.5, text
    assert twin.first() is None, text      # no flag of any kind at or above 0.5 on the steady twin
