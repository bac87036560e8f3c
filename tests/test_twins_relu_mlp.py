"""Twin family ``relu-mlp``: the sick arm's first flag names its dead units; the healthy twin raises nothing >= 0.5.

The truth is measured in plain torch (forward hooks on the ReLUs over a held-out batch), independently
of the store: the sick arm ends with most units dead, the twin with a few percent at most.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from gradforensics.testing.twins import FAMILIES, describe, judge

OWN = ("saturation", "precision")       # the kinds this family calibrates


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    return judge("relu-mlp", tmp_path_factory.mktemp("relu_mlp"), seed=0)


@pytest.mark.slow
def test_relu_mlp_sick_arm_leads_with_its_dead_units(judged) -> None:
    sick, twin = judged["high-lr"], judged["sane-lr"]
    assert sick.truth["dead_last"] >= 0.3 and sick.truth["dead_last"] - sick.truth["dead_first"] >= 0.25, describe(sick)
    assert twin.truth["dead_last"] <= 0.15, describe(twin)
    first = sick.first()
    assert first is not None and FAMILIES["relu-mlp"].expect.matches(first), describe(sick)
    assert first.severity - twin.largest(first.kind) >= 0.5, (describe(sick), describe(twin))
    assert all(twin.largest(kind) < 0.5 for kind in OWN), describe(twin)


@pytest.mark.slow
def test_relu_mlp_healthy_twin_raises_no_flag(judged) -> None:
    twin = judged["sane-lr"]
    assert twin.first() is None, describe(twin)
