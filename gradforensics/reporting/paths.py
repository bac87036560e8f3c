"""Every file the report writes goes through :func:`under`: built from checked names, inside ``--out``.

Names from a store (analysis names become ``tables/<name>.csv``) are data, never
paths (design, "Store safety").  Analysis names are checked where they are read
(:func:`gradforensics.analysis.engine.results.read_findings`); :func:`under` is the
last line: each part must be one plain file name, and the resolved path - after
symbolic links - must still lie inside the output directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from gradforensics.errors import UnsafeNameError
from gradforensics.store.names import name_problem

__all__ = ["under"]


def under(out_dir: str | os.PathLike[str], *parts: str) -> Path:
    """``out_dir/part/...``, refused unless it stays inside *out_dir*.

    Parameters
    ----------
    out_dir
        The directory the report owns (``--out``).
    *parts
        Path components, each one file or directory name (``"tables"``,
        ``"noise.csv"``): no ``/``, ``\\``, ``.``/``..`` or control character.

    Returns
    -------
    Path
        ``Path(out_dir, *parts)`` (not resolved, as the caller spelled it).

    Raises
    ------
    UnsafeNameError
        A part is not a plain name, or the path resolves outside *out_dir*
        (e.g. through a symbolic link inside it).
    """
    for part in parts:
        problem = name_problem(part)
        if problem is not None:
            raise UnsafeNameError(f"report: file name {part!r} {problem}; refused as a path under {os.fspath(out_dir)}.")
    path = Path(out_dir, *parts)
    base = Path(out_dir).resolve()
    if not path.resolve().is_relative_to(base):
        raise UnsafeNameError(f"report: {path} resolves to {path.resolve()}, outside {base}; "
                              "refusing to write through a link that leaves the output directory.")
    return path
