"""What each kind of finding means, and what to try next: read from the analysis that emits it.

Every registered analysis declares, per flag kind it emits, an
:class:`~gradforensics.analysis.contract.advice.Advice`: a title, the phrase the
summary uses, the evidence keys worth quoting, and the remedies with their
references (the full reference entries sit next to that advice, in the
analysis's module).  The remedies are the standard ones for that failure, not a
diagnosis: the report says *what to try first*, and the evidence decides.  A
kind no registered analysis emits (findings from a newer gradforensics, or from
a plugin not loaded) gets a plain title and no remedies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.registry import advice_of
from gradforensics.reporting.names import join_and

if TYPE_CHECKING:
    from gradforensics.analysis.contract.model import Flag

__all__ = ["advice_for", "info", "phrase", "references_for"]



def info(kind: str) -> Advice:
    """The :class:`Advice` of *kind* (a plain stand-in for a kind no registered analysis emits)."""
    return advice_of(kind) or Advice(title=kind, phrase=kind.replace("_", " "))


def phrase(kind: str, sources: tuple[str, ...]) -> str:
    """The summary's verb phrase for *kind* with *sources* filled in."""
    text = info(kind).phrase
    if "{sources}" in text:
        return text.replace("{sources}", join_and(list(sources)) if sources else "the sources'")
    return text


def advice_for(kind: str, flags: list[Flag], mode: str = "training", n_sources: int = 1) -> list[str]:
    """Remedies for a group of flags of one kind, most specific first (``Advice.remedies_for``).

    In a ``replay`` store the record axis is not time: batches were replayed
    through one checkpoint, round-robin over the sources, so a finding of a kind
    whose statistic reads it as time (``Advice.time_axis``) first gets that caveat.
    """
    kind_info = info(kind)
    items = kind_info.remedies_for(flags)
    if mode == "replay" and kind_info.time_axis:
        rr = (f" round-robin over the {n_sources} sources, so a period of {n_sources} records is the replay order"
              if n_sources > 1 else "")
        items.insert(0, "Caveat: this store is a replay (batches replayed through one checkpoint"
                        f"{rr}); the record axis is not training time. Confirm on a training-mode capture "
                        "before acting on a time-based finding.")
    return items


def references_for(kind: str) -> list[str]:
    return list(info(kind).references)
