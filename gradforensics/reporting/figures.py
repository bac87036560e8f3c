"""The report's figures, on explicit matplotlib ``Figure``/``Axes`` (no pyplot state).

* :func:`overview` - the at-a-glance map: analysis x layer depth (x head where
  heads were split), coloured by the highest flag severity in the cell; grey
  where that analysis has no row for that layer, and across an analysis that had nothing
  to read (an empty table) or could not judge the store (``Findings.not_judged``), its
  row name saying which.
* :func:`evidence` - the evidence of one finding, drawn by the analysis that
  produced it (``REGISTRY[name].plot(result, flag, ax)``).  A plot that raises
  or draws nothing yields a figure that says so, never a blank panel, and a
  ``RuntimeWarning`` naming the analysis.
"""

from __future__ import annotations

import io
import math
import textwrap
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics._text import terminal, visible
from gradforensics.errors import PlotBugWarning
from gradforensics.reporting import names
from gradforensics.store.names import layer_of

if TYPE_CHECKING:
    from collections.abc import Collection

    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from gradforensics.analysis.contract.model import Findings, Flag
    from gradforensics.reporting.summary import FlagGroup

__all__ = ["COLORBAR_INCHES", "DPI", "EVIDENCE_SIZE", "MAX_HEAD_COLUMNS", "MAX_LAYER_SPAN", "MAX_SEPARATORS", "MAX_TICK_LABELS", "OTHER", "Overview",
           "analysis_name", "discard", "evidence", "flag_analyses", "new_figure", "overview", "overview_data", "plain_log_ticks", "thin_ticks",
           "to_png"]


DPI = 110
#: Width and height (inches) of an evidence figure.
EVIDENCE_SIZE = (7.2, 3.6)
OTHER = "other"
#: The overview draws every layer between the first and the last up to this span, only the present ones beyond.
MAX_LAYER_SPAN = 1024
#: More heads than this (a damaged or hostile store) fold into one column per layer.
MAX_HEAD_COLUMNS = 256
#: Width of the overview's colour bar (inches); it spans the map's full height.
COLORBAR_INCHES = 0.18
#: Column separators are drawn up to this many layer columns.
MAX_SEPARATORS = 200
#: An evidence figure labels at most this many ticks per axis (every k-th beyond): a plot with a
#: label per tensor of a 2,000-tensor model cost 20 s to render, unreadable at any size.
MAX_TICK_LABELS = 64


def discard(fig: Figure) -> None:
    """Empty *fig* for its next drawing: ``fig.clear()`` without first resetting each axes it throws away.

    ``Figure.clear`` clears every axes (new ticks, labels, limits: about 10 ms each) and
    then removes it; removed first, the axes are simply dropped, and ``clear`` resets the
    rest of the figure as before.  What is drawn next starts from the same empty figure.
    """
    for ax in list(fig.axes):
        fig.delaxes(ax)
    fig.clear()


def new_figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def plain_log_ticks(fig: Figure) -> None:
    """Label every log-scaled axis of *fig* in plain text (``0.1``, ``1e-05``), not mathtext.

    The report draws with ``text.parse_math`` off, so that a name from a store is never
    parsed as math; matplotlib's default log formatter writes its labels as mathtext
    (``$\\mathdefault{10^{-1}}$``), which would then print raw.  :class:`~matplotlib.ticker.LogFormatter`
    labels the same ticks (same rules for minor ticks) as plain strings.
    """
    from matplotlib.ticker import LogFormatter

    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":
                axis.set_major_formatter(LogFormatter())
                axis.set_minor_formatter(LogFormatter(labelOnlyBase=False))


def to_png(fig: Figure) -> bytes:
    """PNG bytes of *fig* (Agg canvas; no display needed), log axes labelled in plain text.

    Printed by the figure's own Agg canvas (made here once per figure and kept): the layout
    runs in the one draw that renders, where ``savefig`` drew the figure twice (once without
    rendering, for the layout) - the same pixels and PNG bytes (``tests/test_report_cost.py``)
    at about two thirds of the drawing.  A reused figure keeps its canvas and renderer, so
    matplotlib's text-size cache carries over between the report's figures.
    """
    import matplotlib as mpl
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    plain_log_ticks(fig)
    buf = io.BytesIO()
    if fig.dpi != DPI or not _plain_savefig(mpl.rcParams):
        fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})    # what savefig's settings change
        return buf.getvalue()
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    setattr(canvas, "_is_saving", True)      # as savefig: animated artists are drawn too  # noqa: B010
    try:
        canvas.print_png(buf, metadata={"Software": None})
    finally:
        setattr(canvas, "_is_saving", False)  # noqa: B010
    return buf.getvalue()


