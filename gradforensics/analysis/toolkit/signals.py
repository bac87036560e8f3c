"""Every per-record series a store holds, as named signals for the timeline (:mod:`.departure`).

One :class:`Signal` per series: the loss (and each source's loss, when records are tagged with
one source), the gradient norm of each tensor and head (from the Gram matrices' diagonals, read
once by the pass), per attention head the max logit and the mean entropy, per output-logit module
the mean log Z, per module the dead share and the excess kurtosis of its activations, per
optimizer-tracked tensor the update/weight ratio, the largest g²/v̂ and the share of stale rows,
and per router the largest expert share; from the run's own logs (``batches/*`` of a store imported
with ``--logs``, or ``analyze --logs``: ``Context.run_log``) the loss scale and the gradient norm the
run logged.  Each carries the scale its changes are compared on and the direction in which a
departure is trouble.  The logged learning rate is not a signal: it is the run's plan (warmup,
decay), so its changes are not departures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gradforensics.store.reader import Store

__all__ = ["LABELS", "LOGGED", "OPENING", "SHEWHART", "Signal", "collect"]

#: signal -> (what it is, in words; comparison scale; direction of trouble; the least change that counts as
#: one robust standard deviation, in units of the scale: 0.1 on ``log`` is 10 %, 1.0 on an attention logit
#: is one logit unit (softmax weights move with absolute logit differences), 0.02 on a share is 2 points)
LABELS: dict[str, tuple[str, str, int, float]] = {
    "loss": ("loss", "log", 1, 0.05),
    "grad_norm": ("gradient norm", "log", 1, 0.1),
    "attn_max_logit": ("max attention logit", "linear", 1, 1.0),
    "attn_entropy": ("mean attention entropy", "linear", -1, 0.05),
    "logz": ("mean log Z of the output logits", "linear", 1, 0.5),
    "dead_share": ("share of dead units", "linear", 1, 0.02),
    "kurtosis": ("excess kurtosis of the activations", "log3", 1, 0.1),
    "update_ratio": ("update/weight ratio", "log", 1, 0.1),
    "ratio_max": ("largest g²/v̂ (Adam)", "log", 1, 0.3),
    "stale_share": ("share of stale rows (Adam)", "linear", 1, 0.02),
    "router_max_share": ("largest expert share of the router", "linear", 1, 0.02),
    # one robust sd = one halving: a dynamic scaler's one or two backoffs (z <= the CUSUM's allowance of 2)
    # never depart; a fall by 8x or more that stays does
    "loss_scale": ("loss scale (run log)", "log", -1, math.log(2.0)),
    "logged_grad_norm": ("gradient norm logged by the run", "log", 1, 0.1),
}
#: ``batches/*`` (or ``Context.run_log``) of the run's own logs -> signal
LOGGED = {"loss_scale": "loss_scale", "logged_grad_norm": "logged_grad_norm"}


#: The signals that may depart in one record (shares: a Shewhart limit beside the CUSUM).
SHEWHART = frozenset({"dead_share", "stale_share", "router_max_share"})
#: The signals whose level at initialisation is their healthy level (attention: growth of the logits from the
#: first steps is the trouble), also tested against their frozen opening level (:func:`.departure.departures`).
OPENING = frozenset({"attn_max_logit", "attn_entropy"})


@dataclass(frozen=True)
class Signal:
    """One per-record series: ``signal`` (a key of :data:`LABELS`), where (``tensor``, ``head``,
    ``source``), and its ``values`` (N,), NaN where the record has none."""

    signal: str
    tensor: str
    head: int | None
    source: str | None
    values: np.ndarray

    @property
    def how(self) -> str:
        """The comparison scale: :data:`LABELS`'s, ``linear`` for a log-scale series with a value <= 0."""
        how = LABELS[self.signal][1]
        v = self.values[np.isfinite(self.values)]
        return "linear" if how == "log" and v.size and v.min() <= 0 else how

    @property
    def direction(self) -> int:
        return LABELS[self.signal][2]

    @property
    def shewhart(self) -> bool:
        """Whether one record may depart alone (a share's jump; :func:`~.departure.departures`)."""
        return self.signal in SHEWHART

    @property
    def opening(self) -> bool:
        """Whether it is also tested against its frozen opening level (:data:`OPENING`)."""
        return self.signal in OPENING

    @property
    def floor(self) -> float:
        """The least robust scale (:data:`LABELS`): a fixed share of the level on a log scale turned linear."""
        if self.how == LABELS[self.signal][1]:
            return LABELS[self.signal][3]
        v = np.abs(self.values[np.isfinite(self.values)])
        return LABELS[self.signal][3] * (float(np.median(v)) if v.size and np.median(v) > 0 else 1.0)

    @property
    def label(self) -> str:
        where = self.tensor + (f" head {self.head}" if self.head is not None else "") + \
            (f" [{self.source}]" if self.source else "")
        return f"{LABELS[self.signal][0]} of {where}" if self.tensor else f"{LABELS[self.signal][0]}" + \
            (f" [{self.source}]" if self.source else "")


