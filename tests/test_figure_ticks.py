"""Log-scale figures carry readable tick labels: plain text, never raw mathtext (issue 27)."""

from __future__ import annotations

import matplotlib as mpl
import numpy as np
import pytest

import gradforensics as gf
from gradforensics.reporting import figures
from gradforensics.testing.planted import noise_store


def _labels(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for axis in (ax.xaxis, ax.yaxis) if axis.get_scale() == "log"
            for t in [*axis.get_majorticklabels(), *axis.get_minorticklabels()]]


def test_log_ticks_are_plain_text_with_math_parsing_off():
    with mpl.rc_context({"text.parse_math": False}):
        fig = figures.new_figure(4, 3)
        ax = fig.add_subplot()
        x = np.logspace(-4, 1, 50)
        ax.loglog(x, x ** -1.5)
        figures.to_png(fig)
        labels = [t for t in _labels(fig) if t]
    assert labels, "no tick label drawn on the log axes"
    assert not [t for t in labels if "$" in t or "mathdefault" in t], labels
    assert {"1e\u221203", "1", "10"} <= set(labels), labels       # 1e−03 (a typographic minus), 1, 10


@pytest.mark.slow
def test_every_log_axis_of_a_report_is_readable(tmp_path, monkeypatch):
    """The report's own figures (the noise evidence has a log axis) are checked as drawn."""
    seen: list[list[str]] = []
    original = figures.to_png

    def checking(fig):
        png = original(fig)
        seen.append(_labels(fig))
        return png

    monkeypatch.setattr(figures, "to_png", checking)
    store = noise_store(tmp_path / "noise.zarr")
    findings = gf.analyze(store.path, only="noise", progress=False)
    gf.report(findings, tmp_path / "report")
    logs = [x for labels in seen for x in labels if x]
    assert logs, "the report drew no log axis (the noise figure should have one)"
    bad = [x for x in logs if "$" in x or "mathdefault" in x]
    assert not bad, f"raw mathtext tick labels: {bad[:5]}"
