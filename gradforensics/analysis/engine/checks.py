"""Checks of option values, for an options class's ``__post_init__``.

One message format for every analysis, in the style of scikit-learn's parameter
validation: *"The 'window' option of drift must be an int >= 2; got 1."*
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gradforensics.errors import SpecError

__all__ = ["check_int"]


def check_int(name: str, key: str, value: Any, lo: int, allow_none: bool = False) -> None:
    """*value* of option *key* of analysis *name* is an int >= *lo* (or None, with *allow_none*).

    Raises
    ------
    SpecError
        It is not; the message names the option, the analysis, what is allowed and what was given.
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise SpecError(f"The '{key}' option of {name} must be an int >= {lo}; got {value!r}.")