def _per_source_loss(loss: np.ndarray, mixture: np.ndarray, sources: tuple[str, ...]) -> list[Signal]:
    if len(sources) < 2 or mixture.ndim != 2 or mixture.shape[1] != len(sources):
        return []
    pure = np.isclose(mixture.max(axis=1), 1.0)
    which = np.argmax(mixture, axis=1)
    out = []
    for j, name in enumerate(sources):
        mine = pure & (which == j)
        if mine.sum() >= 2:
            out.append(Signal("loss", "", None, name, np.where(mine, loss, np.nan)))
    return out


def collect(store: Store | None, batches: Mapping[str, np.ndarray], sources: tuple[str, ...],
            norms: Mapping[tuple[str, int | None], np.ndarray], n: int) -> list[Signal]:
    """Every signal of the store (and the given gradient *norms*, per (tensor, head)) over *n* records."""
    out: list[Signal] = []
    loss = np.asarray(batches.get("loss", np.full(n, np.nan)), np.float64)
    if np.isfinite(loss).any():
        out.append(Signal("loss", "", None, None, loss))
        mix = np.asarray(batches.get("mixture", np.zeros((n, 0))), np.float64)
        out += _per_source_loss(loss, mix, sources)
    for (tensor, head), v in sorted(norms.items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1])):
        out.append(Signal("grad_norm", tensor, head, None, np.asarray(v, np.float64)))
    for key, signal in LOGGED.items():
        if key in batches:
            v = np.asarray(batches[key], np.float64).reshape(-1)
            if np.isfinite(v).any():
                out.append(Signal(signal, "", None, None, v))
    if store is None:
        return out
    for m in store.attn_modules:
        for stat, signal in (("max_logit", "attn_max_logit"), ("entropy_mean", "attn_entropy")):
            a = np.asarray(store.attn(m, stat), np.float64)
            out += [Signal(signal, m, h, None, a[:, h]) for h in range(a.shape[1])]
    for m in store.logit_modules:
        out.append(Signal("logz", m, None, None, np.asarray(store.logits(m, "logz_mean"), np.float64)))
    for m in store.act_modules:
        if store.has(f"acts/{m}/dead"):
            out.append(Signal("dead_share", m, None, None, np.asarray(store.act(m, "dead"), np.float64).mean(axis=1)))
        if store.has(f"acts/{m}/kurtosis"):
            out.append(Signal("kurtosis", m, None, None, np.asarray(store.act(m, "kurtosis"), np.float64)[:, 0]))
    out += _optimizer(store)
    for key in sorted(k for k in store.arrays if k.startswith("router/") and k.endswith("/max_share")):
        a = np.asarray(store.read(key), np.float64)
        out.append(Signal("router_max_share", key[len("router/"):-len("/max_share")], None, None,
                          a if a.ndim == 1 else a.max(axis=tuple(range(1, a.ndim)))))
    return [s for s in out if s.values.shape == (n,)]


def _optimizer(store: Store) -> list[Signal]:
    """Update/weight ratio and the largest g²/v̂ per tensor (``optim_live/summary``), the stale-row share."""
    out: list[Signal] = []
    if not store.has("optim_live/summary"):
        return out
    info = store.arrays["optim_live/summary"]
    tensors, fields = list(info.attrs.get("tensors", [])), list(info.attrs.get("fields", []))
    summary = np.asarray(store.read("optim_live/summary"), np.float64)
    if summary.ndim != 3 or summary.shape[1:] != (len(tensors), len(fields)):
        return out
    for field, signal in (("update_ratio", "update_ratio"), ("ratio_max", "ratio_max")):
        if field in fields:
            j = fields.index(field)
            out += [Signal(signal, t, None, None, summary[:, i, j]) for i, t in enumerate(tensors)]
    for t in tensors:
        key = f"optim_live/{t}/stale"
        if store.has(key):
            stale = np.asarray(store.read(key), np.float64)
            out.append(Signal("stale_share", t, None, None, stale.reshape(stale.shape[0], -1).mean(axis=1)))
    return out
