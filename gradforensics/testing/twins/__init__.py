"""The twin zoo: real training runs of several model families, each a sick run beside a healthy twin.

Every family trains, in plain torch, on one CPU core in seconds to a minute, a *sick* arm and one or
more *healthy* twins that differ from it in one thing (the learning rate, a q/k LayerNorm, gradient
clipping, one data source), same data, same seed.  Each arm is recorded live with ``gf.Recorder``
(``mode="training"``) and returns its **truth**: what the family module measured of the run in its
own torch code, independently of the store (dead-unit shares, the measured max attention logit,
log Z of the output logits, each source's loss, ...).

A family module ``gradforensics.testing.twins.<module>`` defines

    train(arm: str, path: Path, *, seed: int = 0) -> dict[str, float]

which records arm *arm* at *path* (overwriting) and returns the truth.  :data:`FAMILIES` lists every
family, its arms and what the sick arm's first flag must be (:class:`Expect`); :func:`judge`
trains and analyses one family at one seed.  ``benchmarks/calibration.py --twins`` prints the
table of docs/calibration.md from it; ``tests/test_twins.py`` asserts it.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "Expect", "Family", "Judged", "built", "describe", "judge", "score", "train"]


@dataclass(frozen=True)
class Expect:
    """What the sick arm's first flag (the largest, at or above 0.5) must be."""

    kind: str
    tensor: str = "*"                 # fnmatch glob on the flag's tensor
    head: int | None = None           # None: any head (or none)
    sources: tuple[str, ...] = ()     # the flag must name each of these

    def matches(self, flag: Any) -> bool:
        return (flag.kind == self.kind and fnmatch.fnmatchcase(flag.tensor, self.tensor)
                and (self.head is None or flag.head == self.head)
                and set(self.sources) <= set(flag.sources))

    def __str__(self) -> str:
        where = self.tensor + (f" head {self.head}" if self.head is not None else "")
        return f"{self.kind} on {where}" + (f" naming {', '.join(self.sources)}" if self.sources else "")


@dataclass(frozen=True)
class Family:
    """One family of the zoo: its module, its arms, and the sick arm's expected first flag."""

    name: str
    module: str                       # gradforensics.testing.twins.<module>
    sick: str                         # the sick arm
    healthy: tuple[str, ...]          # the healthy twins: no flag >= 0.5 allowed
    expect: Expect
    info: tuple[str, ...] = ()        # arms shown for information only (e.g. a z-loss arm)
    note: str = ""
    analyze_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def arms(self) -> tuple[str, ...]:
        return (self.sick, *self.healthy, *self.info)


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("relu-mlp", "relu_mlp", "high-lr", ("sane-lr",), Expect("saturation"),
           note="ReLU MLP: most units die at a high learning rate; a few at a sane one"),
    Family("cnn-bn", "cnn_bn", "dead", ("sane",), Expect("saturation"),
           note="CNN with BatchNorm: dead channels / a sane run"),
    Family("gru-lm", "gru_lm", "no-clip", ("clip",), Expect("spectral", "*weight_hh*"),
           note="GRU language model: exploding gradients without clipping / with clipping"),
    Family("nanogpt", "nanogpt", "high-lr", ("qk-ln", "low-lr"), Expect("attention_logits"),
           note="nanoGPT-style SDPA model: attention-logit growth / the same LR with q/k LayerNorm / a low LR"),
    Family("logits", "logit_divergence", "high-lr", ("low-lr",), Expect("logits", "lm_head"), info=("z-loss",),
           note="output-logit divergence (log Z grows) / a low LR; a z-loss arm as information"),
    Family("mixture", "mixture", "broken", ("clean",), Expect("conflict", sources=("broken",)),
           note="three sources, one with random targets / three clean sources of different domains"),
    Family("late-rows", "late_rows", "late", ("steady",), Expect("optimizer", tensor="embed.weight"),
           note="Adam, embedding rows first seen late (a loss spike) / steady data"),
    Family("llama", "hf_runs", "llama-high-lr", ("llama",), Expect("attention_logits", "model.layers.*.self_attn"),
           note="tiny HF LLaMA (GQA, eager attention), AdamW lr 3e-2 / 3e-3"),
    Family("gpt2", "hf_runs", "gpt2-high-lr", ("gpt2",), Expect("attention_logits", "transformer.h.*.attn"),
           note="tiny HF GPT-2 (fused Conv1D qkv), AdamW lr 3e-2 / 3e-3"),
    Family("mlp-eos", "hf_runs", "mlp-eos", ("mlp-gd",), Expect("oscillation"),
           note="tanh MLP on digits, full-batch GD past the edge of stability / at eta 0.1"),
    Family("moe-collapse", "moe", "collapse", ("balanced",), Expect("experts", "model.layers.*.mlp*"),
           note="tiny HF Mixtral (8 experts, top-2), AdamW lr 3e-2: routing collapse without / with the load-balancing loss"),
    Family("moe-starved", "moe", "starved", ("top2-balanced",), Expect("experts", "model.layers.*.mlp*"),
           info=("top2",), note="tiny HF Qwen2-MoE, normalised top-k weights: top-1 (router starved of gradient) / "
                                "top-2 with the load-balancing loss; top-2 without it as information (it collapses)"),
]}


def _module(family: Family) -> Any:
    return importlib.import_module(f"{__name__}.{family.module}")


