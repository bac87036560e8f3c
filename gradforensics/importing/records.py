"""Write an imported history through the store writer: one training-mode record per interval or iteration.

:class:`ImportWriter` is what both importers (a checkpoint series, Megatron-LM dumps)
hand their records to.  A record is ``grads`` (tensor name -> array: the update of
an interval, or a dumped gradient), the batch metadata (step, loss, lr, n_samples,
time) and any number of weight snapshots taken at it.  Arrays are stored as they
come (float32, float16, bfloat16 as its bit patterns: lossless); head-split
tensors get the layout of :mod:`gradforensics.store.heads`.  The size of the whole
import is printed before the store is created (and refused when the disk cannot hold
it, unless ``force``); a progress bar follows.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from gradforensics.store.heads import HeadSpec
from gradforensics.store.pause import pause_point
from gradforensics.store.schema import batch_path, grad_path, new_meta, weight_path
from gradforensics.store.writer import Row, StoreWriter

if TYPE_CHECKING:
    import torch

__all__ = ["IMPORT_REFUSAL", "SOURCE", "ImportWriter", "Interval", "as_array"]


#: The store's one data source: an imported history has no per-source batches.
SOURCE = "run"
IMPORT_REFUSAL = ("{path} needs ~{total} but only {free} is free; import fewer --tensors, or pass --force.")


@dataclass(frozen=True)
class Interval:
    """The batch metadata of one imported record."""

    step: int
    loss: float = math.nan
    lr: float = math.nan
    n_samples: int = 1
    time: float = math.nan
    #: from the run's own logs (``--logs``): the loss scale, the gradient norm the run logged, a skipped step
    loss_scale: float = math.nan
    logged_grad_norm: float = math.nan
    skipped: bool = False


def as_array(t: torch.Tensor | np.ndarray) -> tuple[np.ndarray, str, str]:
    """A tensor as ``(stored array, encoding, source dtype)``, lossless where the store can hold its dtype.

    float32 and float16 stay themselves, bfloat16 becomes its uint16 bit patterns;
    float64 (and any other floating type) is stored as float32.
    """
    import torch

    if isinstance(t, np.ndarray):
        t = torch.from_numpy(t)
    t = t.detach().cpu()
    name = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16), "bfloat16-as-uint16", name
    if t.dtype in (torch.float32, torch.float16):
        arr = t.contiguous().numpy()
        return arr, "float32" if t.dtype == torch.float32 else "float16", name
    return t.to(torch.float32).contiguous().numpy(), "float32", name


class ImportWriter:
    """The store an import writes: ``mode="training"``, one source (:data:`SOURCE`).

    Parameters
    ----------
    out
        Store path or fsspec URL (``*.zarr``, ``*.h5``).
    heads
        ``{tensor: HeadSpec}`` of the head-split tensors (resolved by the importer).
    total
        Records the import will write (for the estimate and the progress bar).
    per_record
        Bytes each record adds, by part (``{"grads": ..., "weights": ...}``): the estimate is
        printed, and checked against the free disk, before the store is created.
    framework, model_info, extra
        Root attributes; ``extra["import"]`` says where the history came from.
    quiet
        No estimate line, no progress bar (else on *file*, default stderr).
    force
        Write even when the estimate exceeds the free disk.
    logged
        The import joins the run's own logs: every record also gets ``batches/skipped``,
        ``batches/loss_scale`` and ``batches/logged_grad_norm``.
    grad_attrs
        ``{tensor: attributes}`` added to a gradient array's own (an OLMo-core sampled gradient's
        ``partial`` and ``partial_region``).
    experts
        ``{tensor: E}`` of the mixture-of-experts units: ``(E, ...)`` gradients stored ``(N, E, ...)`` with the
        attribute ``experts``, as capture stores them (:mod:`gradforensics.recording.experts`).
    """

    def __init__(self, out: str | os.PathLike[str], *, heads: Mapping[str, HeadSpec], total: int,
                 per_record: Mapping[str, int], framework: str, model_info: Mapping[str, Any], extra: Mapping[str, Any],
                 overwrite: bool = False, storage_options: Mapping[str, Any] | None = None,
                 quiet: bool = False, force: bool = False, file: IO[str] | None = None, logged: bool = False,
                 grad_attrs: Mapping[str, Mapping[str, Any]] | None = None,
                 experts: Mapping[str, int] | None = None) -> None:
        from gradforensics.replay.run import Progress

        meta = new_meta([SOURCE], "training", framework, dict(model_info), dict(extra))
        self.heads = dict(heads)
        self.grad_attrs = {k: dict(v) for k, v in (grad_attrs or {}).items()}
        self.experts = dict(experts or {})
        self.logged = logged
        self.total = total
        self.force = force
        self.say = None if quiet else (file or sys.stderr)
        self._estimate(out, dict(per_record))
        # One record a flush: every record is committed once written, so a kill loses only the one being read
        # (a record costs a checkpoint's load; a Recorder's flushes of up to 64 are for a training loop's pace).
        self.writer = StoreWriter(out, meta, overwrite=overwrite, storage_options=storage_options,
                                  records_per_chunk=1, expected_records=total)
        self.location = self.writer.location
        self.bar = Progress(total, self.say)
        self.n = 0

    def __enter__(self) -> ImportWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Close; an import that fails before its first record removes the empty store it created, so the
        rerun on a fixed source is not refused by it."""
        try:
            self.close()
        finally:
            if exc_type is not None:
                self.writer.discard_if_empty()

    def record(self, interval: Interval, grads: Mapping[str, Any],
               weights: Sequence[Mapping[str, Any]] = (), rows: Mapping[str, Row] | None = None) -> None:
        """Write one record: its gradients (or updates), the weight snapshots taken at it, and *rows* (other
        per-record arrays by store path: activation statistics, ``acts/<module>/<stat>``)."""
        out = self._meta_rows(interval)
        for name, g in grads.items():
            out[grad_path(name)] = self._grad_row(name, g)
        out.update(rows or {})
        snaps = [{weight_path(k): self._weight_row(w) for k, w in snap.items()} for snap in weights]
        for snap in snaps[:-1]:
            self.writer.snapshot(snap)
        self.writer.append(out, snaps[-1] if snaps else None)
        self.n += 1
        self.bar.update(self.n)
        pause_point("import-record")

    def annotate(self, **entries: Any) -> None:
        """Add *entries* to the root attributes' ``extra["import"]`` (written with the next commit; NaN as null)."""
        from dataclasses import replace

        meta = self.writer.meta
        extra = {**meta.extra, "import": {**meta.extra.get("import", {}), **_json_safe(entries)}}
        self.writer.meta = replace(meta, extra=extra)

    def close(self) -> None:
        try:
            self.writer.close()
        finally:
            if self.n:
                self.bar.close()

    # ---------------------------------------------------------------- rows
    def _meta_rows(self, iv: Interval) -> dict[str, Row]:
        values = {"step": np.int64(iv.step), "loss": np.float32(iv.loss), "mixture": np.ones(1, np.float32),
                  "n_samples": np.int32(iv.n_samples), "rank": np.int32(0), "lr": np.float32(iv.lr),
                  "time": np.float64(iv.time)}
        if self.logged:
            values.update(skipped=np.uint8(iv.skipped), loss_scale=np.float32(iv.loss_scale),
                          logged_grad_norm=np.float32(iv.logged_grad_norm))
        return {batch_path(k): Row(np.asarray(v)) for k, v in values.items()}

    def _grad_row(self, name: str, g: Any) -> Row:
        data, encoding, source_dtype = as_array(g)
        spec = self.heads.get(name)
        attrs: dict[str, Any] = {"encoding": encoding, "source_dtype": source_dtype, "shape": list(data.shape),
                                 **self.grad_attrs.get(name, {})}
        e = self.experts.get(name)
        if e is not None:
            return Row(data, {**attrs, "experts": e}, head_split=True)
        if spec is None:
            return Row(data, attrs)
        return Row(spec.split(data), {**attrs, **spec.attrs()}, head_split=True)

    @staticmethod
    def _weight_row(w: Any) -> Row:
        data, encoding, source_dtype = as_array(w)
        return Row(data, {"encoding": encoding, "source_dtype": source_dtype})

    def _estimate(self, out: Any, per: dict[str, int]) -> None:
        """The size line, and the refusal when the disk cannot hold the import (before anything is written)."""
        from gradforensics.replay.plan import check_disk

        per["total"] = sum(per.values())
        check_disk(per, self.total, out, force=self.force, say=self.say, refusal=IMPORT_REFUSAL)

def _json_safe(v: Any) -> Any:
    """*v* with every non-finite float as ``None`` (JSON has no NaN)."""
    if isinstance(v, Mapping):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    return v
