"""Arms of a what-if: ``NAME=OPTIMIZER[:key=value,...]`` and ``--mixture NAME=SOURCE:WEIGHT,...``.

An arm is one optimizer with its options and, optionally, a data mixture.
Parsing happens once, here, at the boundary; everything downstream trusts the
:class:`Arm` it is given.  Every refusal is one line naming the option, what it
expected and what it got.

The step schedule (:func:`schedule`) is what makes arms comparable: step ``t``
of every arm takes the ``j``-th batch of the source it draws, and the ``j``-th
batch of a source is the same tensor in every arm (drawn once, seeded).  With
equal weights the sources alternate round-robin in ``--data`` order; a mixture
arm draws by *smooth weighted round-robin* (the source whose share is furthest
behind its weight goes next), so ``--mixture nozh=en:1,code:1`` replays the
baseline's ``en`` and ``code`` batches in the same order, without the ``zh`` ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from gradforensics.errors import SpecError

__all__ = ["OPTIMIZERS", "Arm", "parse_arm", "parse_arms", "parse_mixture", "schedule"]

#: optimizer -> {option: default}; ``lr`` has no default (every arm states its learning rate).
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {"lr": None, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01},
    "adam": {"lr": None, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    "sgd": {"lr": None, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0, "dampening": 0.0},
    "lion": {"lr": None, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0},
    "adafactor": {"lr": None, "beta2_decay": -0.8, "eps": 1e-3, "d": 1.0, "weight_decay": 0.0},
}
#: options every optimizer takes: linear warmup steps and gradient clipping (max global L2 norm; 0 = off).
COMMON: dict[str, Any] = {"warmup": 0, "clip": 0.0}
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass(frozen=True)
class Arm:
    """One arm: a name (its store is ``<name>.zarr``), an optimizer, its options and its source weights."""

    name: str
    optimizer: str
    options: Mapping[str, Any]
    mixture: Mapping[str, float] | None = field(default=None)

    @property
    def lr(self) -> float:
        return float(self.options["lr"])

    def describe(self) -> str:
        """``adamw lr=0.0003 weight_decay=0.01 ...`` (every option, defaults included), plus the mixture."""
        opts = " ".join(f"{k}={v}" for k, v in self.options.items())
        mix = "" if self.mixture is None else "; mixture " + ", ".join(f"{s}:{w:g}" for s, w in self.mixture.items())
        return f"{self.optimizer} {opts}{mix}"


#: Longest arm name: <name>.zarr and its arrays' paths must stay far below a file system's 255-byte names.
MAX_NAME = 64


def _check_name(name: str, what: str) -> str:
    if not name or not set(name) <= _NAME_CHARS or name.startswith(".") or name.startswith("-"):
        raise SpecError(f"{what}: arm name {name!r} must be letters, digits, '_', '-' or '.' (it names "
                        f"<name>.zarr), not starting with '.' or '-'.")
    if len(name) > MAX_NAME:
        raise SpecError(f"{what}: arm name of {len(name)} characters; at most {MAX_NAME} (it names <name>.zarr "
                        "and compare/<name>/ on disk).")
    return name


def _value(raw: str, default: Any, where: str) -> Any:
    """*raw* parsed like *default* (bool, int, float); ``lr`` (default None) is a float."""
    if isinstance(default, bool):
        if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise SpecError(f"{where}: expected true or false; got {raw!r}.")
        return raw.lower() in ("true", "1", "yes")
    kind = int if isinstance(default, int) else float
    try:
        v = kind(raw)
    except ValueError:
        raise SpecError(f"{where}: expected {'an integer' if kind is int else 'a number'}; got {raw!r}.") from None
    if not math.isfinite(v):
        raise SpecError(f"{where}: expected a finite number; got {raw!r}.")
    return v


def _check_ranges(opts: dict[str, Any], where: str) -> None:
    if opts["lr"] <= 0:
        raise SpecError(f"{where}: lr must be > 0; got {opts['lr']}.")
    for k in ("beta1", "beta2", "momentum", "dampening"):
        if k in opts and not 0 <= opts[k] < 1:
            raise SpecError(f"{where}: {k} must be in [0, 1); got {opts[k]}.")
    for k in ("weight_decay", "clip", "warmup", "eps"):
        if k in opts and opts[k] < 0:
            raise SpecError(f"{where}: {k} must be >= 0; got {opts[k]}.")


def parse_arm(spec: str, mixtures: Mapping[str, Mapping[str, float]] | None = None) -> Arm:
    """``"hi=adamw:lr=3e-3,beta2=0.95"`` -> an :class:`Arm` (defaults filled in, ranges checked).

    Raises
    ------
    SpecError
        A malformed spec, an unknown optimizer or option, a value of the wrong
        type or out of range, or no ``lr``.
    """
    where = f"--arm {spec!r}"
    name, eq, rest = spec.partition("=")
    if not eq or not rest:
        raise SpecError(f"{where}: expected NAME=OPTIMIZER[:key=value,...], e.g. lo=adamw:lr=3e-4.")
    _check_name(name.strip(), where)
    opt, _, opts_text = rest.partition(":")
    opt = opt.strip().lower()
    if opt not in OPTIMIZERS:
        raise SpecError(f"{where}: unknown optimizer {opt!r}; expected one of {', '.join(OPTIMIZERS)}.")
    known = {**OPTIMIZERS[opt], **COMMON}
    opts: dict[str, Any] = dict(known)
    for item in filter(None, (s.strip() for s in opts_text.split(","))):
        key, eq2, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq2 or key not in known:
            raise SpecError(f"{where}: {item!r} is not key=value with key among {', '.join(known)} ({opt}).")
        opts[key] = _value(raw.strip(), 0.0 if known[key] is None else known[key], f"{where}: {key}")
    if opts["lr"] is None:
        raise SpecError(f"{where}: no lr; every arm states its learning rate, e.g. {name}={opt}:lr=3e-4.")
    _check_ranges(opts, where)
    mix = (mixtures or {}).get(name.strip())
    return Arm(name.strip(), opt, opts, None if mix is None else dict(mix))


def parse_mixture(spec: str) -> tuple[str, dict[str, float]]:
    """``"nozh=en:1,code:1"`` -> ``("nozh", {"en": 1.0, "code": 1.0})``."""
    where = f"--mixture {spec!r}"
    name, eq, rest = spec.partition("=")
    if not eq or not rest:
        raise SpecError(f"{where}: expected ARM=SOURCE:WEIGHT,..., e.g. nozh=en:1,code:1.")
    _check_name(name.strip(), where)
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        src, colon, w = item.rpartition(":")
        if not colon or not src:
            raise SpecError(f"{where}: {item!r} is not SOURCE:WEIGHT.")
        weight = _value(w, 1.0, f"{where}: weight of {src}")
        if weight < 0 or src in out:
            raise SpecError(f"{where}: source {src!r} " + ("given twice." if src in out else "has a negative weight."))
        out[src] = weight
    if not out or sum(out.values()) <= 0:
        raise SpecError(f"{where}: no source with a positive weight.")
    return name.strip(), out


def parse_arms(arm_specs: Sequence[str], mixture_specs: Sequence[str] = (),
               sources: Sequence[str] | None = None) -> list[Arm]:
    """Every ``--arm`` (with its ``--mixture``), checked against each other and the ``--data`` sources."""
    if not arm_specs:
        raise SpecError("give at least one --arm NAME=OPTIMIZER:lr=..., e.g. --arm lo=adamw:lr=3e-4.")
    mixtures = dict(parse_mixture(m) for m in mixture_specs)
    arms = [parse_arm(a, mixtures) for a in arm_specs]
    seen: set[str] = set()
    for a in arms:
        if a.name in seen:
            raise SpecError(f"--arm: arm {a.name!r} given twice; give each arm its own name.")
        seen.add(a.name)
    for m in mixtures:
        if m not in seen:
            raise SpecError(f"--mixture {m}=...: there is no --arm named {m!r} (arms: {', '.join(sorted(seen))}).")
    if sources is not None:
        for a in arms:
            for s in a.mixture or ():
                if s not in sources:
                    raise SpecError(f"--mixture {a.name}=...: unknown source {s!r}; the --data sources are "
                                    f"{', '.join(sources)}.")
    return arms


def schedule(sources: Sequence[str], steps: int, weights: Mapping[str, float] | None = None) -> list[tuple[str, int]]:
    """``[(source, j), ...]`` for *steps* steps: step ``t`` takes batch ``j`` of that source.

    Smooth weighted round-robin: at each step every source's credit grows by
    its weight share and the source with the most credit goes (ties: ``--data``
    order), losing one.  Equal weights give plain round-robin; a zero weight
    (or a source left out of *weights*) never goes.
    """
    w = {s: Fraction((weights or {}).get(s, 0.0 if weights else 1.0)) for s in sources}   # exact: ties stay ties
    total = sum(w.values())
    if total <= 0:
        raise SpecError(f"schedule: no source with a positive weight among {list(sources)}.")
    credit = dict.fromkeys(sources, Fraction(0))
    used = dict.fromkeys(sources, 0)
    out = []
    for _ in range(steps):
        for s in sources:
            credit[s] += w[s] / total
        pick = max((s for s in sources if w[s] > 0), key=lambda s: credit[s])   # max keeps the first of ties
        credit[pick] -= 1
        out.append((pick, used[pick]))
        used[pick] += 1
    return out