def train(family: str, arm: str, path: Path, *, seed: int = 0) -> dict[str, float]:
    """Record arm *arm* of *family* at *path*; returns the truth its module measured in plain torch."""
    fam = FAMILIES[family]
    if arm not in fam.arms:
        raise ValueError(f"family {family!r} has arms {', '.join(fam.arms)}; got {arm!r}.")
    fn: Callable[..., dict[str, float]] = _module(fam).train
    return fn(arm, Path(path), seed=seed)


@dataclass
class Judged:
    """One arm, trained and analysed: its truth, its flags (largest first) and the timings."""

    family: str
    arm: str
    seed: int
    truth: dict[str, float]
    flags: list[Any]
    train_s: float
    analyze_s: float

    def first(self, threshold: float = 0.5) -> Any | None:
        return self.flags[0] if self.flags and self.flags[0].severity >= threshold else None

    def largest(self, kind: str) -> float:
        return max((f.severity for f in self.flags if f.kind == kind), default=0.0)


def judge(family: str, work: Path, *, seed: int = 0, arms: Sequence[str] | None = None,
          options: Mapping[str, Any] | None = None) -> dict[str, Judged]:
    """Train and analyse every arm of *family* (or *arms*) under *work* at *seed*."""
    import gradforensics as gf

    fam = FAMILIES[family]
    out: dict[str, Judged] = {}
    for arm in arms or fam.arms:
        store = Path(work) / f"{family}-{arm}-{seed}.zarr"
        t0 = time.perf_counter()
        truth = train(family, arm, store, seed=seed)
        t1 = time.perf_counter()
        opts = {"engine": {"persist": False}, **dict(fam.analyze_options), **dict(options or {})}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            findings = gf.analyze(store, progress=False, options=opts)
        out[arm] = Judged(family, arm, seed, truth, list(findings.flags), t1 - t0, time.perf_counter() - t1)
    return out


def describe(j: Judged, n: int = 5) -> str:
    """A few lines: the arm's truth and its largest flags (for notes and failing tests)."""
    lines = [f"{j.family}/{j.arm} seed {j.seed}: truth {json.dumps({k: round(v, 4) for k, v in j.truth.items()})}"]
    for f in j.flags[:n]:
        lines.append(f"  {f.severity:.2f} {f.kind} {f.tensor}" + (f" head {f.head}" if f.head is not None else "")
                     + (f" [{', '.join(f.sources)}]" if f.sources else "") + f": {f.summary}")
    return "\n".join(lines)


def built(family: str) -> str | None:
    """None when *family*'s module imports; else why not (``"not built"`` when the module does not exist)."""
    name = f"{__name__}.{FAMILIES[family].module}"
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return "not built"
        return f"does not import: {exc}"
    except Exception as exc:  # a family module under construction: reported, not raised
        return f"does not import: {type(exc).__name__}: {exc}"
    return None


def _flag(f: Any) -> dict[str, Any] | None:
    if f is None:
        return None
    return {"kind": f.kind, "tensor": f.tensor, "head": f.head, "sources": list(f.sources),
            "severity": round(float(f.severity), 4)}


def score(family: str, judged: Mapping[str, Judged]) -> dict[str, Any]:
    """One row of the zoo's table (``benchmarks/calibration.py --twins``) from :func:`judge`'s arms.

    ``sick``: the sick arm's largest flag (the first, when it reaches 0.5) and ``matches``: whether it
    reaches 0.5 and meets the family's :class:`Expect`.  ``twins``: per healthy arm, its count of flags
    >= 0.5 and its largest flag of any kind.  ``margin``: the sick arm's largest severity minus the
    twins' largest severity of that flag's kind (None without a sick flag); ``expected`` the sick arm's
    largest flag of the expected kind and ``expected_margin`` the same margin for that kind.  ``info``: the info arms'
    largest flags.  ``truth`` and ``seconds`` (train, analyse) per arm.
    """
    fam = FAMILIES[family]
    sick = judged[fam.sick]
    top = sick.flags[0] if sick.flags else None
    twins = {arm: {"flags_ge_0.5": sum(f.severity >= 0.5 for f in judged[arm].flags),
                   "largest": _flag(judged[arm].flags[0] if judged[arm].flags else None)}
             for arm in fam.healthy if arm in judged}
    margin = None if top is None else round(float(top.severity) - max(
        (judged[arm].largest(top.kind) for arm in fam.healthy if arm in judged), default=0.0), 4)
    seed = sick.seed
    want = next((f for f in sick.flags if f.kind == fam.expect.kind), None)
    expected_margin = None if want is None else round(float(want.severity) - max(
        (judged[arm].largest(want.kind) for arm in fam.healthy if arm in judged), default=0.0), 4)
    return {"family": family, "seed": seed, "sick_arm": fam.sick, "expect": str(fam.expect),
            "sick": _flag(top), "matches": bool(top is not None and top.severity >= 0.5 and fam.expect.matches(top)),
            "twins": twins, "margin": margin, "expected": _flag(want), "expected_margin": expected_margin,
            "info": {arm: _flag(judged[arm].flags[0] if judged[arm].flags else None)
                     for arm in fam.info if arm in judged},
            "truth": {arm: {k: round(float(v), 4) for k, v in j.truth.items()} for arm, j in judged.items()},
            "seconds": {arm: [round(j.train_s, 1), round(j.analyze_s, 1)] for arm, j in judged.items()}}
