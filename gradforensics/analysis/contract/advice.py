"""What a kind of flag means and what to try next: :class:`Advice`, the :data:`CAUSES` the
verdict ranks, and :data:`FlagKey`, a finding's identity across runs.

Advice reads a flag through :class:`Finding`, the fields it needs (a
:class:`~gradforensics.analysis.contract.model.Flag` has them): the contract's types form
no import cycle, not even for type checking (``tests/test_architecture.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

__all__ = ["CAUSES", "Advice", "Finding", "FlagKey"]


class Finding(Protocol):
    """What :class:`Advice` reads of a flag."""

    @property
    def kind(self) -> str: ...
    @property
    def tensor(self) -> str: ...
    @property
    def head(self) -> int | None: ...
    @property
    def sources(self) -> tuple[str, ...]: ...
    @property
    def evidence(self) -> Mapping[str, Any]: ...

#: The causes the verdict ranks, and how each reads (a kind may declare another word: it reads as itself).
CAUSES: Mapping[str, str] = MappingProxyType({
    "learning_rate": "learning rate vs curvature",
    "data": "data",
    "optimizer": "optimizer state",
    "attention": "attention",
    "precision": "precision",
})


@dataclass(frozen=True)
class Advice:
    """What a kind of flag means and what to try next: everything downstream knows of the kind.

    The report (summary, records map, remedies), ``compare`` and ``whatif`` read a kind's
    declaration here and nowhere else.

    Parameters
    ----------
    title
        Section title of a finding of this kind (``"Direction drift"``).
    phrase
        Verb phrase of the summary sentence; ``{sources}`` is replaced by the
        implicated sources (``"{sources} gradients point opposite ways"``).
    evidence_keys
        Evidence keys the summary quotes (as a range over a finding's flags), most
        telling first: keys the kind's flags carry in ``evidence`` (the contract suite,
        :mod:`gradforensics.testing.contracts`, checks every one on a planted store).
        A mapping ``{key: label}`` gives how each reads in a sentence (``{"cosine":
        "cos"}``); a plain sequence of keys reads each as itself, underscores as spaces.
        After construction this is the tuple of keys and :attr:`evidence_labels` the labels.
    remedies
        What to try next, most likely first: the standard remedies for this
        failure with their literature, not a diagnosis.
    references
        Short citations of the remedies (full entries in the emitting module).
    time_axis
        The statistic reads the record axis as time: in a ``replay`` store the
        report prefixes the remedies with that caveat.
    records_map
        Non-empty for a finding about gradient *directions*: the report draws the
        records map (every record placed by its gradient's direction, from the saved
        Gram matrix) for the most severe flag of such a kind, and this sentence tells
        how to read it (``"a drifting gradient walks away from its first records in the
        step panel"``).  Empty (default): the kind takes no part in the map.
    keyed_by_sources
        The finding *is* about its sources (a conflict is its source pair): two flags
        of this kind on one unit with different sources are two findings.  False
        (default): the sources describe the finding (who sits at an oscillation's
        poles, which source a drift aligns with, which sources are noisier) and move
        from run to run with the trajectory; the finding is the unit's.  See :meth:`key`.
    cause
        The cause a finding of this kind points at, one of :data:`CAUSES` (``"learning_rate"``:
        learning rate vs curvature; ``"data"``, ``"optimizer"``, ``"attention"``,
        ``"precision"``) or another short word; the report's verdict ranks causes from the
        findings that agree on one.  A flag may name its own in ``evidence["cause"]`` (a
        gradient-norm line in full-batch training is the learning rate, not data order).
        Empty (default): the kind is a cause of its own, named by its title.
    """

    title: str
    phrase: str
    evidence_keys: tuple[str, ...] | Mapping[str, str] = ()
    remedies: tuple[str, ...] = ()
    references: tuple[str, ...] = ()
    time_axis: bool = False
    records_map: str = ""
    keyed_by_sources: bool = False
    cause: str = ""
    evidence_labels: Mapping[str, str] = field(init=False, repr=False, compare=False,
                                               default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        from gradforensics.errors import SpecError

        raw = self.evidence_keys
        pairs = list(raw.items()) if isinstance(raw, Mapping) else (
            None if isinstance(raw, str) else [(k, None) for k in raw])
        if pairs is None or not all(isinstance(k, str) and k and (lab is None or (isinstance(lab, str) and lab))
                                    for k, lab in pairs):
            raise SpecError(f"Advice {self.title!r}: evidence_keys must be a sequence of non-empty keys or a "
                            f"mapping of keys to non-empty labels; got {raw!r}.")
        keys = tuple(k for k, _ in pairs)
        if len(set(keys)) != len(keys):
            raise SpecError(f"Advice {self.title!r}: evidence_keys names a key twice; got {list(keys)!r}.")
        labels = {k: lab if lab is not None else k.replace("_", " ") for k, lab in pairs}
        object.__setattr__(self, "evidence_keys", keys)
        object.__setattr__(self, "evidence_labels", MappingProxyType(labels))
        if not isinstance(self.records_map, str):
            raise SpecError(f"Advice {self.title!r}: records_map must be a sentence (empty: no map); "
                            f"got {self.records_map!r}.")

    def cause_of(self, flag: Finding) -> str:
        """The cause *flag* points at: its own ``evidence["cause"]``, else the kind's :attr:`cause` ("" for none)."""
        own = flag.evidence.get("cause") if isinstance(flag.evidence, Mapping) else None
        return own if isinstance(own, str) and own else self.cause

    def label(self, key: str) -> str:
        """How evidence *key* reads in a sentence (its declared label, else the key with spaces)."""
        return self.evidence_labels.get(key) or key.replace("_", " ")

    def key(self, flag: Finding) -> FlagKey:
        """Which finding *flag* is, across runs and arms: ``(kind, tensor, head, sources)``.

        The one rule (``compare`` and ``whatif`` both pair findings by it): a finding is
        its kind, tensor and head, plus its sources (as a sorted tuple) when the kind is
        :attr:`keyed_by_sources`; otherwise the last element is ``()``.
        """
        srcs = tuple(sorted(flag.sources)) if self.keyed_by_sources else ()
        return (flag.kind, flag.tensor, None if flag.head is None else int(flag.head), srcs)

    def remedies_for(self, flags: Sequence[Finding]) -> list[str]:
        """The remedies for a group of *flags* of this kind, most specific first.

        Override in a subclass to reorder them by what the flags show.
        """
        return list(self.remedies)


#: A finding's identity across runs (:meth:`Advice.key`): kind, tensor, head, sources (or ``()``).
FlagKey = tuple[str, str, "int | None", tuple[str, ...]]
