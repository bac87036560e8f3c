"""Names from a store, made safe for where the report and the CLI show them.

A store is data received from someone else: its tensor, module, source and
series names, and every string in its stored ``analysis/`` documents, are
whatever the sender wrote.  Each output speaks a language in which some
characters are instructions - Markdown (links, HTML, table cells), a
spreadsheet (formulas), a terminal (escape sequences) - so each gets one
function here that turns a name into inert text of that language.  HTML needs
none: :func:`html.escape` is that function.

Control characters are never dropped: :func:`visible` spells them out
(``\\x1b``, ``\\n``, ``\\u202e``), so what a name holds is shown, not hidden.
"""

from __future__ import annotations

import re
from typing import Any

from gradforensics.store.names import has_control

__all__ = ["csv_cell", "md_code", "md_text", "terminal", "visible"]

#: Characters with a meaning anywhere in a line of Markdown (GFM): escapes, code, emphasis,
#: links and images, raw HTML and autolinks, tables, headings, strikethrough, entities, math.
_MD_ALWAYS = frozenset("\\`*[]<>|#!~&$")
#: A line that starts with one of these is a list item, block quote or setext heading underline.
_MD_LINE_START = re.compile(r"( {0,3})(?:([-+=])|(\d{1,9})([.)]))")
#: Leading characters that make a spreadsheet evaluate a cell (OWASP, "CSV Injection").
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def visible(text: str) -> str:
    """*text* with every control or format character written as its Python escape.

    Parameters
    ----------
    text
        Any string, e.g. a tensor name read from a store.

    Returns
    -------
    str
        *text* unchanged when it holds no control character (the common case);
        otherwise each one (C0/C1 controls, DEL, bidi overrides, line and
        paragraph separators: :func:`gradforensics.store.names.has_control`)
        replaced by its escape as ``repr`` writes it, e.g. ``"\\x1b[31m"``.

    Notes
    -----
    Escaping rather than deleting keeps two different names different on
    screen and shows the reader that something odd was in the store.
    """
    if not has_control(text):
        return text
    return "".join(repr(ch)[1:-1] if has_control(ch) else ch for ch in text)


def terminal(text: Any) -> str:
    """*text* safe to print on a terminal: no escape sequence, no line break.

    Parameters
    ----------
    text
        A line (or a value, turned into a string) holding names from a store.

    Returns
    -------
    str
        The text with control characters made :func:`visible`.

    Notes
    -----
    A name holding ``ESC [ ... m`` or an OSC sequence would otherwise recolour,
    retitle or clear the reader's terminal, or hide the rest of a line; a
    newline or carriage return would forge output lines.  Apply it to the whole
    line just before printing.
    """
    return visible(str(text))


def md_text(text: Any) -> str:
    """*text* as literal Markdown text: it renders as itself, never as markup.

    Parameters
    ----------
    text
        A sentence, summary or name to put in running text, a list item, a
        heading or a table cell of ``report.md``.

    Returns
    -------
    str
        One line of Markdown.  Characters that start markup anywhere
        (:data:`_MD_ALWAYS`: ``\\ ` * [ ] < > | # ! ~ & $``) are backslash-escaped,
        ``_`` too unless it sits between two letters or digits (CommonMark never
        reads ``q_proj``'s underscore as emphasis, so names stay readable); a
        leading list, quote or heading-underline marker is escaped; control
        characters are made :func:`visible` (so a newline cannot end a table
        row or a list item).

    Notes
    -----
    Without it a name such as ``a[x](javascript:alert(1))`` becomes a live
    link in the rendered report, ``<script>`` raw HTML, and ``|`` a new table
    cell.  CommonMark allows a backslash before any ASCII punctuation, so the
    escaped text renders identically.
    """
    s = visible(str(text))
    out = []
    for i, ch in enumerate(s):
        intraword = 0 < i < len(s) - 1 and s[i - 1].isalnum() and s[i + 1].isalnum()
        out.append("\\" + ch if ch in _MD_ALWAYS or (ch == "_" and not intraword) else ch)
    s = "".join(out)
    m = _MD_LINE_START.match(s)
    if m is not None:                       # escape the marker itself: "\- x", "1\. x"
        cut = m.end(1) if m.group(2) else m.end(3)
        s = f"{s[:cut]}\\{s[cut:]}"
    return s


def md_code(name: Any, *, table: bool = False) -> str:
    """*name* as one Markdown inline code span that no character of it can end.

    Parameters
    ----------
    name
        A tensor, module, source or file name.
    table
        True when the span goes in a GFM table cell: ``|`` is then written
        ``\\|`` (GFM splits cells before it parses code spans, and turns ``\\|``
        back into ``|`` inside them).

    Returns
    -------
    str
        The name between backtick fences one longer than its longest run of
        backticks, padded with a space when it starts or ends with a backtick
        or a space (CommonMark strips exactly that one space); control
        characters made :func:`visible`.

    Notes
    -----
    A fixed single-backtick fence lets a name such as ``a`[x](javascript:..)`b``
    close the span early and put live markup after it.
    """
    s = visible(str(name))
    if table:
        s = s.replace("|", "\\|")
    longest = max((len(run) for run in re.findall(r"`+", s)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if s[:1] in ("`", " ") or s[-1:] in ("`", " ") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def csv_cell(value: Any) -> Any:
    """A CSV cell a spreadsheet shows as text: formula-like strings get a leading ``'``.

    Parameters
    ----------
    value
        One cell.  Only strings are changed; numbers (a negative cosine), booleans
        and missing values are returned as they are, so numeric columns stay numbers.

    Returns
    -------
    Any
        ``"'" + value`` when *value* is a string starting with ``=``, ``+``,
        ``-``, ``@``, a tab or a carriage return; otherwise *value*.

    Notes
    -----
    Excel, LibreOffice and Google Sheets evaluate such a cell as a formula
    (``=HYPERLINK(...)`` exfiltrates data, ``=cmd|...`` runs DDE); a name from a
    store must open as the text it is.  The quote is the neutralisation OWASP
    recommends ("CSV Injection"): spreadsheets hide it and show the text.

    References
    ----------
    .. [1] OWASP, "CSV Injection", https://owasp.org/www-community/attacks/CSV_Injection
    """
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value

