"""Twin family ``mixture`` (issue 40): one source with random targets / three clean sources of different domains.

The truth (plain torch): the broken source's loss stays near log 256 while the others fall; the clean
twin's sources all learn and their mean gradients disagree (negative cosines: the base rate).  The
report must name 'broken' in its first flag, and say nothing at or above 0.5 of the clean twin.
"""

from __future__ import annotations

import math

import pytest

from gradforensics.testing.twins import FAMILIES, describe, judge

pytestmark = [pytest.mark.slow, pytest.mark.torch]


@pytest.fixture(scope="module")
def judged(tmp_path_factory):
    pytest.importorskip("torch")
    return judge("mixture", tmp_path_factory.mktemp("mixture"), seed=0)


def test_mixture_truth_and_the_conflict_rule_at_seed_0(judged) -> None:
    sick, twin = judged["broken"], judged["clean"]
    text = describe(sick) + "\n" + describe(twin)
    # the truth separates the arms: the broken source learns nothing, every clean source learns
    assert sick.truth["loss_late_broken"] > 0.95 * math.log(256) > sick.truth["loss_late_python"] + 2, text
    assert all(twin.truth[f"loss_late_{s}"] < 0.7 * twin.truth[f"loss_early_{s}"]
               for s in ("python", "english", "records")), text
    # and the clean sources' mean gradients disagree: the base rate the rule must not flag
    assert min(v for k, v in twin.truth.items() if k.startswith("cos_")) < -0.1, text
    assert twin.largest("conflict") < 0.5, text
    first = sick.first()
    assert first is not None and FAMILIES["mixture"].expect.matches(first), text
    assert first.evidence["named"] == ["broken"], text


def test_clean_twin_raises_no_flag_of_any_kind(judged) -> None:
    assert judged["clean"].first() is None, describe(judged["clean"])
