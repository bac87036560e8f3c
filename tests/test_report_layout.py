"""The report's figures and names, read as a person reads them (issue 45, item 10): unique short module
names for nanoGPT / BERT naming, a colour bar as tall as its map, a legend off the points, a conflict matrix
that fills its panel without ``-0.00``, one source order on both sides of a compare, a badge that is a badge.
No browser here (tests/test_report_browser.py looks at the page)."""

from __future__ import annotations

import dataclasses
import re

import _report_data as data
import numpy as np
import pandas as pd
import pytest

from gradforensics._contrast import two_places
from gradforensics.analysis.contract.model import AnalysisResult, Findings, Flag
from gradforensics.analysis.toolkit import units as un
from gradforensics.reporting import figures, names

NANOGPT_LAYER = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                 "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                 "mlp.c_proj.weight", "mlp.c_proj.bias")
BERT_LAYER = ("attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight",
              "attention.output.dense.weight", "attention.output.LayerNorm.weight", "intermediate.dense.weight",
              "output.dense.weight", "output.LayerNorm.weight")


@pytest.mark.parametrize(("prefix", "layer"), [("transformer.h", NANOGPT_LAYER), ("bert.encoder.layer", BERT_LAYER)])
def test_short_module_names_are_unique(prefix, layer):
    short = names.unique_modules(layer)
    assert len(set(short.values())) == len(layer), short
    # one tensor at a time (a finding on a single tensor): no two modules read the same (a weight alone
    # and a bias alone name their module)
    modules = {t.rsplit(".", 1)[0] for t in layer}
    alone = {m: names.location([(f"{prefix}.3.{m}.weight", None)]) for m in modules}
    assert len(set(alone.values())) == len(modules), alone


def test_nanogpt_projections_are_told_apart():
    units = [("transformer.h.3.attn.c_proj.weight", None), ("transformer.h.3.mlp.c_proj.weight", None)]
    assert names.location(units) == "transformer.h.3 attn.c_proj/mlp.c_proj"
    assert names.location(units[1:]) == "transformer.h.3 mlp.c_proj"
    both = [("transformer.h.0.attn.c_attn.weight", None), ("transformer.h.0.attn.c_attn.bias", None)]
    assert names.location(both) == "transformer.h.0 c_attn.weight/c_attn.bias"
    # LLaMA names stay as short as before
    assert names.location([("model.layers.5.self_attn.q_proj.weight", 2), ("model.layers.5.self_attn.k_proj.weight", 2)]) \
        == "model.layers.5 q_proj/k_proj, head 2"


def test_cell_numbers_never_read_minus_zero():
    assert two_places(-0.0001) == "0.00" and two_places(-0.0) == "0.00" and two_places(-0.005) == "-0.01"
    assert two_places(0.004) == "0.00" and two_places(-0.88) == "-0.88"


def _conflict_findings(order: tuple[str, ...], pair: tuple[str, str] = ("zh", "en")) -> Findings:
    """A conflict result over *order* (the store's source order), zh/en at -0.88, the rest near -0."""
    cos = {frozenset(pair): -0.88}
    m = np.array([[1.0 if a == b else cos.get(frozenset((a, b)), -0.0004) for b in order] for a in order])
    t = "model.layers.0.mlp.down_proj.weight"
    series = {"cosine_matrix": m[None], "cosine_matrix_units": un.encode_json([[t, None]]),
              "source_names": un.encode_names(order)}
    flag = Flag("conflict", t, None, pair, 0.9, (0, 9), {"cosine": -0.88}, "zh and en point opposite ways.")
    res = AnalysisResult(pd.DataFrame({"tensor": [t], "head": [None]}), series)
    return Findings("dump.zarr", 10, "training", order, {}, {"conflict": res}, [flag])


def test_conflict_matrix_fills_its_panel_without_minus_zero():
    from gradforensics.analysis import REGISTRY

    f = _conflict_findings(("zh", "en", "code"))
    fig = figures.new_figure(*figures.EVIDENCE_SIZE)
    ax = fig.add_subplot()
    REGISTRY["conflict"].plot(f.results["conflict"], f.flags[0], ax)
    figures.to_png(fig)
    box = ax.get_window_extent(fig.canvas.get_renderer())
    assert box.width > 0.7 * fig.bbox.width, (box.width, fig.bbox.width)      # not a square lost in margin
    texts = [t.get_text() for t in ax.texts]
    assert "-0.88" in texts and "0.00" in texts and "-0.00" not in texts, texts


def test_compare_panels_show_the_sources_in_one_order():
    from gradforensics.reporting.compare_render import side_by_side
    from gradforensics.reporting.comparison import compare_findings

    before = _conflict_findings(("zh", "en", "code"))
    after = _conflict_findings(("code", "en", "zh"), pair=("en", "zh"))
    after = dataclasses.replace(after, flags=[dataclasses.replace(after.flags[0], severity=1.0)])
    c = compare_findings(before, after)
    fig = side_by_side(c.rows[0], before, after, ("before", "after"))
    left, right = fig.axes[:2]
    ticks = [[t.get_text() for t in ax.get_xticklabels()] for ax in (left, right)]
    assert ticks[0] == ticks[1] == ["en", "zh", "code"], ticks
    rows = [[t.get_text() for t in ax.get_yticklabels()] for ax in (left, right)]
    assert rows[0] == rows[1] == ["en", "zh", "code"], rows


def test_overview_colour_bar_is_as_tall_as_the_map():
    base = data.findings()
    tall = dataclasses.replace(base, results={**{f"a{i}": base.results["tnoise"] for i in range(16)}, **base.results})
    for f in (base, tall):                  # a short map (2 rows) and a tall one (18 rows)
        fig = figures.overview(f)
        figures.to_png(fig)
        r = fig.canvas.get_renderer()
        ax = fig.axes[0]
        (cax,) = ax.child_axes
        a, b = ax.get_window_extent(r), cax.get_window_extent(r)
        assert abs(a.y0 - b.y0) < 1 and abs(a.y1 - b.y1) < 1, (a, b)
        assert 12 <= b.width <= 30 and b.x0 >= a.x1                 # a bar, not a hairline, beside the map
        assert fig.get_tightbbox(r).x1 <= fig.get_size_inches()[0] + 1e-6   # its label is inside the figure


def test_records_map_legend_is_off_the_points():
    from gradforensics.reporting.recordsmap import RecordsMap, figure

    rng = np.random.default_rng(0)
    centres = {"zh": (-0.7, -0.2), "en": (0.7, -0.2), "code": (0.75, 0.45)}     # a cloud in the upper right
    src = [s for s in centres for _ in range(12)]
    xy = np.array([centres[s] for s in src]) + 0.03 * rng.standard_normal((len(src), 2))
    m = RecordsMap("lm_head.weight", None, "conflict", xy, np.arange(len(src)), src,
                   np.arange(len(src), dtype=float), "record", 0.5, len(src))
    fig = figure(m)
    figures.to_png(fig)
    r = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(r)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(r)), "the legend covers a panel"
    assert {t.get_text() for t in legend.get_texts()} == {"zh (12)", "en (12)", "code (12)"}


def test_a_badge_below_a_quarter_is_not_styled_as_a_note():
    from gradforensics.reporting.html import CSS

    # the information box is a div; a bare ".info{" rule also styled <span class="sev info">
    assert not re.search(r"(^|[}\s,])\.info\s*\{", CSS), "a bare .info rule styles the low-severity badge"
    assert "div.info{" in CSS and ".sev.info{" in CSS