def _plain_savefig(rc: Any) -> bool:
    """Whether the ``savefig.*`` settings *rc* leave the figure as its canvas prints it (else savefig is used)."""
    return bool(rc["savefig.facecolor"] == "auto" and rc["savefig.edgecolor"] == "auto"
                and rc["savefig.transparent"] is False and rc["savefig.bbox"] is None
                and rc["savefig.orientation"] == "portrait")


def analysis_name(flag: Flag, findings: Findings) -> str:
    """Which analysis produced *flag*: ``evidence["analysis"]`` if given, else the
    registered analysis that emits its kind, else the kind itself."""
    from gradforensics.analysis.contract.registry import emitter_of

    name = flag.evidence.get("analysis")
    if isinstance(name, str) and name in findings.results:
        return name
    emitter = emitter_of(flag.kind)
    if emitter is not None and emitter.name in findings.results:
        return emitter.name
    return flag.kind


# ----------------------------------------------------------------- overview
@dataclass
class Overview:
    rows: list[str]                     # analysis names
    layers: list[int | str]             # layer indices, then OTHER if needed
    heads: int                          # sub-columns per layer (1 when no head split)
    matrix: np.ndarray                  # (rows, len(layers) * heads); NaN = not analysed
    #: rows the analysis could not speak for, by name: "nothing to read" (its table is empty: the store holds
    #: none of what it reads) or "not judged" (``Findings.not_judged``: too little of it); grey where unflagged
    status: dict[str, str] = field(default_factory=dict)
    #: what a block's sub-columns are: "heads", "experts" (mixture-of-experts units) or "heads or experts"
    word: str = "heads"

    def label(self, row: str) -> str:
        """The row's name on the map, with its status when it has one (``curvature: nothing to read``)."""
        return f"{row}: {self.status[row]}" if row in self.status else row


def flag_analyses(findings: Findings) -> list[str]:
    """:func:`analysis_name` of every flag of *findings*, in order (each kind looked up once)."""
    by_kind: dict[str, str] = {}
    out = []
    for f in findings.flags:
        name = f.evidence.get("analysis")
        if not (isinstance(name, str) and name in findings.results):
            name = by_kind.get(f.kind)
            if name is None:
                name = by_kind[f.kind] = analysis_name(f, findings)
        out.append(name)
    return out


def _columns(idx: list[int | None], heads: list[int | None], head_flags: bool) -> tuple[list[int | str], int]:
    """The overview's layer columns (a contiguous range when short enough, :data:`OTHER` last) and heads per layer."""
    known = sorted({i for i in idx if i is not None})
    layers: list[int | str] = list(known)
    if known and known[-1] - known[0] < MAX_LAYER_SPAN:
        layers = list(range(known[0], known[-1] + 1))
    if any(i is None for i in idx):
        layers.append(OTHER)
    hs = [h for h in heads if h is not None]
    n_heads = max(hs) + 1 if hs else 1
    # no flag names a head: the head columns would all be equal; no model has this many heads: one column per layer
    if not head_flags or n_heads > MAX_HEAD_COLUMNS:
        n_heads = 1
    return layers, n_heads


