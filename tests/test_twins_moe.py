"""The mixture-of-experts twins (issue 43): routing collapse without the load-balancing loss / with it
(tiny HF Mixtral), a top-1 router starved of gradient by normalised top-k weights / top-2 with the
load-balancing loss (tiny HF Qwen2-MoE), each measured in plain torch (the module's own router hooks
and gradient norms).

The truth tests run on their own; the judged ones (the sick arm's first flag is ``experts`` on an MoE
layer, the healthy twin has no flag >= 0.5) skip until an analysis emitting the ``experts`` kind is
registered, and then train once for both.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from gradforensics.analysis import REGISTRY
from gradforensics.store.reader import open_store
from gradforensics.testing.twins import FAMILIES, describe, judge, train
from gradforensics.testing.twins.moe import COLLAPSE_TOKENS

HAS_EXPERTS = any("experts" in a.kinds for a in REGISTRY.values())
needs_experts = pytest.mark.skipif(not HAS_EXPERTS, reason="no registered analysis emits the 'experts' kind yet "
                                                           "(issue 43 item 2)")


def _arms(family: str, work: Path) -> dict[str, Any]:
    """Every arm at seed 0: judged when the experts kind exists, else trained only (truths, no flags)."""
    if HAS_EXPERTS:
        return dict(judge(family, work, seed=0))
    return {arm: train(family, arm, work / f"{family}-{arm}-0.zarr", seed=0) for arm in FAMILIES[family].arms}


def _truth(arm: Any) -> dict[str, float]:
    return arm if isinstance(arm, dict) else arm.truth


@pytest.fixture(scope="module")
def collapse(tmp_path_factory) -> tuple[dict[str, Any], Path]:
    work = tmp_path_factory.mktemp("moe-collapse")
    return _arms("moe-collapse", work), work


@pytest.fixture(scope="module")
def starved(tmp_path_factory) -> tuple[dict[str, Any], Path]:
    work = tmp_path_factory.mktemp("moe-starved")
    return _arms("moe-starved", work), work


def _layer(tensor: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", tensor)
    return None if m is None else int(m.group(1))


@pytest.mark.slow
def test_collapse_truth_the_sick_arm_collapses_and_the_balanced_twin_does_not(collapse) -> None:
    arms, work = collapse
    sick, twin = _truth(arms["collapse"]), _truth(arms["balanced"])
    level = COLLAPSE_TOKENS / 2                                      # top-2: the busiest expert in 90% of top-2s
    i = int(sick["collapse_layer"])
    # sick: from near the start (init ~0.3) past the level, and there for the whole second half
    assert sick[f"max_share_first_{i}"] < level <= sick[f"max_share_last_{i}"], sick
    assert 0 <= sick[f"onset_{i}"] <= 20 and sick[f"collapsed_frac_{i}"] >= 0.9, sick
    assert sick[f"dead_{i}"] >= 1                                    # experts with no token over the last ten steps
    # the twin (the same run plus the load-balancing loss) never holds the level, and keeps every expert
    for j in range(2):
        assert twin[f"onset_{j}"] == -1 and twin[f"max_share_last_{j}"] < 0.4, twin
        assert twin[f"collapsed_frac_{j}"] <= 0.1 and twin[f"dead_{j}"] == 0, twin
    # the recorder's router statistics are the shares this module counted itself
    for arm in ("collapse", "balanced"):
        s = open_store(work / f"moe-collapse-{arm}-0.zarr")
        t = _truth(arms[arm])
        for j in range(2):
            share = s.router(f"model.layers.{j}.mlp.gate", "max_share")
            assert share[0] == pytest.approx(t[f"max_share_first_{j}"], rel=1e-6)
            assert float(np.mean(share[-10:])) == pytest.approx(t[f"max_share_last_{j}"], rel=1e-5)
    # the load-balancing loss: the collapsed layer's far above k = 2 (towards E = 8), the twin's near k; only the
    # twin, trained with it (output_router_logits=True), has the model's own aux_loss recorded
    sick_s, twin_s = (open_store(work / f"moe-collapse-{arm}-0.zarr") for arm in ("collapse", "balanced"))
    assert np.median(sick_s.router(f"model.layers.{i}.mlp.gate", "aux_loss")[-10:]) > 6.0
    assert all(np.median(twin_s.router(f"model.layers.{j}.mlp.gate", "aux_loss")[-10:]) < 4.0 for j in range(2))
    assert sick_s.model_aux_loss() is None
    model_aux = twin_s.model_aux_loss()
    assert model_aux is not None and np.isfinite(model_aux).all() and 1.9 < np.median(model_aux) < 3.0


@pytest.mark.slow
def test_starved_truth_the_top1_router_gets_no_gradient_and_the_top2_routers_do(starved) -> None:
    arms, _ = starved
    sick = _truth(arms["starved"])
    for ref in ("top2-balanced", "top2"):
        other = _truth(arms[ref])
        learning = min(other[f"router_grad_ratio_{j}"] for j in range(2))
        assert learning > 0.05, other
        assert sick["router_grad_ratio"] < 1e-4 * learning, (sick, other)
    # the healthy twin's routing stays spread (top-2 without the loss collapses: information only)
    twin = _truth(arms["top2-balanced"])
    assert twin["onset"] == -1 and twin["max_share_last"] < 0.4, twin


@needs_experts
@pytest.mark.slow
def test_collapse_judged_first_flag_is_experts_on_the_collapsed_layer(collapse) -> None:
    arms, _ = collapse
    fam, sick, twin = FAMILIES["moe-collapse"], arms["collapse"], arms["balanced"]
    first = sick.first()
    assert first is not None and fam.expect.matches(first), describe(sick)
    assert _layer(first.tensor) == int(sick.truth["collapse_layer"]), describe(sick)
    assert twin.first() is None, describe(twin)                      # no flag of any kind at or above 0.5


@needs_experts
@pytest.mark.slow
def test_starved_judged_first_flag_is_experts_and_the_balanced_top2_twin_is_quiet(starved) -> None:
    arms, _ = starved
    fam, sick, twin = FAMILIES["moe-starved"], arms["starved"], arms["top2-balanced"]
    first = sick.first()
    assert first is not None and fam.expect.matches(first), describe(sick)
    assert twin.first() is None, describe(twin)
