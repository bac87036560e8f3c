"""What a capture is asked to do, checked once, and what it will cost on disk.

The options of ``gradforensics capture`` (and of ``gradforensics whatif``, which
takes the same ones) come in three groups, each a frozen dataclass validated once
in ``__post_init__`` (one-line :class:`~gradforensics.errors.SpecError`):

* :class:`BatchSpec` - which batches: ``--batches-per-source``, ``--batch-size``,
  ``--seq-len``, ``--text-field``, ``--seed``;
* :class:`RecordSpec` - what to record: ``--tensors``, ``--heads``,
  ``--activations``, ``--sketch``, ``--full``, ``--dtype``;
* :class:`ModelSpec` - how the checkpoint is loaded and run: ``--loss``,
  ``--model-factory``, ``--tokenizer``, ``--device``, ``--model-dtype``, ``--step``.

Everything after trusts them.  Against a loaded model, :func:`plan_record`
checks the globs and estimates a record's bytes (:func:`record_bytes`), and
:func:`check_disk` prints the estimate and refuses a capture the disk cannot hold.

Nothing heavy is imported here at module level (the command line builds its
parsers from these constants on every call); torch comes in only with a model.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    from torch import nn

    from gradforensics.store.heads import HeadSpec

__all__ = [
    "BUILTIN_LOSSES",
    "CAPTURE_REFUSAL",
    "DEFAULT_SEQ_LEN",
    "DEFAULT_SKETCH",
    "DTYPE_NAMES",
    "ITEMSIZE",
    "META_BYTES",
    "MODEL_DTYPES",
    "BatchSpec",
    "ModelSpec",
    "RecordSpec",
    "as_spec",
    "check_disk",
    "check_seq_len",
    "exceeds_disk",
    "fit_seq_len",
    "parse_heads",
    "plan_record",
    "record_bytes",
    "size_estimate",
]

#: ``--dtype`` names -> the on-disk gradient format.
DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16",
               "float16": "float16", "fp32": "float32", "f32": "float32", "float32": "float32"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
#: batches/step, loss, n_samples, rank, lr, time: 8 + 4 + 4 + 4 + 4 + 8 bytes; plus 4 per source (mixture).
META_BYTES = 32
#: Sketch length per tensor (per head) a what-if records by default (``capture`` stores whole tensors unless told).
DEFAULT_SKETCH = 1024
#: ``--model-dtype``: the parameters' dtype the checkpoint runs in.
MODEL_DTYPES = ("float32", "bfloat16", "float16")
#: ``--loss`` values besides ``module:function``.
BUILTIN_LOSSES = ("auto", "causal-lm", "causal-lm-skip-first", "masked-lm")
#: ``--seq-len`` when none is given: this, or the model's own limit when that is lower (:func:`fit_seq_len`).
DEFAULT_SEQ_LEN = 512
#: The refusal of :func:`check_disk` for ``capture`` (``{path}``, ``{total}``, ``{free}`` filled in).
CAPTURE_REFUSAL = ("{path} needs ~{total} but only {free} is free; record fewer --tensors, use --sketch K or "
                   "--dtype bf16, lower --batches-per-source, or pass --force.")


# ------------------------------------------------------------------ parsing
def parse_heads(specs: Sequence[str]) -> str | dict[str, Any] | None:
    """``--heads`` entries: auto, none, ``GLOB=H[:axis=A,fused=F,role=R]``, ``GLOB=none``, ``FILE.json``."""
    from gradforensics.recording.heads import parse_cli_heads

    return parse_cli_heads(specs)


def check_seq_len(seq_len: int, max_pos: int | None, where: str) -> None:
    """``--seq-len`` against the model's positions (*where*: where that number comes from)."""
    if seq_len < 2:
        raise SpecError(f"--seq-len must be >= 2; got {seq_len}.")
    if max_pos is not None and seq_len > max_pos:
        raise SpecError(f"--seq-len {seq_len} is beyond the model's {max_pos} positions ({where}); "
                        f"use --seq-len {max_pos} or less.")


def fit_seq_len(seq_len: int | None, limits: Sequence[tuple[int | None, str]]) -> tuple[int, str | None]:
    """The sequence length a capture packs, and the line that says why when it is not the one asked for.

    An explicit *seq_len* is kept (:func:`check_seq_len` refuses one beyond the
    positions).  ``None`` (no ``--seq-len``) is :data:`DEFAULT_SEQ_LEN`, or the
    lowest of *limits* - ``(length, where it comes from)`` pairs: the model's
    positions, the tokenizer's ``model_max_length`` (the length it was trained
    at) - when that is lower; the line then says so.
    """
    if seq_len is not None:
        return seq_len, None
    known = [(n, where) for n, where in limits if n is not None and 2 <= n < DEFAULT_SEQ_LEN]
    if not known:
        return DEFAULT_SEQ_LEN, None
    n, where = min(known)
    return n, (f"--seq-len {n}: the model's own limit ({where}), below the default {DEFAULT_SEQ_LEN}; "
               "pass --seq-len to choose another.")