def overview_data(findings: Findings, experts: Collection[str] | None = None) -> Overview:
    """The matrix behind :func:`overview` (tested directly); *experts*: the mixture-of-experts units (default: the
    flagged ones, :func:`~gradforensics.reporting.names.experts_units`), whose sub-columns are experts."""
    from gradforensics.analysis import REGISTRY

    flag_rows = flag_analyses(findings)
    rows = [n for n in REGISTRY if n in findings.results] + [n for n in findings.results if n not in REGISTRY]
    for n in dict.fromkeys(flag_rows):
        if n not in rows:
            rows.append(n)
    rows_of_table = {n: names.table_units(findings.table(n)) for n in rows}
    all_names = [t for r in rows_of_table.values() for t, _ in r] + [f.tensor for f in findings.flags]
    all_heads = [h for r in rows_of_table.values() for _, h in r] + [f.head for f in findings.flags]
    layer_at = {t: layer_of(t) for t in dict.fromkeys(all_names)}      # each name parsed once
    layers, n_heads = _columns([layer_at[t] for t in all_names], all_heads,
                               any(f.head is not None for f in findings.flags))
    col = {lay: j for j, lay in enumerate(layers)}
    m = np.full((len(rows), max(len(layers), 1) * n_heads), np.nan)

    def cols(name: str, head: int | None) -> tuple[int, int]:
        lay = layer_at[name]
        j = col[OTHER if lay is None else lay]
        if head is None or n_heads == 1:
            return j * n_heads, (j + 1) * n_heads
        return j * n_heads + head, j * n_heads + head + 1

    status = _row_status(findings, rows)
    for r, n in enumerate(rows):
        if n in status:                      # nothing to read, or not judged: grey unless a flag says otherwise
            continue
        entries = rows_of_table[n]
        if not entries:                      # no per-tensor table: analysed everywhere
            m[r, :] = 0.0
        for t, _ in entries:
            a, b = cols(t, None)
            m[r, a:b] = 0.0
    row_of = {n: r for r, n in enumerate(rows)}
    cells_r: list[int] = []
    cells_c: list[int] = []
    sev: list[float] = []
    for f, n in zip(findings.flags, flag_rows):       # each cell: its highest severity (NaN: none yet)
        a, b = cols(f.tensor, f.head)
        cells_r += [row_of[n]] * (b - a)
        cells_c += range(a, b)
        sev += [f.severity] * (b - a)
    if sev:
        np.fmax.at(m, (np.asarray(cells_r, dtype=np.intp), np.asarray(cells_c, dtype=np.intp)), np.asarray(sev))
    ex = names.experts_units(findings.flags) if experts is None else experts
    word = names.split_word([(f.tensor, f.head) for f in findings.flags], ex)
    return Overview(rows, layers, n_heads, m, status, word)


def _row_status(findings: Findings, rows: list[str]) -> dict[str, str]:
    """``{analysis: "nothing to read" | "not judged"}`` for the overview's rows that cannot read as all-clear."""
    from gradforensics.analysis import REGISTRY

    out: dict[str, str] = {}
    for n in rows:
        table = findings.table(n)
        if table is not None and not len(table):
            out[n] = "nothing to read"
    for nj in findings.not_judged:
        owner = next((a.name for a in REGISTRY.values() if nj.kind in a.kinds), nj.kind)
        if owner in rows:
            out[owner] = "not judged"
    return out


def overview(findings: Findings, ov: Overview | None = None) -> Figure:
    """Analysis x layer depth (x head), coloured by the highest flag severity (*ov*: its matrix, if made already)."""
    import matplotlib as mpl

    from gradforensics._contrast import annotate

    ov = overview_data(findings) if ov is None else ov
    n_cols = max(len(ov.layers), 1)
    per_layer = 0.42 if ov.heads == 1 else min(0.12 * ov.heads, 0.9)     # room for head sub-columns
    width = min(13.0, max(6.5, 3.2 + per_layer * n_cols))
    fig = new_figure(width, 1.7 + 0.3 * max(len(ov.rows), 1))
    ax = fig.add_subplot()
    cmap = mpl.colormaps["YlOrRd"].with_extremes(bad="#d9d9d9")
    im = ax.imshow(np.ma.masked_invalid(ov.matrix), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto",
                   interpolation="nearest")
    h = ov.heads
    ax.set_yticks(range(len(ov.rows)), [ov.label(r) for r in ov.rows])
    step = max(1, math.ceil(n_cols / 32))
    ax.set_xticks([j * h + (h - 1) / 2 for j in range(0, n_cols, step)],
                  [str(x) for x in ov.layers[::step]] if ov.layers else [])
    for j in range(1, n_cols if n_cols <= MAX_SEPARATORS else 0):
        ax.axvline(j * h - 0.5, color="white", lw=1.5 if h > 1 else 0.6)
    for r in range(1, len(ov.rows)):
        ax.axhline(r - 0.5, color="white", lw=0.6)
    if n_cols <= 40:                         # the highest severity of each block at or above 0.5
        blocks = np.full((len(ov.rows), n_cols), np.nan)
        for r in range(len(ov.rows)):
            for j in range(n_cols):
                block = ov.matrix[r, j * h:(j + 1) * h]
                if np.any(block >= 0.5):
                    blocks[r, j] = np.nanmax(block)
        annotate(ax, blocks, cmap, 0.0, 1.0, where=lambda r, j: (j * h + (h - 1) / 2, r))
    xl = "layer depth (block index)"
    if h > 1:
        xl += f"\neach block split into {ov.word} 0–{h - 1}"
    if OTHER in ov.layers:
        xl += f"{'; ' if h > 1 else chr(10)}'{OTHER}' = outside the layer stack"
    ax.set_xlabel(xl)
    ax.set_ylabel("analysis")
    ax.set_title("Where it hurts: highest flag severity per layer and analysis\n(≥ 0.5: act; grey: not analysed, "
                 "nothing to read or not judged)", fontsize=10)
    # the bar is an inset of the map, so it spans exactly the map's height: a layout colour bar keeps a
    # 20:1 box, shorter than a tall map (hung beside its lower half) or a hairline beside a short one
    cax = ax.inset_axes((1.01, 0.0, COLORBAR_INCHES / (0.8 * width), 1.0))
    cb = fig.colorbar(im, cax=cax)
    cb.set_label("max severity [0–1]")
    return fig


