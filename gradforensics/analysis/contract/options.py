"""The base of every analysis's options: :class:`Options` (parsed once, checked against
constraints declared as data: :mod:`gradforensics.analysis.contract.checks`) and
:class:`NoOptions`, the options of an analysis that takes none."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from gradforensics.analysis.contract.checks import Constraints, check_constraints

__all__ = ["NoOptions", "Options", "OptionsT"]

OptionsT = TypeVar("OptionsT", bound="Options")


class Options:
    """Base of an analysis's options: a small frozen dataclass, parsed once by :meth:`parse`.

    Subclass it as ``@dataclass(frozen=True) class DriftOptions(Options)`` and declare the
    values each option accepts as data, in the class attribute :attr:`constraints`
    (:mod:`gradforensics.analysis.contract.checks`, scikit-learn's parameter validation as
    the model)::

        constraints = {"window": [Interval(int, 2, None), None], "method": StrOptions({"a", "b"})}

    :meth:`parse` and the dataclass's construction check every value against them, with one
    message shape: *"The 'window' option of drift must be an int >= 2; got 1."*  A check that
    is not a simple range or choice (two options together, a pair's order) goes in the
    dataclass's ``__post_init__``, which then calls ``super().__post_init__()`` first and
    raises :class:`~gradforensics.errors.SpecError`.  The engine parses each selected
    analysis's ``options[name]`` once, before reading the store, and hands the parsed object
    to the analysis in ``ctx.options[name]`` (:meth:`Context.options_for`).
    """

    #: ``{option: constraint}``: what each option accepts (:class:`~gradforensics.analysis.contract.checks.Interval`,
    #: :class:`~gradforensics.analysis.contract.checks.StrOptions`, None, or a list of them: any one).
    constraints: ClassVar[Constraints] = MappingProxyType({})
    #: The analysis these options are for: messages of a directly constructed instance name it
    #: (:meth:`parse` names the analysis it is given); default the class name.
    analysis_name: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        cls = type(self)
        check_constraints(cls.analysis_name or cls.__name__, cls.constraints,
                          {k: getattr(self, k) for k in cls.constraints if hasattr(self, k)})

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The option names this class accepts (its dataclass fields), sorted."""
        import dataclasses

        return tuple(sorted(f.name for f in dataclasses.fields(cls)))  # type: ignore[arg-type]

    @classmethod
    def parse(cls: type[OptionsT], raw: Any = None, name: str | None = None) -> OptionsT:
        """*raw* as an instance of this options class, validated once.

        Parameters
        ----------
        raw
            ``None`` (the defaults), an instance of *cls* (returned as is), or a
            mapping of field values.
        name
            The analysis the options are for (messages name it; default:
            :attr:`analysis_name`, else the class name).

        Raises
        ------
        SpecError
            *raw* is not a mapping, names an unknown key (the message lists the
            known ones), a value breaks its declared constraint (:attr:`constraints`),
            or it fails the class's own checks.
        """
        from gradforensics.errors import SpecError

        who = name or cls.analysis_name or cls.__name__
        if raw is None:
            return cls()
        if isinstance(raw, cls):
            return raw
        if not isinstance(raw, Mapping):
            raise SpecError(f"{who}: bad options {raw!r}: must be a dict or a {cls.__name__}; "
                            f"got {type(raw).__name__}.")
        known = list(cls.field_names())
        unknown = sorted(str(k) for k in raw if k not in known)
        if unknown:
            raise SpecError(f"{who}: bad options {dict(raw)!r}: unknown key(s) {unknown}; "
                            f"{who} options must be among {known}.")
        check_constraints(who, cls.constraints, raw)
        return cls(**raw)


@dataclass(frozen=True)
class NoOptions(Options):
    """The options of an analysis that takes none: ``options={name: {}}`` only."""