def _globs(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """A glob or globs as a tuple (``None`` stays ``None``: the default selection)."""
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(str(v) for v in value)


# ------------------------------------------------------------------ the three option groups
@dataclass(frozen=True)
class BatchSpec:
    """Which batches: *batches_per_source* batches of *batch_size* packed sequences of *seq_len* tokens.

    *text_field* is the document field of ``.jsonl`` lines; *seed* seeds the batch
    draw (and masked-LM masking, dropout in a what-if).  ``gf.whatif`` draws as
    many batches as its steps need and ignores *batches_per_source*.  *seq_len*
    ``None`` (the default) is 512, or the model's own limit when that is lower
    (:func:`fit_seq_len`, said in one line).
    """

    batches_per_source: int = 64
    batch_size: int = 8
    seq_len: int | None = None
    text_field: str = "text"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batches_per_source < 1 or self.batch_size < 1:
            raise SpecError(f"--batches-per-source and --batch-size must be >= 1; got {self.batches_per_source} "
                            f"and {self.batch_size}.")
        if self.seq_len is not None:
            check_seq_len(self.seq_len, None, "")


@dataclass(frozen=True)
class RecordSpec:
    """What to record of every batch.

    Parameters
    ----------
    tensors
        Parameter globs (default: every trainable 2-D weight).
    heads
        ``"auto"`` (default), ``None`` / ``"none"``, ``{glob: H, ...}``, or the
        ``--heads`` entries (``["*.q_proj.weight=8", "auto"]``), parsed here.
    activations
        Module globs whose outputs get per-unit statistics.
    sketch
        ``K``: a K-dim sketch per tensor (per head); ``None``: whole tensors.
    full
        With *sketch*: tensors whose whole gradient is stored too.
    dtype
        On-disk gradient format (``bf16``, ``float16``, ...; stored here by its
        full name); default as computed.
    attention
        ``"auto"`` or attention-module globs: per-head attention statistics
        (the checkpoint then runs eager attention); ``None``: none.
    logits
        ``"auto"`` (the output embedding) or module globs: per-record log Z and logit
        statistics (:mod:`gradforensics.recording.logits`); ``None``: none.
    experts
        ``"auto"``, ``{experts module glob: E}`` or the ``--experts`` entries (``[]`` / ``["auto"]``,
        ``["*.mlp.experts=8"]``): mixture-of-experts units and router statistics
        (:mod:`gradforensics.recording.experts`); ``None``: none.
    """

    tensors: tuple[str, ...] | None = None
    heads: str | Mapping[str, Any] | None = "auto"
    activations: tuple[str, ...] | None = None
    sketch: int | None = None
    full: tuple[str, ...] | None = None
    dtype: str | None = None
    attention: str | tuple[str, ...] | None = None
    logits: str | tuple[str, ...] | None = None
    experts: str | Mapping[str, int] | Sequence[str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", _attention(self.attention))
        object.__setattr__(self, "logits", _attention(self.logits))     # the same auto / none / globs form
        if self.experts is not None and not isinstance(self.experts, Mapping):
            from gradforensics.recording.experts import parse_cli_experts

            object.__setattr__(self, "experts", parse_cli_experts(
                [self.experts] if isinstance(self.experts, str) else list(self.experts)))
        for name in ("tensors", "activations", "full"):
            object.__setattr__(self, name, _globs(getattr(self, name)))
        heads = self.heads
        if isinstance(heads, str):
            heads = parse_heads([heads])
        elif heads is not None and not isinstance(heads, Mapping):
            heads = parse_heads([str(h) for h in heads])
        object.__setattr__(self, "heads", heads)
        if self.sketch is not None and (isinstance(self.sketch, bool) or not isinstance(self.sketch, int)):
            raise SpecError(f"--sketch must be a positive integer or None; got {self.sketch!r}.")
        if self.sketch is not None and self.sketch < 1:
            raise SpecError(f"--sketch must be >= 1; got {self.sketch}.")
        if self.full and self.sketch is None:
            raise SpecError("--full selects whole tensors to keep next to --sketch; without --sketch every "
                            "recorded tensor is whole already.")
        if self.dtype is not None:
            if self.dtype not in DTYPE_NAMES:
                raise SpecError(f"--dtype {self.dtype!r}: expected one of {', '.join(sorted(DTYPE_NAMES))}, "
                                "or None (as computed).")
            object.__setattr__(self, "dtype", DTYPE_NAMES[self.dtype])

    def recorder_options(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~gradforensics.recording.torch.TorchRecorder` these stand for."""
        return {"tensors": self.tensors, "heads": self.heads, "activations": self.activations,
                "sketch": self.sketch, "full": self.full, "dtype": self.dtype, "attention": self.attention,
                **({"logits": self.logits} if self.logits else {}),
                **({"experts": self.experts} if self.experts else {})}


def _attention(value: str | Sequence[str] | None) -> str | tuple[str, ...] | None:
    """``--attention`` (no globs), ``"auto"`` -> ``"auto"``; ``"none"`` -> None; globs -> a tuple."""
    if value is None or value == "none":
        return None
    if isinstance(value, str):
        return "auto" if value == "auto" else (value,)
    globs = tuple(str(v) for v in value)
    return "auto" if not globs or globs == ("auto",) else globs


@dataclass(frozen=True)
class ModelSpec:
    """How the checkpoint is loaded and run (:func:`gradforensics.replay.checkpoint.load_checkpoint`).

    *loss*: ``auto`` (from the config), ``causal-lm``, ``causal-lm-skip-first``, ``masked-lm`` or
    ``module:function`` taking ``(model, batch)``; *model_factory*:
    ``module:function`` building the ``nn.Module`` of a raw state-dict file;
    *tokenizer*: its directory (default: the checkpoint directory); *device*,
    *model_dtype*: where and in which dtype the model runs; *step*: the optimizer
    step written to ``batches/step`` (default: ``trainer_state.json``, else 0).
    """

    loss: str = "auto"
    model_factory: str | None = None
    tokenizer: str | None = None
    device: str = "cpu"
    model_dtype: str = "float32"
    step: int | None = None

    def __post_init__(self) -> None:
        if self.tokenizer is not None:
            object.__setattr__(self, "tokenizer", os.fspath(self.tokenizer))
        if self.model_dtype not in MODEL_DTYPES:
            raise SpecError(f"--model-dtype must be one of {MODEL_DTYPES}; got {self.model_dtype!r}.")
        if self.loss not in BUILTIN_LOSSES and ":" not in str(self.loss):
            raise SpecError(f"--loss must be one of {', '.join(BUILTIN_LOSSES)} or module:function; "
                            f"got {self.loss!r}.")


S = TypeVar("S", BatchSpec, RecordSpec, ModelSpec)


def as_spec(cls: type[S], value: S | Mapping[str, Any] | None, defaults: Mapping[str, Any] | None = None) -> S:
    """*value* as a *cls*: itself, or a dict of its fields (a missing field from *defaults*, else the class's).

    Raises
    ------
    SpecError
        A key that is no field of *cls*, or a value neither a *cls*, a dict nor None.
    """
    if isinstance(value, cls):
        return value
    if value is not None and not isinstance(value, Mapping):
        raise SpecError(f"expected a {cls.__name__} or a dict of its fields; got {type(value).__name__}.")
    given = dict(value or {})
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise SpecError(f"{cls.__name__}: unknown option {unknown[0]!r}; the options are {', '.join(names)}.")
    return cls(**{**dict(defaults or {}), **given})


# ------------------------------------------------------------------ size estimate
def _units(module: nn.Module, model: nn.Module, name: str) -> int:
    """Output units of a hooked module (for the estimate): Linear's out_features, else a config width."""
    for attr in ("out_features", "out_channels", "num_features", "hidden_size"):    # Linear, Conv, BatchNorm, RNN
        units = getattr(module, attr, None)
        if isinstance(units, int):
            return units
    cfg = getattr(model, "config", None)
    key = "intermediate_size" if "mlp" in name or "act" in name else "hidden_size"
    return int(getattr(cfg, key, 0) or 0)


def record_bytes(shapes: Mapping[str, tuple[tuple[int, ...], int]], specs: Mapping[str, HeadSpec], *,
                 sketch: int | None, full: Sequence[str] | None, n_sources: int,
                 act_units: Sequence[int] = ()) -> dict[str, int]:
    """Bytes one record adds to the store (before compression), by part.

    *shapes* maps each recorded tensor to ``(shape, bytes per element)``.  A
    whole tensor costs ``numel x itemsize``; a sketch ``k x 4 x heads`` (one
    ``k`` float32 vector per head, or one for an unsplit tensor); an activated
    module ``B x 8 + 4 x units x 4 + 2 x units + 4`` (int64 histogram of ``B`` bins, four
    float32 per-unit statistics, the uint8 ``dead`` / ``saturated`` and the float32 ``kurtosis``);
    the batch metadata ``32 + 4 x sources``.
    """
    from gradforensics.recording.actstats import N_BINS

    globs = tuple(full) if full is not None else (() if sketch else ("*",))
    grads = sketches = 0
    for name, (shape, itemsize) in shapes.items():
        numel = 1
        for s in shape:
            numel *= int(s)
        if any(fnmatch.fnmatchcase(name, g) for g in globs):
            grads += numel * itemsize
        if sketch:
            spec = specs.get(name)
            sketches += sketch * 4 * (spec.total if spec is not None else 1)
    acts = sum(N_BINS * 8 + 4 * u * 4 + 2 * u + 4 for u in act_units)
    meta = META_BYTES + 4 * n_sources
    return {"grads": grads, "sketch": sketches, "acts": acts, "meta": meta,
            "total": grads + sketches + acts + meta}


def plan_record(model: nn.Module, record: RecordSpec, n_sources: int) -> dict[str, int]:
    """Check *record*'s globs against *model* (one-line errors) and estimate a record's bytes."""
    from gradforensics.recording.autoheads import resolve_heads
    from gradforensics.recording.selection import select_modules, select_parameters

    params = select_parameters(model, record.tensors)
    if not params:
        raise SpecError(f"tensors: {type(model).__name__} has no trainable 2-D weight to record; pass --tensors.")
    specs = resolve_heads(model, {n: tuple(p.shape) for n, p in params.items()}, record.heads)
    for glob in record.full or ():
        if not any(fnmatch.fnmatchcase(n, glob) for n in params):
            raise SpecError(f"--full: glob {glob!r} matches none of the recorded tensors "
                            f"(e.g. {', '.join(list(params)[:3])}).")
    modules = select_modules(model, record.activations)
    shapes = {n: (tuple(p.shape), ITEMSIZE[record.dtype] if record.dtype else p.element_size())
              for n, p in params.items()}
    units = [_units(m, model, n) for n, m in modules.items()]
    return record_bytes(shapes, specs, sketch=record.sketch, full=record.full, n_sources=n_sources,
                        act_units=units)


def size_estimate(bytes_per_record: int, n_records: int, path: Any) -> dict[str, float]:
    """Bytes per record, total, and free space on the disk that holds *path* (a path, URL or Location)."""
    parent = Path(str(path)).resolve().parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    return {"bytes_per_record": float(bytes_per_record), "n_records": float(n_records),
            "total_bytes": float(bytes_per_record) * n_records, "free_bytes": float(free)}


def exceeds_disk(est: Mapping[str, float], path: Any) -> bool:
    """Whether the estimate *est* of a store at *path* is more than its disk's free space.

    Object storage (an fsspec URL) has no free-space figure to check against: never.
    """
    from gradforensics.store.remote import is_url

    return est["total_bytes"] > est["free_bytes"] and not is_url(path)


def check_disk(per_record: Mapping[str, int], n_records: int, path: Any, *, force: bool = False,
               say: IO[str] | None = None, label: str = "", disk_of: str | os.PathLike[str] | None = None,
               refusal: str = CAPTURE_REFUSAL) -> dict[str, float]:
    """Print the size estimate of *n_records* records at *path* on *say*; refuse when the disk cannot hold them.

    The line reads ``estimate: N records{label} x B (parts) = T; F free on the disk
    of {disk_of}.`` (*disk_of* defaults to *path*; a URL gets ``... = T to URL.``).

    Raises
    ------
    SpecError
        The estimate exceeds the free space (:func:`exceeds_disk`) and not *force*:
        *refusal* with ``{path}``, ``{total}``, ``{free}`` and ``{disk_of}`` filled in.
    """
    from gradforensics._format import fmt_bytes
    from gradforensics.store.remote import is_url

    est = size_estimate(per_record["total"], n_records, path)
    where = path if disk_of is None else disk_of
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in per_record.items() if k != "total" and v)
    line = (f"estimate: {n_records} records{label} x {fmt_bytes(est['bytes_per_record'])} ({parts}) = "
            f"{fmt_bytes(est['total_bytes'])}; {fmt_bytes(est['free_bytes'])} free on the disk of {where}.")
    if is_url(path):
        line = line.rsplit(";", 1)[0] + f" to {path}."
    if say is not None:
        print(line, file=say, flush=True)
    if exceeds_disk(est, path) and not force:
        raise SpecError(refusal.format(path=path, disk_of=where, total=fmt_bytes(est["total_bytes"]),
                                       free=fmt_bytes(est["free_bytes"])))
    return est

