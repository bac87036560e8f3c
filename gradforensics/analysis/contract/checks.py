"""Option constraints declared as data, and the one message shape of a refused value.

In the style of scikit-learn's parameter validation (``sklearn.utils._param_validation``):
an options class declares ``constraints = {"window": Interval(int, 2, None), ...}`` and
:meth:`~gradforensics.analysis.contract.options.Options.parse` (and the dataclass's
construction) checks every value against them, with one message for every analysis:
*"The 'window' option of drift must be an int >= 2; got 1."*

A constraint is an :class:`Interval` (an int, or any real number, within bounds), a
:class:`StrOptions` (one of a set of strings) or ``None`` (the value None); a list or
tuple of them accepts a value any of them accepts (``[Interval(int, 2, None), None]``:
an int >= 2, or None).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Literal, TypeAlias

from gradforensics.errors import SpecError

__all__ = ["Constraint", "Constraints", "Interval", "StrOptions", "check_constraints", "check_int", "check_option", "describe"]

Closed = Literal["left", "right", "both", "neither"]


@dataclass(frozen=True)
class Interval:
    """A number between *lo* and *hi* (None: unbounded on that side).

    Parameters
    ----------
    kind
        ``int`` (an int or numpy integer, never a bool) or ``float`` (any finite real
        number, ints included; never a bool).
    lo, hi
        The bounds, or None.
    closed
        Which bounds belong to the interval: ``"both"`` (default), ``"left"``,
        ``"right"`` or ``"neither"``.
    """

    kind: type
    lo: float | None
    hi: float | None
    closed: Closed = "both"

    def __post_init__(self) -> None:
        if self.kind not in (int, float):
            raise TypeError(f"Interval kind must be int or float; got {self.kind!r}.")
        if self.closed not in ("left", "right", "both", "neither"):
            raise ValueError(f"Interval closed must be 'left', 'right', 'both' or 'neither'; got {self.closed!r}.")
        if self.lo is not None and self.hi is not None and not self.lo <= self.hi:
            raise ValueError(f"Interval bounds must be lo <= hi; got {self.lo!r}, {self.hi!r}.")

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, Integral if self.kind is int else Real):
            return False
        v = float(value)
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v < self.lo or (v == self.lo and self.closed in ("right", "neither"))):
            return False
        return not (self.hi is not None and (v > self.hi or (v == self.hi and self.closed in ("left", "neither"))))

    def describe(self) -> str:
        what = "an int" if self.kind is int else "a number"
        lo_in, hi_in = self.closed in ("left", "both"), self.closed in ("right", "both")
        if self.lo is None and self.hi is None:
            return what
        if self.hi is None:
            return f"{what} {'>=' if lo_in else '>'} {_num(self.lo)}"
        if self.lo is None:
            return f"{what} {'<=' if hi_in else '<'} {_num(self.hi)}"
        return f"{what} in {'[' if lo_in else '('}{_num(self.lo)}, {_num(self.hi)}{']' if hi_in else ')'}"


@dataclass(frozen=True)
class StrOptions:
    """One of the strings *options*."""

    options: frozenset[str]

    def __init__(self, options: Iterable[str]) -> None:
        object.__setattr__(self, "options", frozenset(options))

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and value in self.options

    def describe(self) -> str:
        return f"one of {sorted(self.options)}"


#: What one option accepts: an :class:`Interval`, a :class:`StrOptions`, None, or a sequence of them (any one).
Constraint: TypeAlias = Interval | StrOptions | Sequence[Interval | StrOptions | None] | None
#: An options class's ``constraints``: ``{option: constraint}``.
Constraints: TypeAlias = Mapping[str, Constraint]


def _num(x: float | None) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _alternatives(constraint: Constraint) -> list[Interval | StrOptions | None]:
    if isinstance(constraint, (list, tuple)):
        return list(constraint)
    return [constraint]  # type: ignore[list-item]


def describe(constraint: Constraint) -> str:
    """What *constraint* accepts, as the message says it (``"an int >= 2 or None"``)."""
    return " or ".join("None" if c is None else c.describe() for c in _alternatives(constraint))


def check_option(who: str, key: str, value: Any, constraint: Constraint) -> None:
    """*value* of option *key* of *who* (an analysis name) satisfies *constraint*.

    Raises
    ------
    SpecError
        It does not: ``"The '<key>' option of <who> must be <what>; got <value>."``
    """
    if any(value is None if c is None else c.accepts(value) for c in _alternatives(constraint)):
        return
    raise SpecError(f"The '{key}' option of {who} must be {describe(constraint)}; got {value!r}.")


def check_constraints(who: str, constraints: Constraints, values: Mapping[str, Any]) -> None:
    """Every value of *values* whose key *constraints* names satisfies its constraint (:func:`check_option`)."""
    for key, constraint in constraints.items():
        if key in values:
            check_option(who, key, values[key], constraint)


def check_int(name: str, key: str, value: Any, lo: int, allow_none: bool = False) -> None:
    """*value* of option *key* of analysis *name* is an int >= *lo* (or None, with *allow_none*).

    Raises
    ------
    SpecError
        It is not; the message names the option, the analysis, what is allowed and what was given.
    """
    interval = Interval(int, lo, None)
    if value is None and allow_none:
        return
    if not interval.accepts(value):
        raise SpecError(f"The '{key}' option of {name} must be {interval.describe()}; got {value!r}.")
