"""What each kind of finding means, and what to try next, grounded in the literature.

One :class:`KindInfo` per flag kind: a title, the phrase the summary uses, the
evidence keys worth quoting, and the remedies with their references.  The
remedies are the standard ones for that failure, not a diagnosis: the report
says *what to try first*, and the evidence decides.

References
----------
.. [Yu2020] T. Yu et al., "Gradient Surgery for Multi-Task Learning" (PCGrad), NeurIPS 2020.
.. [Xie2023] S. M. Xie et al., "DoReMi: Optimizing Data Mixtures Speeds Up Language Model Pretraining", NeurIPS 2023.
.. [Dehghani2023] M. Dehghani et al., "Scaling Vision Transformers to 22 Billion Parameters", ICML 2023 (QK-norm).
.. [Wortsman2023] M. Wortsman et al., "Small-scale proxies for large-scale Transformer training instabilities", 2023.
.. [Chowdhery2022] A. Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022 (z-loss, skipping batches).
.. [Micikevicius2018] P. Micikevicius et al., "Mixed Precision Training", ICLR 2018.
.. [Zamirai2020] P. Zamirai et al., "Revisiting BFloat16 Training", 2020.
.. [McCandlish2018] S. McCandlish et al., "An Empirical Model of Large-Batch Training", 2018.
.. [Goyal2017] P. Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017 (warmup).
.. [Cohen2021] J. Cohen et al., "Gradient Descent on Neural Networks Typically Occurs at the Edge of Stability", ICLR 2021.
.. [Glorot2010] X. Glorot and Y. Bengio, "Understanding the difficulty of training deep feedforward neural networks", AISTATS 2010.
.. [Ioffe2015] S. Ioffe and C. Szegedy, "Batch Normalization", ICML 2015; J. L. Ba et al., "Layer Normalization", 2016.
.. [Lu2019] L. Lu et al., "Dying ReLU and Initialization: Theory and Numerical Examples", 2019.
.. [Gur-Ari2018] G. Gur-Ari et al., "Gradient Descent Happens in a Tiny Subspace", 2018.
.. [Martin2021] C. H. Martin and M. W. Mahoney, "Implicit Self-Regularization in Deep Neural Networks", JMLR 2021.
.. [Welch1967] P. D. Welch, "The use of fast Fourier transform for the estimation of power spectra", 1967.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradforensics.report.names import join_and

if TYPE_CHECKING:
    from gradforensics.analysis.engine.model import Flag


@dataclass(frozen=True)
class KindInfo:
    title: str
    phrase: str                       # "{sources}" is replaced by the implicated sources
    evidence_keys: tuple[str, ...]    # quoted in the summary when every flag of a group has them
    advice: tuple[str, ...]
    references: tuple[str, ...] = field(default=())


KINDS: dict[str, KindInfo] = {
    "conflict": KindInfo(
        "Data-source conflict",
        "{sources} gradients point opposite ways",
        ("cosine", "p_value"),
        ("Re-weight the mixture: lower the share of one of the conflicting sources, or learn the weights "
         "with a small proxy model (DoReMi).",
         "Check the data itself: the same context with different continuations across sources (label noise, "
         "a templating bug, a translation artefact) is the usual cause of a persistent negative cosine.",
         "If both sources must stay, project out the conflicting component per layer (gradient surgery, "
         "PCGrad) on the layers named here only, or give the sources a distinguishing tag token."),
        ("Yu et al. 2020, Gradient Surgery for Multi-Task Learning (PCGrad)",
         "Xie et al. 2023, DoReMi: Optimizing Data Mixtures Speeds Up LM Pretraining"),
    ),
    "spectral": KindInfo(
        "Spectral growth / rank collapse",
        "the spectrum concentrates in a few directions",
        ("stable_rank", "alpha", "growth", "top_share"),
        ("For attention q/k weights: normalise queries and keys (QK-norm) or add the auxiliary z-loss; "
         "growing q/k spectra precede attention-logit blow-up.",
         "Otherwise: more weight decay on the named tensors, a lower peak LR, or a smaller LR for them.",
         "A heavy-tailed ESD (alpha < 2) is over-fit/over-trained; alpha > 6 is under-trained (WeightWatcher)."),
        ("Dehghani et al. 2023, Scaling Vision Transformers to 22B Parameters (QK-norm)",
         "Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities",
         "Chowdhery et al. 2022, PaLM (z-loss)",
         "Martin & Mahoney 2021, Implicit Self-Regularization in Deep Neural Networks"),
    ),
    "precision": KindInfo(
        "Precision floor",
        "updates fall below the weights' precision floor",
        ("swamped", "frac_swamped", "underflow", "overflow"),
        ("Keep fp32 master weights (mixed precision) so small updates accumulate instead of rounding away.",
         "Or use stochastic rounding / Kahan-compensated summation for bf16 weight updates.",
         "For fp16 gradient underflow/overflow: dynamic loss scaling."),
        ("Micikevicius et al. 2018, Mixed Precision Training",
         "Zamirai et al. 2020, Revisiting BFloat16 Training"),
    ),
    "noise": KindInfo(
        "Gradient noise",
        "gradient noise swamps the signal",
        ("snr", "b_simple", "batch"),
        ("Raise the batch size toward B_simple = tr(Σ)/|G|² (the critical batch size estimate); "
         "below it, steps are noise-dominated.",
         "Or lower the LR in proportion (the noise temperature is LR/B); gradient accumulation gets the batch "
         "without memory."),
        ("McCandlish et al. 2018, An Empirical Model of Large-Batch Training",),
    ),
    "drift": KindInfo(
        "Direction drift",
        "the gradient direction drifts away from where it started",
        ("cosine", "rho", "p_value"),
        ("Look for a change in the data stream at the records named (mixture schedule, a new shard, "
         "a tokenizer or packing change) before blaming the optimizer.",
         "If the data is stationary, drift of the dominant direction with a rising loss points at the LR "
         "schedule: try a lower peak LR or a longer decay."),
        ("Gur-Ari et al. 2018, Gradient Descent Happens in a Tiny Subspace",),
    ),
    "oscillation": KindInfo(
        "Oscillation",
        "updates flip between two opposing directions",
        ("cosine", "period", "bimodality"),
        ("Lower the LR (or its peak), or lengthen warmup: sign-flipping updates along the top direction are "
         "the edge-of-stability signature of a step too large for the local curvature.",
         "With Adam: raise beta2 (e.g. 0.95 -> 0.98/0.99) or epsilon so the second-moment estimate "
         "stops chasing spikes; clip gradients.",
         "If the poles are data sources, the oscillation is a mixture conflict: see the conflict remedies."),
        ("Cohen et al. 2021, Gradient Descent ... at the Edge of Stability",
         "Goyal et al. 2017, Accurate, Large Minibatch SGD (warmup)",
         "Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training instabilities"),
    ),
    "saturation": KindInfo(
        "Activation saturation",
        "units are dead or pinned at the top of their range",
        ("dead", "saturated", "bimodality", "frac_dead"),
        ("Check the initialisation scale of the layer feeding these units (Glorot/He; smaller for deep "
         "stacks) and the LR: a large early step kills ReLU-family units for good.",
         "Add or move a normalisation before the activation (LayerNorm/RMSNorm), or switch to a smooth "
         "activation (GELU/SiLU) if units die."),
        ("Glorot & Bengio 2010, Understanding the difficulty of training deep feedforward networks",
         "Lu et al. 2019, Dying ReLU and Initialization",
         "Ba et al. 2016, Layer Normalization"),
    ),
    "nonfinite": KindInfo(
        "Non-finite gradients",
        "holds non-finite values (NaN/Inf)",
        ("nonfinite", "n_records", "first_record"),
        ("Find the source: the first record and source named here; re-run that batch in fp32 with anomaly "
         "detection to locate the op.",
         "Use dynamic loss scaling in fp16; skip (do not apply) a step whose gradient is non-finite, and "
         "restart from before a loss spike with the offending batches skipped."),
        ("Micikevicius et al. 2018, Mixed Precision Training (loss scaling)",
         "Chowdhery et al. 2022, PaLM (restart and skip batches around spikes)"),
    ),
    "loss_spectrum": KindInfo(
        "Periodic loss / gradient norm",
        "the per-record series (loss or gradient norm) is periodic",
        ("period_steps", "power", "p_value"),
        ("A peak at a fixed period in steps is usually data order: shards, epochs or a sorted-by-length "
         "loader repeating; shuffle across shards and check the period against the shard size.",
         "A peak at the LR schedule's period (restarts, cyclic LR) is the schedule; align or remove it.",
         "A peak at the gradient-accumulation or logging interval is an artefact of how the loss was measured."),
        ("Welch 1967, spectral estimation; peaks tested against an AR(1) red-noise background",),
    ),
}


def info(kind: str) -> KindInfo:
    return KINDS.get(kind, KindInfo(kind, kind.replace("_", " "), (), ()))


def phrase(kind: str, sources: tuple[str, ...]) -> str:
    """The summary's verb phrase for *kind* with *sources* filled in."""
    text = info(kind).phrase
    if "{sources}" in text:
        return text.replace("{sources}", join_and(list(sources)) if sources else "the sources'")
    return text