# ----------------------------------------------------------------- evidence
def _note(ax: Axes, text: str) -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, "\n".join(textwrap.wrap(text, 90)), ha="center", va="center", fontsize=9,
            color="#8a1c1c", transform=ax.transAxes,
            bbox={"boxstyle": "round", "facecolor": "#fdecea", "edgecolor": "#8a1c1c"})


def _drew_something(fig: Figure) -> bool:
    return any(a.has_data() or a.images or a.texts or a.tables for a in fig.axes)


def evidence(findings: Findings, finding: FlagGroup, fig: Figure | None = None) -> tuple[Figure, str | None]:
    """The evidence figure of *finding* (its most severe flag) and a note if the plot failed.

    Drawn on *fig* when given (cleared and sized first: the report reuses one figure, and so
    its canvas, for every finding), else on a new figure.
    """
    from gradforensics.analysis import REGISTRY

    flag = finding.top
    name = analysis_name(flag, findings)
    if fig is None:
        fig = new_figure(*EVIDENCE_SIZE)
    else:
        discard(fig)
        fig.set_size_inches(*EVIDENCE_SIZE)
    ax = fig.add_subplot()
    an, res = REGISTRY.get(name), findings.results.get(name)
    note: str | None = None
    if an is None:
        note = f"No evidence figure: no analysis named {name!r} is registered in this gradforensics."
    elif res is None:
        note = f"No evidence figure: the findings hold no result of the {name!r} analysis."
    else:
        try:
            an.plot(res, flag, ax)
        except Exception as exc:  # a plot bug must not sink the report
            note = (f"The evidence figure could not be drawn: gradforensics.analysis.{name} plot() raised "
                    f"{type(exc).__name__}: {exc}. This is a bug; please report it.")
        else:
            if not _drew_something(fig):
                note = f"The evidence figure is empty: gradforensics.analysis.{name} plot() drew nothing. This is a bug."
    if note is not None:
        warnings.warn(terminal(f"report: {flag.kind} on {flag.tensor}: {note}"), PlotBugWarning, stacklevel=2)
        discard(fig)
        fig.set_size_inches(7.2, 1.1)
        _note(fig.add_subplot(), note)
    else:
        for a in fig.axes:
            thin_ticks(a)
        if not ax.get_title():
            word = "expert" if "expert" in flag.evidence else "head"
            head = "" if flag.head is None else f", {word} {flag.head}"
            ax.set_title(visible(f"{finding.title}: {flag.tensor}{head}"), fontsize=10)
    return fig, note


def thin_ticks(ax: Axes, limit: int = MAX_TICK_LABELS) -> None:
    """Keep every k-th fixed tick (and its label) of an axis that has more than *limit*.

    Labels keep their text, rotation and size; the data drawn are untouched.
    """
    from matplotlib.ticker import FixedFormatter, FixedLocator

    for axis in (ax.xaxis, ax.yaxis):
        loc = axis.get_major_locator()
        if not isinstance(loc, FixedLocator):
            continue
        locs = list(loc.tick_values(0, 0))           # a FixedLocator returns its own locations
        if len(locs) <= limit:
            continue
        fmt = axis.get_major_formatter()
        texts = list(fmt.seq) if isinstance(fmt, FixedFormatter) and len(fmt.seq) == len(locs) else None
        first = axis.majorTicks[0].label1          # one tick, not thousands: its label's style
        step = math.ceil(len(locs) / limit)
        if texts is None:
            axis.set_ticks(locs[::step])
        else:
            axis.set_ticks(locs[::step], texts[::step], rotation=first.get_rotation(), fontsize=first.get_fontsize())
