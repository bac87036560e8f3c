"""The registry: which analyses run, in which order, and which kinds of flag they emit.

:data:`REGISTRY` maps analysis names to :class:`~gradforensics.analysis.contract.model.Analysis`
entries in registration order (the order of the report's sections).
``gradforensics/analysis/__init__.py`` registers the built-in analyses, one line
each; an analysis defined anywhere else (a plugin, a test) is added with
:func:`register` and removed with :func:`unregister` (or both at once with the
:func:`registered` context manager).

Everything downstream reads the registry, so a registered analysis needs no
other edit: the engine runs it (``only=``, ``options=``), the kinds it declares
are valid in ``flags.json`` (:func:`flag_kinds`, the schema's ``kind`` enum) and
the report finds its advice (:func:`advice_of`) and its plot.  What downstream code knows
of a kind - the evidence keys the summary quotes with their labels, whether the records
map is drawn for it (:func:`records_map_kinds`), which flags are the same finding across
runs and arms (:func:`flag_key`) - is read from its :class:`~gradforensics.analysis.contract.advice.Advice`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from gradforensics.analysis.contract.advice import Advice
from gradforensics.analysis.contract.model import Analysis
from gradforensics.errors import SpecError
from gradforensics.store.names import check_analysis_name

if TYPE_CHECKING:
    from gradforensics.analysis.contract.advice import FlagKey
    from gradforensics.analysis.contract.model import Flag

__all__ = ["REGISTRY", "advice_of", "emitter_of", "flag_key", "flag_kinds", "records_map_kinds", "register",
           "registered", "unregister"]

#: Registered analyses by name, in registration order.
REGISTRY: dict[str, Analysis] = {}


def register(analysis: Analysis) -> Analysis:
    """Add *analysis* to the registry, after checking it; returns it.

    Registering the same object again does nothing.

    Raises
    ------
    SpecError
        *analysis* is not an :class:`Analysis`, another analysis has its name, or
        one of its kinds is emitted by another registered analysis.
    UnsafeNameError
        Its name is not a lower-case identifier.
    """
    if not isinstance(analysis, Analysis):
        raise SpecError(f"register() takes an Analysis; got {type(analysis).__name__} {analysis!r}.")
    name = check_analysis_name(analysis.name, "register()")
    if REGISTRY.get(name) is analysis:
        return analysis
    if name in REGISTRY:
        raise SpecError(f"register(): an analysis named {name!r} is already registered; "
                        "unregister it first, or choose another name.")
    taken = {k: other.name for other in REGISTRY.values() for k in other.kinds}
    clash = {k: taken[k] for k in analysis.kinds if k in taken}
    if clash:
        raise SpecError(f"register(): {name!r} declares flag kind(s) {sorted(clash)} already emitted by "
                        f"{sorted(set(clash.values()))}; a kind belongs to one analysis.")
    REGISTRY[name] = analysis
    return analysis


def unregister(name: str | Analysis) -> Analysis:
    """Remove the analysis *name* (or that analysis) from the registry; returns it.

    Raises
    ------
    SpecError
        No analysis of that name is registered.
    """
    key = name.name if isinstance(name, Analysis) else name
    if key not in REGISTRY:
        raise SpecError(f"unregister(): no analysis named {key!r} is registered; registered: {sorted(REGISTRY)}.")
    return REGISTRY.pop(key)


@contextmanager
def registered(analysis: Analysis) -> Iterator[Analysis]:
    """``with registered(a): ...``: *analysis* is registered inside the block only."""
    already = REGISTRY.get(analysis.name) is analysis
    register(analysis)
    try:
        yield analysis
    finally:
        if not already and REGISTRY.get(analysis.name) is analysis:
            unregister(analysis)


def flag_kinds() -> tuple[str, ...]:
    """Every flag kind a registered analysis emits, in registry order (the ``flags.json`` ``kind`` enum)."""
    return tuple(k for a in REGISTRY.values() for k in a.kinds)


def emitter_of(kind: str) -> Analysis | None:
    """The registered analysis that emits flags of *kind*, or None."""
    return next((a for a in REGISTRY.values() if kind in a.kinds), None)


def advice_of(kind: str) -> Advice | None:
    """What the report says about a flag of *kind*: its emitter's :class:`Advice`, or None."""
    a = emitter_of(kind)
    return None if a is None else a.kinds[kind]


def flag_key(flag: Flag) -> FlagKey:
    """Which finding *flag* is: ``(kind, tensor, head, sources)``, how ``compare`` and ``whatif`` pair flags.

    The kind's :meth:`Advice.key <gradforensics.analysis.contract.advice.Advice.key>`:
    kind, tensor and head, plus the sorted sources only for a kind whose finding is
    about its sources (``Advice.keyed_by_sources``: conflict); otherwise ``()``.  A kind
    no registered analysis emits declares nothing, so it is keyed without its sources.
    """
    advice = advice_of(flag.kind) or Advice(title=flag.kind, phrase=flag.kind)
    return advice.key(flag)


def records_map_kinds() -> tuple[str, ...]:
    """The kinds the report draws the records map for (``Advice.records_map`` non-empty), in registry order."""
    return tuple(k for a in REGISTRY.values() for k, adv in a.kinds.items() if adv.records_map)