def _is_qk(flag: Flag) -> bool:
    from gradforensics.report.names import parse

    mod = parse(flag.tensor).module
    return flag.evidence.get("role") in ("q", "k") or mod in ("q_proj", "k_proj", "query", "key", "wq", "wk")


#: Kinds whose statistic reads the record axis as time.
TIME_KINDS = ("drift", "oscillation", "loss_spectrum")


def advice_for(kind: str, flags: list[Flag], mode: str = "training", n_sources: int = 1) -> list[str]:
    """Remedies for a group of flags of one kind, most specific first.

    In a ``replay`` store the record axis is not time: batches were replayed
    through one checkpoint, round-robin over the sources, so a time-based
    finding there first gets that caveat.
    """
    items = list(info(kind).advice)
    if kind == "spectral" and flags and not any(_is_qk(f) for f in flags):
        items = items[1:] + items[:1]           # QK-norm is not the first thing to try on an MLP
    if mode == "replay" and kind in TIME_KINDS:
        rr = (f" round-robin over the {n_sources} sources, so a period of {n_sources} records is the replay order"
              if n_sources > 1 else "")
        items.insert(0, "Caveat: this store is a replay (batches replayed through one checkpoint"
                        f"{rr}); the record axis is not training time. Confirm on a training-mode capture "
                        "before acting on a time-based finding.")
    return items


def references_for(kind: str) -> list[str]:
    return list(info(kind).references)
