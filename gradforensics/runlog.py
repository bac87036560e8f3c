"""A training run's own logs (TensorBoard event files, a trainer's log history) as per-iteration series.

``gradforensics import SOURCE --logs DIR`` joins what the run logged to the records it
imports: the loss, the learning rate, the gradient norm the run computed and, for a
fp16 run, the dynamic loss scale (with which the dumped gradients are unscaled) and the
iterations the scaler skipped.  :func:`read_run_log` reads a directory (or one file):

* TensorBoard event files (``events.out.tfevents.*``, as ``torch.utils.tensorboard``'s
  ``SummaryWriter`` writes them for Megatron-LM and the Hugging Face Trainer) through
  TensorBoard's own reader (``tensorboard.backend.event_processing``), scalars only;
  several files (a restarted run) are merged by step, the later-written value winning;
* a Hugging Face ``trainer_state.json`` ``log_history`` (the capped reader of
  :mod:`gradforensics.importing.trainer_state`).

Tags are found by the table :data:`TAGS` (Megatron-LM's ``megatron/training/training.py``
``training_log`` writes ``lm loss``, ``learning-rate``, ``loss-scale``, ``grad-norm``;
the HF Trainer ``train/loss``, ``train/learning_rate``, ``train/grad_norm``).

**Skipped iterations.**  A mixed-precision optimizer that finds an inf/NaN gradient skips
the step, returns no gradient norm (Megatron-LM's ``MixedPrecisionOptimizer.step`` returns
``grad_norm=None``, so ``training_log`` writes no ``grad-norm`` that iteration) and, after
its hysteresis, halves the loss scale.  An iteration is marked skipped when the run logs a
gradient norm at all but not at that iteration while it logged the loss there, or when the
loss scale falls at it.  Logs are data: anything unreadable is one
:class:`~gradforensics.errors.LogReadError` line.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gradforensics.errors import LogReadError

__all__ = ["EVENT_FILE", "MAX_EVENT_FILES", "SERIES", "TAGS", "RunLog", "read_run_log"]


#: The series a run log yields, in this order.
SERIES = ("loss", "lr", "grad_norm", "loss_scale")
#: Tags (TensorBoard) and keys (trainer log history) of each series, first found wins.
TAGS: Mapping[str, tuple[str, ...]] = {
    "loss": ("lm loss", "train/loss", "loss", "train_loss", "train/CE loss"),
    "lr": ("learning-rate", "train/learning_rate", "learning_rate", "lr", "optim/LR (group 0)"),
    "grad_norm": ("grad-norm", "train/grad_norm", "grad_norm", "optim/total grad norm"),
    "loss_scale": ("loss-scale", "train/loss_scale", "loss_scale"),
}
#: TensorBoard event files are named ``events.out.tfevents.<time>.<host>...``.
EVENT_FILE = "events.out.tfevents."
#: at most this many event files are read under one directory (a restarted run writes one per start)
MAX_EVENT_FILES = 1000
_DEPTH = 3          # how deep under DIR event files and trainer_state.json are looked for


@dataclass(frozen=True)
class RunLog:
    """Per-iteration series of a run's logs.

    Attributes
    ----------
    steps
        The logged iterations, sorted, int64.
    values
        ``{series: float64 array aligned with steps}`` for each series in :data:`SERIES` that was
        found (NaN at iterations where it was not logged).
    skipped
        bool, aligned with *steps*: iterations a loss scaler skipped (see the module text).
    origin
        ``{series: "tag (file kind)"}``: where each series came from, for ``inspect`` and the docs.
    """

    steps: np.ndarray
    values: dict[str, np.ndarray]
    skipped: np.ndarray
    origin: dict[str, str] = field(default_factory=dict)

    def at(self, step: int) -> tuple[dict[str, float], bool]:
        """The logged values at iteration *step* (NaN where not logged) and whether it was skipped."""
        i = int(np.searchsorted(self.steps, step))
        if i < self.steps.size and self.steps[i] == step:
            return {k: float(v[i]) for k, v in self.values.items()}, bool(self.skipped[i])
        return dict.fromkeys(self.values, math.nan), False

    def scale_used(self, step: int) -> float:
        """The loss scale iteration *step*'s backward pass used.

        A trainer logs the scale after its optimizer step has updated it (Megatron-LM's ``train`` reads
        ``optimizer.get_loss_scale()`` after ``train_step``), so the scale a backward pass used is the
        one logged at the iteration before.  Where that iteration was not logged (the first one, or a
        log interval above 1) the scale logged at *step* itself is taken: the same unless the scaler
        grew at exactly that iteration (once per growth window, 1000 iterations by default; a backoff
        marks the iteration skipped anyway), which the gradient-norm check then shows.
        """
        v = self.values.get("loss_scale")
        if v is None:
            return math.nan
        for s in (step - 1, step):
            i = int(np.searchsorted(self.steps, s))
            if i < self.steps.size and self.steps[i] == s and math.isfinite(v[i]):
                return float(v[i])
        return math.nan

    def join(self, steps: np.ndarray) -> dict[str, np.ndarray]:
        """What the run logged at each of *steps* (a store's ``batches/step``), by step: per series of
        :data:`SERIES` found, float64 aligned with *steps*, NaN where that step was not logged; and
        ``skipped`` (bool, False where not logged).  ``analyze --logs`` joins a run's logs to a store this way."""
        steps = np.asarray(steps, np.int64).reshape(-1)
        if not self.steps.size:
            return {**{k: np.full(steps.size, np.nan) for k in self.values}, "skipped": np.zeros(steps.size, bool)}
        i = np.minimum(np.searchsorted(self.steps, steps), self.steps.size - 1)
        hit = self.steps[i] == steps
        out = {k: np.where(hit, v[i], np.nan) for k, v in self.values.items()}
        out["skipped"] = hit & self.skipped[i]
        return out

    @property
    def has_loss_scale(self) -> bool:
        """Whether the run logged a loss scale (a fp16 run with a dynamic or static scaler)."""
        return "loss_scale" in self.values


def read_run_log(path: str | os.PathLike[str]) -> RunLog:
    """Read the run's logs under *path* (a directory, an event file, or a ``trainer_state.json``).

    Raises
    ------
    LogReadError
        Nothing readable there, a file that is not what its name says, or no series of :data:`TAGS`.
    """
    root = Path(path)
    if not root.exists():
        raise LogReadError(f"--logs {root}: no such file or directory.")
    events, states = _find(root)
    if not events and not states:
        raise LogReadError(f"--logs {root}: no TensorBoard event file ({EVENT_FILE}*) and no trainer_state.json "
                           f"within {_DEPTH} levels.")
    points: dict[str, dict[int, tuple[float, float]]] = {}   # tag -> step -> (wall time, value)
    for f in events:
        _read_events(f, points)
    for f in states:
        _read_state(f, points)
    return _assemble(root, points, events, states)


# ------------------------------------------------------------------ files
def _find(root: Path) -> tuple[list[Path], list[Path]]:
    if root.is_file():
        if root.name.startswith(EVENT_FILE):
            return [root], []
        if root.suffix == ".json":
            return [], [root]
        raise LogReadError(f"--logs {root}: not a TensorBoard event file ({EVENT_FILE}*) or a trainer_state.json.")
    events: list[Path] = []
    states: list[Path] = []
    for d, dirs, files in os.walk(root):
        depth = len(Path(d).relative_to(root).parts)
        if depth >= _DEPTH:
            dirs[:] = []
        dirs.sort()
        for name in sorted(files):
            p = Path(d) / name
            if name.startswith(EVENT_FILE):
                events.append(p)
            elif name == "trainer_state.json":
                states.append(p)
    if len(events) > MAX_EVENT_FILES:
        raise LogReadError(f"--logs {root}: {len(events)} event files, more than the {MAX_EVENT_FILES} read; "
                           "point --logs at the run's own TensorBoard directory.")
    # a checkpoint series repeats trainer_state.json in every checkpoint-N/: the newest (longest) holds them all
    states = sorted(states, key=lambda p: p.stat().st_size)[-1:] if states else []
    return events, states


def _scalars(file: Path) -> Iterator[tuple[str, int, float, float]]:
    """``(tag, step, wall_time, value)`` of every scalar in one event file, through TensorBoard's reader."""
    from gradforensics._extras import require_extra

    require_extra("tensorboard", "reading TensorBoard event files (--logs)")
    from google.protobuf.message import DecodeError
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    from gradforensics.replay.untrusted import check_regular

    check_regular(file, LogReadError)
    try:
        for event in EventFileLoader(str(file)).Load():
            if not event.HasField("summary"):
                continue
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "scalars" or not value.HasField("tensor"):
                    continue
                arr = tensor_util.make_ndarray(value.tensor)
                if arr.size == 1:
                    yield value.tag, int(event.step), float(event.wall_time), float(arr.reshape(-1)[0])
    except (DecodeError, ValueError, TypeError, OSError) as exc:
        raise LogReadError(f"{file}: not a readable TensorBoard event file ({type(exc).__name__}: {exc}).") from None


def _read_events(file: Path, points: dict[str, dict[int, tuple[float, float]]]) -> None:
    wanted = {t for tags in TAGS.values() for t in tags}
    for tag, step, wall, value in _scalars(file):
        if tag in wanted:
            seen = points.setdefault(tag, {})
            if step not in seen or wall >= seen[step][0]:     # a restart re-logs steps: the later run is kept
                seen[step] = (wall, value)


def _read_state(file: Path, points: dict[str, dict[int, tuple[float, float]]]) -> None:
    from gradforensics.errors import CheckpointError
    from gradforensics.importing.trainer_state import read_log_history

    try:
        history = read_log_history(file)
    except CheckpointError as exc:
        raise LogReadError(str(exc)) from None
    for step, entry in (history or {}).items():
        for key, value in entry.items():
            points.setdefault(f"{key} (trainer_state)", {}).setdefault(step, (-math.inf, value))


def _assemble(root: Path, points: Mapping[str, Mapping[int, tuple[float, float]]], events: list[Path],
              states: list[Path]) -> RunLog:
    chosen: dict[str, tuple[str, Mapping[int, tuple[float, float]]]] = {}
    for series, tags in TAGS.items():
        for tag in tags:
            for key in (tag, f"{tag} (trainer_state)"):
                if key in points and points[key] and series not in chosen:
                    chosen[series] = (key, points[key])
    if not chosen:
        found = sorted(points) or ["none"]
        raise LogReadError(f"--logs {root}: none of the tags {sorted({t for v in TAGS.values() for t in v})} "
                           f"found ({len(events)} event files, {len(states)} trainer_state.json; tags read: "
                           f"{', '.join(found[:8])}).")
    steps = np.array(sorted({s for _, p in chosen.values() for s in p}), dtype=np.int64)
    index = {int(s): i for i, s in enumerate(steps)}
    values: dict[str, np.ndarray] = {}
    for series, (_, p) in chosen.items():
        v = np.full(steps.size, np.nan)
        for s, (_, x) in p.items():
            v[index[s]] = x
        values[series] = v
    kinds = {k: tag.endswith("(trainer_state)") for k, (tag, _) in chosen.items()}
    same = "grad_norm" in kinds and "loss" in kinds and kinds["grad_norm"] == kinds["loss"]
    return RunLog(steps=steps, values=values, skipped=_skipped(values, same),
                  origin={k: tag for k, (tag, _) in chosen.items()})


def _skipped(values: Mapping[str, np.ndarray], same_file_kind: bool) -> np.ndarray:
    n = next(iter(values.values())).size
    skipped = np.zeros(n, bool)
    if "grad_norm" in values and "loss" in values and same_file_kind:
        skipped |= np.isnan(values["grad_norm"]) & np.isfinite(values["loss"])
    if "loss_scale" in values:
        scale = values["loss_scale"]
        prev = np.concatenate([[np.nan], scale[:-1]])
        with np.errstate(invalid="ignore"):
            skipped |= scale < prev
    return skipped
