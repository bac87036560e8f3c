"""report.html in a real headless browser (Debian's chromium): it loads without script errors,
every embedded figure decodes, the summary and the layer table are in the DOM, and sorting works."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import _report_data as data
import pytest

from gradforensics.errors import PlotBugWarning
from gradforensics.reporting import report

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install -y chromium)")

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
         "--virtual-time-budget=5000"]


def chromium(tmp_path: Path, *args: str) -> str:
    """Run headless chromium with a throwaway profile; its stdout."""
    profile = tmp_path / "profile"
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture
def html_report(tmp_path, monkeypatch) -> Path:
    data.install(monkeypatch)
    with pytest.warns(PlotBugWarning):
        return report(data.findings(), tmp_path / "out")["html"]


def test_report_loads_figures_decode_summary_and_table_present(tmp_path, html_report):
    dom = chromium(tmp_path, "--dump-dom", html_report.as_uri())
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert 'data-js-errors="0"' in body, body
    assert 'data-figures="4/4"' in body, body                  # overview + 3 findings, all decoded
    items = re.findall(r"<li>.*?</li>", dom[dom.index('id="summary-list"'):], flags=re.S)
    assert "model.layers.5–6 q_proj/k_proj, heads 2 and 5: zh and en gradients point opposite ways" in items[0]
    table = dom[dom.index('id="layer-table"'):]
    table = table[:table.index("</table>")]
    n_units = data.N_LAYERS * (4 * (data.HEADS + 1) + 1) + 1      # heads + whole tensors + MLPs + the loss
    assert table.count("<tr>") == n_units + 1 and "model.layers.7.self_attn.o_proj.weight" in table


def test_layer_table_sorts_in_the_browser(tmp_path, html_report):
    html = html_report.read_text()
    cols = re.findall(r"<th>(.*?)</th>", html[html.index('id="layer-table"'):])
    col = cols.index("max") + 1
    click = (f"<script>window.addEventListener('load',function(){{var th=document.querySelector("
             f"'#layer-table th:nth-child({col})');gfSort(th);gfSort(th);}});</script></body>")
    harness = tmp_path / "harness.html"
    harness.write_text(html.replace("</body>", click))
    dom = chromium(tmp_path, "--dump-dom", harness.as_uri())
    table = dom[dom.index('id="layer-table"'):]
    first = re.search(r"<tbody><tr>(.*?)</tr>", table, flags=re.S).group(1)
    assert 'data-v="0.9100"' in first                            # descending: the 0.91 conflict comes first
    assert 'data-dir="desc"' in table[:table.index("</thead>")]


def test_screenshot_is_not_blank(tmp_path, html_report):
    from matplotlib.image import imread

    shot = tmp_path / "shot.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,2000", html_report.as_uri())
    img = imread(shot)
    assert img.shape[:2] == (2000, 1280)
    assert img[..., :3].std() > 0.05                             # text, figures and colour, not an empty page


@pytest.mark.slow
def test_records_map_decodes_in_the_browser(tmp_path):
    import gradforensics as gf
    from gradforensics.testing.planted_directions import planted_conflict

    planted_conflict(2, n=36).write(tmp_path / "s.zarr")
    findings = gf.analyze(tmp_path / "s.zarr", progress=False, only=["conflict"])
    html = report(findings, tmp_path / "out", store=str(tmp_path / "s.zarr"))["html"]
    dom = chromium(tmp_path, "--dump-dom", html.as_uri())
    body = re.search(r"<body[^>]*>", dom).group(0)
    n_img = len(re.findall(r"<img ", dom))
    assert 'data-js-errors="0"' in body and f'data-figures="{n_img}/{n_img}"' in body, body
    assert re.search(r'<div id="records-map"><figure><img id="fig-records-map-01-conflict"', dom)


def test_layer_table_does_not_scroll_sideways_at_1400_px(tmp_path, monkeypatch):
    """Every registered analysis a column, the longest tensor names: the table fits the page (issue 27)."""
    from gradforensics.analysis import REGISTRY
    from gradforensics.analysis.contract.model import Findings

    data.install(monkeypatch)
    base = data.findings()
    wide = Findings(base.store, base.n_records, base.mode, base.sources, base.header,
                    {**base.results, **{n: base.results["tnoise"] for n in REGISTRY}}, base.flags)
    with pytest.warns(PlotBugWarning):
        html = report(wide, tmp_path / "out")["html"].read_text()
    measure = ("<script>window.addEventListener('load',function(){var w=document.querySelector("
               "'#layer-table').parentNode;document.body.setAttribute('data-overflow',"
               "String(w.scrollWidth-w.clientWidth));document.body.setAttribute('data-cols',"
               "String(document.querySelectorAll('#layer-table th').length));});</script></body>")
    harness = tmp_path / "wide.html"
    harness.write_text(html.replace("</body>", measure))
    dom = chromium(tmp_path, "--dump-dom", "--window-size=1400,1000", harness.as_uri())
    body = re.search(r"<body[^>]*>", dom).group(0)
    cols = int(re.search(r'data-cols="(\d+)"', body).group(1))
    assert cols >= len(REGISTRY) + 5, body                       # layer, tensor, head, analyses, max, flags
    assert re.search(r'data-overflow="0"', body), body
