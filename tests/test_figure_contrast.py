"""Figures a person can read (issue 27): numbers on matrix cells in an ink that contrasts with the cell
(checked against the colour the image artist gives each cell), an overview that claims head columns only
where it draws them, compare panels titled for the cells they show, inspect's ratio explained."""

from __future__ import annotations

import dataclasses
import re

import _report_data as data
import numpy as np
import pytest

import gradforensics as gf
from gradforensics._contrast import ink, luminance, two_places
from gradforensics.reporting import figures


def _checked_texts(ax, cell_under=True) -> list[str]:
    """The ink of every number on *ax*'s image, each checked against the luminance of the colour the
    image artist gives that number (and, with *cell_under*, that the cell under it holds that number)."""
    im = ax.images[0]
    arr = np.ma.getdata(im.get_array())
    inks = []
    for t in ax.texts:
        try:
            v = float(t.get_text())
        except ValueError:
            continue
        if cell_under:
            x, y = t.get_position()
            assert two_places(arr[round(y), round(x)]) == t.get_text()
        rgba = im.to_rgba(np.float64(v))
        # the oracle: white on a colour darker than the WCAG crossover (luminance ~0.18), else black
        want = "white" if luminance(rgba) < 0.179 else "black"
        assert t.get_color() == want, (t.get_text(), rgba, t.get_color())
        inks.append(want)
    return inks


def test_ink_is_the_contrasting_one():
    assert luminance((0.5, 0.5, 0.5)) == pytest.approx(0.2140, abs=1e-4)        # sRGB mid grey
    assert ink((0, 0, 0)) == "white" and ink((1, 1, 1)) == "black"
    assert ink((0.403921, 0.0, 0.121568)) == "white"                             # RdBu's darkest red
    assert ink((0.968627, 0.968627, 0.968627)) == "black"                        # RdBu's middle


@pytest.fixture(scope="module")
def conflict_findings(tmp_path_factory):
    from gradforensics.testing.planted_directions import planted_conflict

    d = tmp_path_factory.mktemp("contrast")
    planted_conflict(seed=0, n=96).write(d / "dump.zarr")
    return gf.analyze(d / "dump.zarr", only="conflict", progress=False)


@pytest.mark.slow
def test_conflict_matrix_numbers_contrast_with_their_cells(conflict_findings):
    from gradforensics.analysis import REGISTRY

    flag = max((f for f in conflict_findings.flags if f.kind == "conflict"), key=lambda f: f.severity)
    fig = figures.new_figure(4, 4)
    ax = fig.add_subplot()
    REGISTRY["conflict"].plot(conflict_findings.results["conflict"], flag, ax)
    inks = _checked_texts(ax)
    assert "white" in inks and "black" in inks      # the diagonal (cos 1, dark blue) and a paler cell


@pytest.mark.slow
def test_overview_numbers_contrast_and_heads_are_claimed_only_when_drawn(conflict_findings):
    fig = figures.overview(conflict_findings)
    ax = fig.axes[0]
    inks = _checked_texts(ax, cell_under=False)          # a block's number is its highest head's
    assert inks and "white" in inks                          # severity 1.0: the darkest red

    sick = data.findings()                            # flags on heads 2 and 5: head columns drawn
    assert figures.overview_data(sick).heads == data.HEADS
    assert "split into heads" in figures.overview(sick).axes[0].get_xlabel()
    whole = dataclasses.replace(sick, flags=[dataclasses.replace(f, head=None) for f in sick.flags])
    assert figures.overview_data(whole).heads == 1    # the tables have heads, no flag names one
    assert "heads" not in figures.overview(whole).axes[0].get_xlabel()


@pytest.mark.slow
def test_report_caption_says_what_the_overview_draws(tmp_path, monkeypatch):
    from gradforensics.reporting import document

    data.install(monkeypatch)
    sick = data.findings()
    with pytest.warns(gf.errors.PlotBugWarning):
        alt = document.build(sick).overview.alt
    assert f"each block split into heads 0–{data.HEADS - 1}" in alt and "grey: not analysed" in alt
    whole = dataclasses.replace(sick, flags=[dataclasses.replace(f, head=None) for f in sick.flags])
    with pytest.warns(gf.errors.PlotBugWarning):
        assert "heads" not in document.build(whole).overview.alt


def test_inspect_says_what_its_ratio_is(tmp_path):
    from gradforensics.commands.inspect import summarize, summary_lines
    from gradforensics.recording import Recorder
    from gradforensics.store.reader import Store

    rng = np.random.default_rng(0)
    with Recorder(tmp_path / "s.zarr", sources=["a"], background=False, expected_records=4) as rec:
        for i in range(4):
            rec.record(step=i, source="a", grads={"w": rng.standard_normal((512, 1024)).astype(np.float32)})
    lines = summary_lines(summarize(Store(tmp_path / "s.zarr")))
    legend = next(line for line in lines if line.startswith("tensors (1):"))
    assert "bytes on disk for the bytes of data" in legend and "x: data / disk" in legend
    row = next(line for line in lines if line.strip().startswith("w "))
    assert re.search(r"\(4, 512, 1024\) float32  8\.0 MiB on disk for 8\.0 MiB, (0\.99|1\.00)x$", row), row


def test_compare_panel_without_its_own_flag_is_titled_for_the_cells_it_shows(monkeypatch):
    """A resolved row: the after run has no flag, so its panel must not carry the before flag's title."""
    from gradforensics.reporting.compare_render import side_by_side
    from gradforensics.reporting.comparison import compare_findings

    data.install(monkeypatch)
    sick, healthy = data.findings(), data.findings(healthy=True)
    c = compare_findings(sick, healthy)
    row = next(r for r in c.rows if r.status == "resolved" and r.kind == "conflict")
    fig = side_by_side(row, sick, healthy, ("before", "after"))
    left, right = (ax.get_title() for ax in fig.axes[:2])
    assert left.startswith(f"before: severity {row.before.severity:.2f}") and "zh and en pull" in left
    head = "" if row.head is None else f" head {row.head}"
    assert right.splitlines()[0] == "after: no conflict flag here"
    assert f"the same cells as the other run's flag: {row.tensor}{head}" in right.replace("\n", " ")
    assert "pull opposite ways" not in right and "severity" not in right
