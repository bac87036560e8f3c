"""Helpers that used to exist twice or thrice, now one each: the layer of a name
(analyses and report), the rank-trend test (drift, saturation, spectral), the bimodality
coefficient (oscillation, saturation), the record windows, the head cell of a table."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import spearmanr

from gradforensics.analysis.toolkit.kspace import window_edges
from gradforensics.analysis.toolkit.stats import bimodality_coefficient, rank_trend
from gradforensics.analysis.toolkit.units import head_of
from gradforensics.reporting import names
from gradforensics.store.names import layer_of, split_layer

LAYERED = [
    ("model.layers.5.self_attn.q_proj.weight", 5),                       # LLaMA / Qwen / Mistral
    ("model.layers.31.mlp.down_proj.weight", 31),
    ("model.layers.3.block_sparse_moe.experts.7.w1.weight", 3),          # Mixtral: the layer, not the expert
    ("transformer.h.11.attn.c_attn.weight", 11),                         # GPT-2
    ("gpt_neox.layers.2.attention.query_key_value.weight", 2),           # GPT-NeoX / Pythia
    ("transformer.resblocks.4.mlp.c_fc.weight", 4),                      # CLIP text tower
    ("visual.transformer.resblocks.0.attn.in_proj_weight", 0),           # CLIP vision tower
    ("bert.encoder.layer.3.attention.self.query.weight", 3),             # BERT
    ("encoder.layer.10.output.dense.weight", 10),
    ("encoder.block.3.layer.0.SelfAttention.q.weight", 3),               # T5: the block, not the sub-layer
    ("decoder.block.2.layer.1.EncDecAttention.k.weight", 2),
    ("model.decoder.layers.6.fc1.weight", 6),                            # BART / OPT
    ("blocks.0.mlp.fc1.weight", 0),                                      # ViT (timm)
    ("module.model.layers.7.mlp.up_proj.weight", 7),                     # DDP-wrapped
    ("model.layers.2.mlp.act_fn", 2),                                    # an activation module
    ("model.layers.4", 4),                                               # the block itself
    ("gpt_neox.layers.3.attention.query_key_value.weight", 3),           # GPT-NeoX fused QKV
    ("model.decoder.layers.5.self_attn.q_proj.weight", 5),               # OPT
    ("transformer.h.2.self_attention.query_key_value.weight", 2),        # Falcon
    ("model.layers.1.mlp.fc1.weight", 1),                                # Phi
    ("model.layers.7.block_sparse_moe.experts.3.w1.weight", 7),          # Mixtral expert: layer 7, not expert 3
    ("model.layers.0.block_sparse_moe.gate.weight", 0),                  # Mixtral router
    ("transformer.blocks.9.ffn.experts.mlp.w1", 9),                      # DBRX-style fused experts
    ("vit.encoder.layer.11.attention.attention.query.weight", 11),       # ViT (HF)
]
UNLAYERED = [
    "lm_head.weight", "model.embed_tokens.weight", "model.norm.weight", "transformer.wte.weight",
    "conv1.weight", "visual.proj", "batches/loss", "layers.1234567.weight", "0.weight", "",
]


@pytest.mark.parametrize(("name", "layer"), LAYERED)
def test_layer_of_common_naming_schemes(name: str, layer: int) -> None:
    assert layer_of(name) == layer
    assert names.parse(name).layer == layer    # the report reads the same rule


@pytest.mark.parametrize("name", UNLAYERED)
def test_names_outside_a_layer_stack(name: str) -> None:
    assert layer_of(name) is None and split_layer(name) is None
    assert names.parse(name).layer is None


def test_split_layer_and_report_location() -> None:
    assert split_layer("transformer.h.11.attn.c_attn.weight") == ("transformer.h", 11, "attn.c_attn.weight")
    assert split_layer("model.layers.4") == ("model.layers", 4, "")
    assert names.parse("model.layers.4").prefix is None          # a block itself is named whole in locations
    units = [("transformer.resblocks.4.mlp.c_fc.weight", None), ("transformer.resblocks.5.mlp.c_fc.weight", None)]
    assert names.location(units) == "transformer.resblocks.4–5 c_fc"


def test_rank_trend_matches_scipy() -> None:
    rng = np.random.default_rng(0)
    y = np.cumsum(rng.standard_normal(30))
    r = spearmanr(np.arange(30), y)
    assert rank_trend(y) == pytest.approx((r.statistic, r.pvalue))
    fall = -np.arange(12.0) + rng.standard_normal(12)
    fall[[2, 7]] = np.nan
    ok = np.isfinite(fall)
    r = spearmanr(np.flatnonzero(ok), fall[ok], alternative="less")
    assert rank_trend(fall, min_n=4, alternative="less", skip_nonfinite=True) == pytest.approx((r.statistic, r.pvalue))


@pytest.mark.parametrize(("y", "kwargs"), [
    (np.arange(7.0), {"min_n": 8}),                          # too short
    (np.ones(20), {}),                                       # constant
    (np.r_[np.arange(9.0), np.nan], {}),                     # a NaN, not skipped
    (np.r_[np.arange(3.0), [np.nan] * 5], {"min_n": 4, "skip_nonfinite": True}),   # too few finite values
])
def test_rank_trend_without_a_test(y: np.ndarray, kwargs: dict) -> None:
    rho, p = rank_trend(y, **kwargs)
    assert math.isnan(rho) and math.isnan(p)


def test_bimodality_coefficient_against_scipy() -> None:
    from scipy.stats import kurtosis, skew

    x = np.random.default_rng(1).gamma(2.0, size=50)
    g, k, n = skew(x, bias=False), kurtosis(x, bias=False), x.size
    assert bimodality_coefficient(x) == pytest.approx((g * g + 1) / (k + 3 * (n - 1) ** 2 / ((n - 2) * (n - 3))))
    assert math.isnan(bimodality_coefficient(np.ones(9))) and math.isnan(bimodality_coefficient([1.0, 2.0, 3.0]))


@pytest.mark.parametrize(("cell", "head"), [(None, None), (float("nan"), None), (3, 3), (2.0, 2), (np.int64(5), 5)])
def test_head_of(cell: object, head: int | None) -> None:
    assert head_of(cell) == head


@pytest.mark.parametrize(("n", "windows", "edges"), [
    (16, 8, [0, 2, 4, 6, 8, 10, 12, 14, 16]), (5, 8, [0, 1, 2, 3, 4, 5]), (10, 3, [0, 3, 7, 10]), (0, 8, [0]),
])
def test_window_edges(n: int, windows: int, edges: list[int]) -> None:
    assert window_edges(n, windows).tolist() == edges


def test_finite_mean_is_the_mean_of_finite_entries_and_quiet_when_none() -> None:
    import warnings

    from gradforensics.analysis.toolkit.stats import finite_mean

    x = np.array([1.0, np.nan, 3.0, np.inf, -np.inf])
    assert finite_mean(x) == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # np.nanmean would warn "Mean of empty slice" here
        assert np.isnan(finite_mean(np.full(4, np.nan)))
        assert np.isnan(finite_mean([]))
