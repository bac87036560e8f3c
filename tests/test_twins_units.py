"""Twin families ``relu-mlp`` and ``cnn-bn``: the sick arm's first flag names its dead units; the healthy twin
raises nothing >= 0.5.

The truth is measured in plain torch (forward hooks on the ReLUs over a held-out batch), independently
of the store: the sick arm ends with most units (channels) dead, the twin with a few percent at most.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from gradforensics.testing.twins import FAMILIES, describe, judge

ARMS = {"relu-mlp": ("high-lr", "sane-lr"), "cnn-bn": ("dead", "sane")}       # family: (sick, healthy)


@pytest.fixture(scope="module", params=sorted(ARMS))
def judged(request, tmp_path_factory):
    family = request.param
    return family, judge(family, tmp_path_factory.mktemp(family), seed=0)


@pytest.mark.slow
def test_sick_arm_leads_with_its_dead_units_and_its_twin_is_quiet(judged) -> None:
    family, out = judged
    sick, twin = (out[arm] for arm in ARMS[family])
    assert sick.truth["dead_last"] >= 0.3 and sick.truth["dead_last"] - sick.truth["dead_first"] >= 0.25, describe(sick)
    assert twin.truth["dead_last"] <= 0.15, describe(twin)
    first = sick.first()
    assert first is not None and FAMILIES[family].expect.matches(first), describe(sick)
    assert first.severity - twin.largest(first.kind) >= 0.5, (describe(sick), describe(twin))
    assert twin.first() is None, describe(twin)          # no flag of any kind at or above 0.5
