"""Replay: per-source gradients of a fixed (problem) checkpoint.

``replay(model, batches_by_source, loss_fn, path, n_per_source=...)`` runs
batches from every data source through the model *as it is* - no optimizer
step, ``model.zero_grad()`` before every batch - and records one gradient per
batch into a ``mode="replay"`` store.  Sources are interleaved round-robin
(``a, b, c, a, b, c, ...``) so that any drift in the process (a cache warming
up, a data loader changing) is spread over all sources alike rather than
confounded with one of them.

Because nothing changes between records, the records of one source are
independent draws of that source's minibatch gradient at the checkpoint: their
mean is the source's expected gradient and their spread its noise, which is
what the ``conflict`` and ``noise`` analyses need.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO, TYPE_CHECKING, Any

from gradforensics._format import fmt_bytes
from gradforensics.errors import SpecError
from gradforensics.recording.torch import TorchRecorder
from gradforensics.replay.plan import exceeds_disk, size_estimate

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gradforensics.replay.probe import CheckpointProbe
    from gradforensics.store.reader import Store

__all__ = ["Progress", "batch_size", "interleave", "replay"]



def batch_size(batch: Any) -> int:
    """Examples in *batch*: the leading dimension of its first tensor (dicts, tuples, lists)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, Mapping):
        items: Iterable[Any] = batch.values()
    elif isinstance(batch, (tuple, list)):
        items = batch
    else:
        return 1
    for item in items:
        if isinstance(item, (torch.Tensor, Mapping, tuple, list)):
            return batch_size(item)
    return 1


def interleave(batches_by_source: Mapping[str, Iterable[Any]],
               n_per_source: int | Mapping[str, int]) -> Iterator[tuple[str, Any]]:
    """``(source, batch)`` round-robin over the sources, up to ``n_per_source`` each.

    A source that runs out early drops out (with a warning); the others go on.
    """
    quota = {s: int(n_per_source[s] if isinstance(n_per_source, Mapping) else n_per_source)
             for s in batches_by_source}
    its = {s: iter(b) for s, b in batches_by_source.items()}
    done = {s: 0 for s in its}
    live = [s for s in its if quota[s] > 0]
    while live:
        for s in list(live):
            try:
                batch = next(its[s])
            except StopIteration:
                warnings.warn(f"replay: source {s!r} ran out after {done[s]} of {quota[s]} batches.",
                              RuntimeWarning, stacklevel=3)
                live.remove(s)
                continue
            done[s] += 1
            if done[s] >= quota[s]:
                live.remove(s)
            yield s, batch


class Progress:
    """A one-line text progress bar: ``[#####.....] 12/40 records, 3.1/s, ~9 s left``."""

    def __init__(self, total: int, file: IO[str] | None = None, width: int = 30, every_s: float = 0.2) -> None:
        self.total, self.file, self.width, self.every_s = max(total, 1), file, width, every_s
        self.t0 = time.perf_counter()
        self._last = -math.inf
        self.n = 0

    def update(self, n: int) -> None:
        self.n = n
        now = time.perf_counter()
        if self.file is None or (now - self._last < self.every_s and n < self.total):
            return
        self._last = now
        rate = n / max(now - self.t0, 1e-9)
        filled = int(self.width * min(n, self.total) / self.total)
        left = (self.total - n) / rate if rate > 0 else math.inf
        eta = f"~{left:.0f} s left" if math.isfinite(left) else ""
        print(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {n}/{self.total} records, {rate:.1f}/s, {eta}  ",
              end="", file=self.file, flush=True)

    def close(self) -> None:
        if self.file is not None:
            print(file=self.file, flush=True)


def _announce(est: dict[str, float], path: str, file: IO[str] | None, check_space: bool = True) -> None:
    line = (f"gradforensics replay -> {path}: {int(est['n_records'])} records x "
            f"~{fmt_bytes(est['bytes_per_record'])} = ~{fmt_bytes(est['total_bytes'])}; "
            f"{fmt_bytes(est['free_bytes'])} free on that disk.")
    if file is not None:
        print(line, file=file, flush=True)
    if check_space and exceeds_disk(est, path):
        raise SpecError(
            f"replay: {path} would need ~{fmt_bytes(est['total_bytes'])} but only "
            f"{fmt_bytes(est['free_bytes'])} is free; lower n_per_source, record fewer tensors= or use sketch=."
        )


