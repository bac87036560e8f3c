"""Numbers written on the cells of a colour matrix, in an ink that reads on each cell.

Black on a dark cell (a cosine of -0.9 in ``RdBu``, a severity of 1.0 in ``YlOrRd``)
cannot be read; :func:`ink` picks white or black from the cell colour's relative
luminance (WCAG 2), and :func:`annotate` writes every finite cell with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["annotate", "ink", "luminance", "two_places"]


def luminance(rgba: Any) -> float:
    """Relative luminance (0 black .. 1 white) of an RGB(A) colour with channels in [0, 1]."""
    c = np.asarray(rgba, dtype=np.float64)[:3]
    lin = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    return float(lin @ np.array([0.2126, 0.7152, 0.0722]))


def ink(rgba: Any) -> str:
    """``"white"`` or ``"black"``, whichever contrasts more with the colour *rgba*."""
    lum = luminance(rgba)
    return "white" if (1.05 / (lum + 0.05)) > ((lum + 0.05) / 0.05) else "black"


def two_places(v: float) -> str:
    """*v* with two decimals; a value that rounds to zero reads ``0.00``, never ``-0.00``."""
    text = f"{v:.2f}"
    return "0.00" if text == "-0.00" else text


def annotate(ax: Axes, matrix: np.ndarray, cmap: Any, vmin: float, vmax: float,
             text: Callable[[float], str] = two_places, *, keep: np.ndarray | None = None,
             where: Callable[[int, int], tuple[float, float]] | None = None, fontsize: float = 7) -> None:
    """Write ``text(v)`` on each finite cell of *matrix* (where *keep*, if given) in the ink of its colour.

    *where* maps a cell ``(i, j)`` to its ``(x, y)`` in data coordinates (default ``(j, i)``,
    as ``imshow`` draws it); *cmap*, *vmin* and *vmax* must be those the matrix is drawn with.
    """
    import matplotlib as mpl
    from matplotlib.colors import Normalize

    cm = mpl.colormaps[cmap] if isinstance(cmap, str) else cmap
    norm = Normalize(vmin=vmin, vmax=vmax, clip=True)
    for (i, j), v in np.ndenumerate(matrix):
        if not np.isfinite(v) or (keep is not None and not keep[i, j]):
            continue
        x, y = where(i, j) if where is not None else (j, i)
        ax.text(x, y, text(float(v)), ha="center", va="center", fontsize=fontsize, color=ink(cm(norm(v))))
