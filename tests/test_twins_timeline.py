"""The timeline on the zoo's spiking runs (issue 44): late-rows (Adam rows first seen late) and logits
(output-logit divergence), seed 0, against the onsets each family measures in its own torch code.

Truth (``gradforensics.testing.twins``): late-rows measures, per step in torch, the loss spike (the first
step above the mean + 6 sd of the 30 before), the step the most embedding rows with ``exp_avg_sq`` = 0 get a
gradient, and the first jump of the embedding's ‖Δw‖/‖w‖ (above twice the median of the 10 steps before);
logits the loss spike (mean + 6 sd of the 37 before, on the torch cross-entropy) and the step from which log
Z (``torch.logsumexp``) stays above its opening level + log 256.  Tolerances: the spike to the record; the
stale rows to the record; the update ratio within 4 records (it is summarised every 4th record); log Z
within 5 records.  The healthy twins: no spike and no departure at the documented level.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from gradforensics.testing.twins.timeline_truth import rows, timeline_of


def _by_signal(found: list[dict]) -> dict[str, dict]:
    return {r["signal"]: r for r in found}


@pytest.mark.slow
def test_late_rows_stale_rows_arrive_with_the_spike_and_the_update_ratio_follows(tmp_path) -> None:
    truth, tl = timeline_of("late-rows", "late", tmp_path)
    got = _by_signal(rows("late-rows", "late", truth, tl))
    assert got["loss spike"]["timeline"] == got["loss spike"]["measured"] == truth["spike"], (got, tl)
    stale = got["stale_share/embed.weight"]
    assert stale["timeline"] == stale["measured"] and stale["lead"] == 0, (got, tl)
    ratio = got["update_ratio/embed.weight"]
    assert ratio["timeline"] is not None and abs(ratio["timeline"] - ratio["measured"]) <= 4, (got, tl)
    # order: the stale rows first (at the spike), then the update ratio
    order = [e["signal"] for e in tl["departures"]]
    assert order.index("stale_share") < order.index("update_ratio"), tl
    _, healthy = timeline_of("late-rows", "steady", tmp_path)
    assert healthy["spikes"] == [] and healthy["departures"] == [], healthy


@pytest.mark.slow
def test_logits_log_z_departs_before_the_spike_within_a_few_records(tmp_path) -> None:
    truth, tl = timeline_of("logits", "high-lr", tmp_path)
    got = _by_signal(rows("logits", "high-lr", truth, tl))
    assert got["loss spike"]["timeline"] == got["loss spike"]["measured"], (got, tl)
    spike = tl["spikes"][0]
    before = {e["signal"]: e for e in spike["signals"]}
    assert "logz" in before, spike
    assert abs(before["logz"]["record"] - truth["onset_step"]) <= 5, (before, truth)
    assert before["logz"]["lead_steps"] == spike["step"] - before["logz"]["step"] >= 0
    _, healthy = timeline_of("logits", "low-lr", tmp_path)
    assert healthy["spikes"] == [] and healthy["departures"] == [], healthy
