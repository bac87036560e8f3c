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
    table = table[:table.index("</table>")].replace("<wbr>", "")       # names may break after their dots
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


#: Runs after load at the window's width: how far the page, and each figure and table box, runs past its
#: room, as attributes of <body> (a DOM dump shows them).  A table or figure may be wider than the screen
#: only inside a box that scrolls sideways (``overflow-x: auto``) and itself fits.
MEASURE = """<script>window.addEventListener('load',function(){
 var b=document.body,root=document.documentElement,vw=root.clientWidth,bad=[];
 function scrolls(e){var o=getComputedStyle(e).overflowX;return o==='auto'||o==='scroll';}
 function boxOf(e){for(var p=e.parentElement;p;p=p.parentElement){if(scrolls(p))return p;}return null;}
 document.querySelectorAll('figure,table,img,pre').forEach(function(e){
   var box=boxOf(e),r=(box||e).getBoundingClientRect();
   if(r.right>vw+0.5||r.left<-0.5)bad.push(e.tagName+(e.id?'#'+e.id:'')+':'+Math.round(r.right));});
 var says=document.querySelectorAll('td.says'),hidden=0;
 says.forEach(function(td){var r=td.getBoundingClientRect();if(r.width<150||r.right>vw+0.5)hidden++;});
 var imgs=document.querySelectorAll('figure img'),small=0;
 imgs.forEach(function(im){if(im.getBoundingClientRect().width<im.naturalWidth-1)small++;});
 var info=document.querySelector('.sev.info');
 b.setAttribute('data-page-overflow',String(root.scrollWidth-vw));
 b.setAttribute('data-overflowing',bad.join(' ')||'none');
 b.setAttribute('data-says',says.length+'/'+hidden);
 b.setAttribute('data-shrunk',imgs.length+'/'+small);
 b.setAttribute('data-info-badge',info?getComputedStyle(info).borderLeftWidth+'/'+getComputedStyle(info).display:'none');
});</script></body>"""


def _attrs(dom: str) -> dict[str, str]:
    body = re.search(r"<body[^>]*>", dom).group(0)
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body))


@pytest.fixture
def phone_report(tmp_path, monkeypatch) -> Path:
    """The test report plus a finding below 0.25 (a badge in the ``info`` band)."""
    from gradforensics.analysis.contract.model import Findings, Flag

    data.install(monkeypatch)
    base = data.findings()
    faint = Flag("noise", "model.layers.3.mlp.down_proj.weight", None, (), 0.12, (0, 95),
                 {"analysis": "tnoise", "snr": 0.8}, "SNR 0.8: a little noisy.")
    f = Findings(base.store, base.n_records, base.mode, base.sources, base.header, base.results,
                 [*base.flags, faint])
    with pytest.warns(PlotBugWarning):
        html = report(f, tmp_path / "out")["html"]
    harness = tmp_path / "measured.html"
    harness.write_text(html.read_text().replace("</body>", MEASURE))
    return harness


@pytest.mark.parametrize("width", [390, 1400])
def test_nothing_runs_off_the_page_on_a_phone_or_a_desktop(tmp_path, phone_report, width):
    """Issue 45: at 390 px every table and figure fits its box (or scrolls inside one), the page itself does
    not scroll sideways, each flag's explanation is on screen, and figures keep their drawn size on a phone."""
    dom = chromium(tmp_path, "--dump-dom", f"--window-size={width},2000", phone_report.as_uri())
    a = _attrs(dom)
    assert a["js-errors"] == "0", a
    assert a["page-overflow"] == "0" and a["overflowing"] == "none", a
    n_says, hidden = map(int, a["says"].split("/"))
    assert n_says >= 3 and hidden == 0, a                      # "what the analysis says" readable, not cut off
    n_imgs, shrunk = map(int, a["shrunk"].split("/"))
    if width == 390:
        assert n_imgs >= 4 and shrunk == 0, a                  # full size, scrolled sideways: text stays legible
    assert a["info-badge"] == "0px/inline-block", a           # a badge below 0.25 is a badge, not a note box
    shot = tmp_path / f"report-{width}.png"                   # kept with the test's files, to look at
    chromium(tmp_path, f"--screenshot={shot}", f"--window-size={width},3000", phone_report.as_uri())
    assert shot.stat().st_size > 0


def test_tensor_names_break_only_at_dots():
    from gradforensics.reporting.html import dotted

    assert dotted("model.layers.0.self_attn.q_proj.weight") == \
        "model.<wbr>layers.<wbr>0.<wbr>self_attn.<wbr>q_proj.<wbr>weight"
    assert dotted("cos -0.96, p < 0.001") == "cos -0.96, p &lt; 0.001"     # decimal points stay whole


def test_compare_page_fits_a_phone(tmp_path, monkeypatch):
    """The compare report at 390 px: its table scrolls inside its box, its side-by-side figures keep their size."""
    import warnings

    from gradforensics.reporting.compare_render import write
    from gradforensics.reporting.comparison import compare_findings

    data.install(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlotBugWarning)            # the fake noise plot raises on purpose
        html = write(compare_findings(data.findings(), data.findings(healthy=True)), tmp_path / "cmp")["html"]
    page = html.read_text()
    assert '<meta name="viewport"' in page
    harness = tmp_path / "cmp.html"
    harness.write_text(page.replace("</body>", MEASURE))
    a = _attrs(chromium(tmp_path, "--dump-dom", "--window-size=390,2000", harness.as_uri()))
    assert a["page-overflow"] == "0" and a["overflowing"] == "none", a
    n_imgs, shrunk = map(int, a["shrunk"].split("/"))
    assert n_imgs >= 1 and shrunk == 0, a
