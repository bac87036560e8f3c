"""The alpha rule on a real healthy run (issue 40): the nanoGPT twin behind a q/k LayerNorm at AdamW 3e-2
learns fast and grows heavy ESD tails (alpha < 2) in every linear layer; that is the run's regime, so each
alpha is context (< 0.5) and says why, and no spectral flag reaches 0.5."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from gradforensics.testing.twins import describe, judge


@pytest.mark.slow
def test_heavy_tails_of_a_fast_healthy_run_are_context(tmp_path) -> None:
    twin = judge("nanogpt", tmp_path, seed=0, arms=["qk-ln"])["qk-ln"]
    alpha = [f for f in twin.flags if f.kind == "spectral" and f.evidence.get("reason") == "alpha"]
    assert sum(f.evidence["alpha"] < 2 for f in alpha) >= 3, describe(twin)      # the regime is there
    assert all(f.severity < 0.5 and f.evidence.get("context") in ("fit", "run") for f in alpha), describe(twin)
    assert all("context" in f.summary for f in alpha)
    assert not [f for f in twin.flags if f.kind == "spectral" and f.severity >= 0.5], describe(twin)
