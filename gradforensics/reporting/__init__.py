"""The report a training team reads: ``report.html``, ``report.md``, ``flags.json``, ``tables/``.

``report(findings, out_dir)`` renders :class:`~gradforensics.analysis.contract.model.Findings`
(from ``gf.analyze``, or read back from a store by
:func:`~gradforensics.analysis.engine.results.read_findings`); it never reads gradients.

* ``report.html`` - one self-contained file: header, summary in sentences, the
  at-a-glance map, a section per finding with its evidence figure and what to
  try next, the sortable layer-by-layer table, the analysis tables;
* ``report.md`` - the same in Markdown, figures as PNG files in ``figures/``;
* ``flags.json`` - exactly ``findings.flags_json()``, validated against
  :data:`~gradforensics.reporting.flagsjson.FLAGS_SCHEMA`;
* ``tables/<name>.csv`` - one per analysis result table, ``tensor``, ``head`` first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from gradforensics.reporting.bands import SEVERITY_NAMES
from gradforensics.reporting.severity import exit_code, parse_severity

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Findings
    from gradforensics.store.location import Location
    from gradforensics.store.reader import Store

__all__ = ["SEVERITY_NAMES", "exit_code", "parse_severity", "report"]


def report(findings: Findings, out_dir: str | os.PathLike[str], store: Store | Location | str | None = None) -> dict[str, Path]:
    """Write the report of *findings* into *out_dir* (created if needed).

    Parameters
    ----------
    findings
        What a forensic pass found.
    out_dir
        Directory for ``report.html``, ``report.md``, ``figures/``, ``flags.json``, ``tables/``.
    store
        Optional store (or its path) for header details the findings lack
        (model, source shares).  Gradients are never read.

    Returns
    -------
    dict
        Written paths: ``"html"``, ``"markdown"``, ``"flags"``, ``"tables/<name>"``
        and ``"figures/<stem>"``.

    Raises
    ------
    UnsafeNameError
        An analysis name is not a lower-case identifier (checked before anything
        is written), or a path would leave *out_dir*, e.g. through a symbolic link
        (:func:`gradforensics.reporting.paths.under`).
    WriteRefusedError
        The disk is full, read-only or refuses the write (one line naming the path).

    Notes
    -----
    Names in *findings* may come from someone else's store: every file name is
    built from checked names and stays under *out_dir*; ``report.md`` escapes
    names for Markdown (:mod:`gradforensics._text`), ``report.html`` for HTML,
    and CSV cells that a spreadsheet would evaluate are neutralised.
    """
    from gradforensics.store.names import check_analysis_name

    for name in findings.results:          # names become tables/<name>.csv: refuse before writing anything
        check_analysis_name(name, "report")
    from gradforensics.store.location import Location

    if isinstance(store, (str, os.PathLike, Location)):
        from gradforensics.store.reader import Store as _Store

        store = _Store(store, check_chunks=False)
    out = Path(out_dir)
    try:
        return _write(findings, store, out)
    except OSError as exc:
        from gradforensics.errors import GradforensicsError, WriteRefusedError, refusal

        why = refusal(exc)
        if why is None or isinstance(exc, GradforensicsError):
            raise
        raise WriteRefusedError(f"{exc.filename or out}: the report could not be written ({why}).") from exc


def _write(findings: Findings, store: Store | None, out: Path) -> dict[str, Path]:
    from gradforensics.reporting import document, flagsjson, html, markdown, tables
    from gradforensics.reporting.paths import under

    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {"flags": flagsjson.write(findings, under(out, "flags.json"))}
    ordered = {n: tables.contract_order(r.table) for n, r in findings.results.items()}   # once, for CSVs and HTML
    paths.update(tables.write_csvs(findings, out, ordered))
    doc = document.build(findings, store, ordered)
    figdir = under(out, "figures")
    figdir.mkdir(exist_ok=True)
    for old in [*figdir.glob("finding-*.png"), *figdir.glob("records-map-*.png"), figdir / "overview.png"]:   # stale figures of an earlier render
        old.unlink(missing_ok=True)
    for pic in doc.pictures:
        p = under(out, "figures", f"{pic.stem}.png")
        p.write_bytes(pic.png)
        paths[f"figures/{pic.stem}"] = p
    paths["html"] = under(out, "report.html")
    paths["html"].write_text(html.render(doc), encoding="utf-8")
    paths["markdown"] = under(out, "report.md")
    paths["markdown"].write_text(markdown.render(doc, "figures"), encoding="utf-8")
    return paths