def replay(model: nn.Module, batches_by_source: Mapping[str, Iterable[Any]],
           loss_fn: Callable[[nn.Module, Any], torch.Tensor], path: str | os.PathLike[str], *,
           n_per_source: int | Mapping[str, int] = 32, step: int = 0,
           n_samples: Callable[[Any], int] | None = None, progress: bool = True,
           file: IO[str] | None = None, check_space: bool = True, probe: CheckpointProbe | None = None,
           announce: bool = True,
           **recorder_kwargs: Any) -> Store:
    """Capture per-batch gradients of *model* at a fixed checkpoint, per data source.

    Parameters
    ----------
    model
        The checkpoint, loaded; it is left unchanged (no optimizer step) and in
        the train/eval mode it was given in (dropout on or off is your choice).
    batches_by_source
        ``{source: iterable of batches}``; the keys become the store's sources.
    loss_fn
        ``loss_fn(model, batch) -> scalar tensor``.
    path
        ``*.zarr`` or ``*.h5`` store to write (``mode="replay"``).
    n_per_source
        Batches per source (an int, or ``{source: n}``).
    step
        Optimizer step of the checkpoint, written to ``batches/step``.
    n_samples
        ``n_samples(batch) -> int``; default :func:`batch_size`.
    progress
        Print the size estimate and a progress bar on *file* (default stderr).
    check_space
        Refuse (``SpecError``) when the estimate exceeds the free disk space;
        ``False`` only prints it (``gradforensics capture --force``).
    probe
        A :class:`~gradforensics.replay.probe.CheckpointProbe` (``--curvature``): it sees
        every batch after its backward, and writes ``curvature/`` and ``optim/`` once the
        records are committed.
    announce
        Print the size estimate measured on the first record (with *progress*); ``False``
        when the caller printed its own estimate already (``gradforensics capture``).
    **recorder_kwargs
        Passed to :class:`~gradforensics.recording.torch.TorchRecorder`
        (``tensors``, ``heads``, ``activations``, ``sketch``, ``dtype``, ...).

    Returns
    -------
    Store
        The written store, opened for reading.

    Raises
    ------
    SpecError
        Bad options, or the estimated size exceeds the free disk space (raised
        after the first record, which is what the estimate is measured on).
    """
    from gradforensics.store.reader import open_store

    for key in ("sources", "mode", "model"):
        if key in recorder_kwargs:
            raise SpecError(f"replay(): {key}= is set by replay itself; do not pass it.")
    sources = list(batches_by_source)
    quota = {s: int(n_per_source[s] if isinstance(n_per_source, Mapping) else n_per_source) for s in sources}
    total = sum(quota.values())
    if not sources or total < 1:
        raise SpecError(f"replay(): nothing to record (sources {sources}, n_per_source {n_per_source!r}).")
    out = (file or sys.stderr) if progress else None
    count = n_samples or batch_size
    bar = Progress(total, out)
    recorder_kwargs.setdefault("expected_records", total)          # chunks sized for no padding at the end
    with TorchRecorder(path, model=model, sources=sources, mode="replay", **recorder_kwargs) as rec:
        for i, (source, batch) in enumerate(interleave(batches_by_source, quota)):
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            loss.backward()
            if probe is not None:
                probe.observe(model, source, batch)
            rec.record(step=step, loss=float(loss.detach()), source=source, n_samples=count(batch))
            if i == 0:
                rec.drain()
                _announce(size_estimate(rec.bytes_per_record or 0, total, path), str(path),
                          out if announce else None, check_space)
            bar.update(i + 1)
        model.zero_grad(set_to_none=True)
    bar.close()
    if rec.ranks is not None:
        rec.ranks.barrier()      # rank 0 has committed every rank's records: the store is complete
    if probe is not None:
        probe.finish(model, loss_fn, rec.location)
    return open_store(rec.location)
