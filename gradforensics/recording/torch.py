"""The PyTorch recorder: ``gf.Recorder(path, model=model, ...)``.

:class:`TorchRecorder` reads ``param.grad`` of the selected parameters when
``record()`` is called - so under gradient accumulation it stores the sum over
the micro-batches, exactly what the optimizer will see - keeps the outputs of
hooked modules since the previous record, and hands everything to the
framework-agnostic :class:`~gradforensics.recording.recorder.ArrayRecorder`
(its base class), whose background thread splits heads, sketches, computes
activation statistics and writes.

On CUDA the gradients are copied into pinned host buffers with
``non_blocking=True`` on the current stream and a CUDA event is recorded after
the copies; ``record()`` returns without waiting, and the writer thread waits
on that event (``event.synchronize()``, never ``torch.cuda.synchronize()``)
before it reads the buffers (the record carries that wait as its ``settle``,
:class:`~gradforensics.recording.recorder.PendingRecord`).  Two buffer sets are
reused in turn, so a third ``record()`` waits only if the writer has not yet
taken the first one.
"""

from __future__ import annotations

import fnmatch
import math
import queue
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import SpecError
from gradforensics.recording import distributed
from gradforensics.recording.actstats import (
    BOUNDED,
    ActRange,
    combine,
    finish,
    make_range_torch,
    partial_stats,
    with_scale,
)
from gradforensics.recording.attention import AttentionTaps, attention_modules
from gradforensics.recording.autoheads import resolve_heads
from gradforensics.recording.recorder import ArrayRecorder
from gradforensics.recording.sketch import DeviceSketch
from gradforensics.store.names import check_name

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["CONFIG_KEYS", "N_BUFFER_SETS", "TorchRecorder", "model_info", "run_dtypes", "select_modules", "select_parameters",
           "to_numpy", "torch_float32"]


#: ``model.config`` fields copied into the store's ``model`` attribute.
CONFIG_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "vocab_size")
N_BUFFER_SETS = 2


def select_parameters(model: nn.Module, tensors: Sequence[str] | None) -> dict[str, torch.nn.Parameter]:
    """The parameters named by the globs *tensors* (default: every trainable 2-D weight), in model order.

    Raises
    ------
    SpecError
        A glob that matches no parameter.
    """
    params = dict(model.named_parameters())
    if tensors is None:
        return {n: p for n, p in params.items() if p.ndim == 2 and p.requires_grad}
    if isinstance(tensors, str):
        tensors = [tensors]
    out: dict[str, torch.nn.Parameter] = {}
    for glob in tensors:
        hits = [n for n in params if fnmatch.fnmatchcase(n, glob)]
        if not hits:
            raise SpecError(f"tensors: glob {glob!r} matches no parameter of {type(model).__name__} "
                            f"(names look like {', '.join(list(params)[:3])}).")
        out.update((n, params[n]) for n in hits)
    return {n: out[n] for n in params if n in out}   # model order


def select_modules(model: nn.Module, globs: Sequence[str] | None) -> dict[str, nn.Module]:
    """The modules named by the globs *globs* (for activation hooks); a glob that matches none is a SpecError."""
    if not globs:
        return {}
    if isinstance(globs, str):
        globs = [globs]
    named = dict(model.named_modules())
    out: dict[str, nn.Module] = {}
    for glob in globs:
        hits = [n for n in named if n and fnmatch.fnmatchcase(n, glob)]
        if not hits:
            raise SpecError(f"activations: glob {glob!r} matches no module of {type(model).__name__} "
                            f"(names look like {', '.join([n for n in named if n][:3])}).")
        out.update((n, named[n]) for n in hits)
    return out


def model_info(model: nn.Module) -> dict[str, Any]:
    """Class, parameter count, dtype and a JSON-safe subset of ``model.config``."""
    info: dict[str, Any] = {"class": type(model).__name__,
                            "n_params": int(sum(p.numel() for p in model.parameters()))}
    first = next(iter(model.parameters()), None)
    if first is not None:
        info["dtype"] = str(first.dtype).removeprefix("torch.")
    cfg = getattr(model, "config", None)
    if cfg is not None:
        sub = {k: getattr(cfg, k, None) for k in CONFIG_KEYS}
        info["config"] = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                          for k, v in sub.items() if v is not None}
    return info


def run_dtypes(model: nn.Module, given: Mapping[str, str] | None) -> dict[str, str]:
    """``{"parameters": ..., "master": ...}``: the trainable parameters' dtype (the most common one), and the
    master weights' (what *given* says, else the parameters' own: a torch optimizer steps the parameters)."""
    names = [str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad]
    out = {"parameters": max(set(names), key=names.count)} if names else {}
    if out:
        out["master"] = out["parameters"]
    out.update(dict(given or {}))
    return out


def _bf16_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU bfloat16 tensor as a NumPy array (ml_dtypes' bfloat16, else an exact float32 upcast)."""
    import torch

    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes ships with the torch extra
        return t.to(torch.float32).numpy()
    return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as NumPy, sharing memory where the dtype allows (bfloat16 too)."""
    import torch

    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    return _bf16_numpy(t) if t.dtype == torch.bfloat16 else t.numpy()


class _ActHook:
    """Forward hook summarising a module's outputs on their own device.

    Until the module's range is fixed (its first record) the outputs are kept,
    ``(tokens, units)`` float32 on their device; after that every micro-batch is
    reduced at once to per-unit partial sums (:func:`~gradforensics.recording.actstats.partial_stats`),
    so nothing is kept and only the summed statistics cross to the host, at ``record()``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.parts: list[torch.Tensor] = []
        self.units: int | None = None
        self.rng: ActRange | None = None
        self.sums: dict[str, Any] | None = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        import torch

        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if not isinstance(out, torch.Tensor):
            raise SpecError(f"activations: module {self.name} returned {type(output).__name__}, not a tensor; "
                            "hook a module whose output is the activation (e.g. '*.mlp.act_fn').")
        a = out.detach().reshape(-1, out.shape[-1]) if out.ndim else out.detach().reshape(1, 1)
        self.units = int(a.shape[-1])
        if self.rng is None:
            self.parts.append(a.to(torch.float32, copy=True))
        else:
            self.sums = combine(self.sums, partial_stats(a, self.rng))

    def take(self) -> tuple[torch.Tensor | None, dict[str, Any] | None]:
        """The kept outputs (before the range is fixed) or the summed parts since the last call."""
        import torch

        parts, self.parts = self.parts, []
        sums, self.sums = self.sums, None
        if not parts:
            return None, sums
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), sums


class TorchRecorder(ArrayRecorder):
    """Record a PyTorch model's gradients, activations and weights into a store.

    Parameters
    ----------
    path
        ``*.zarr`` or ``*.h5`` / ``*.hdf5``.
    model
        The ``torch.nn.Module`` whose parameters' ``.grad`` are read at ``record()``.
    tensors
        Parameter-name globs to record; default every 2-D trainable weight.
        A glob that matches nothing is a :class:`SpecError`.
    heads
        ``"auto"`` (default: LLaMA/Mistral/Qwen incl. GQA, GPT-2, GPT-NeoX, Phi-3,
        ``nn.MultiheadAttention``; see :mod:`gradforensics.recording.autoheads`),
        ``{glob: H | {"heads": H, "axis": A, ...} | None}`` (add ``"auto": True`` to
        combine with the automatic rules), or ``None`` (no head split).
    activations
        Module-name globs; each module's outputs are kept (all micro-batches since
        the previous record) and summarised per unit.  Known bounded activations
        (``nn.Tanh``, ``nn.Sigmoid``, ``nn.Hardtanh``, ...) get their bounds.
    weights_every
        Snapshot the recorded weights every ``k`` records (record 0 included);
        ``None``: never.
    attention
        ``"auto"`` (every Hugging Face attention module) or module globs: per
        record and head, the max attention logit, the mean and minimum attention
        entropy and the share of one-hot queries, reduced on the device
        (:mod:`gradforensics.recording.attention`).  The model must run eager
        attention (``attn_implementation="eager"``); SDPA/flash are refused.
    sketch_on
        ``"device"`` (default): a countsketch is computed where the gradient lives
        (the GPU), so only ``k`` floats per head cross to the host; ``"host"``: the
        gradient is copied to the host and sketched there by the writer thread.
    **kwargs
        Everything :class:`~gradforensics.recording.recorder.ArrayRecorder` takes
        (``sources``, ``sketch``, ``full``, ``dtype``, ``mode``, ...).

    Notes
    -----
    A recorded parameter whose ``.grad`` is ``None`` at ``record()`` is stored as
    zeros (with a warning once per parameter): every record carries the same
    tensors.  Hooks are removed by :meth:`close` (and on leaving ``with``).

    Under ``torch.distributed`` with two or more ranks the recorder is collective
    (every rank makes it on the same path and calls ``record()`` as often) and
    every rank writes into the one store (:mod:`gradforensics.store.ranks`).  What
    a record is depends on the model (:mod:`gradforensics.recording.distributed`):
    under ``DistributedDataParallel`` the rank's local micro-batch gradient
    (``batches/rank`` says which rank), under FSDP2 (``fully_shard``) the step's
    reduced gradient.  See ``docs/capture-many-gpus.md``.
    """

    def __init__(self, path: Any, *, model: nn.Module, sources: Sequence[str],
                 tensors: Sequence[str] | None = None, heads: str | Mapping[str, Any] | None = "auto",
                 activations: Sequence[str] | None = None, weights_every: int | None = None,
                 act_bounds: Mapping[str, tuple[float, float]] | None = None, sketch_on: str = "device",
                 attention: str | Sequence[str] | None = None, **kwargs: Any) -> None:
        if sketch_on not in ("device", "host"):
            raise SpecError(f"sketch_on must be 'device' or 'host'; got {sketch_on!r}.")
        if weights_every is not None and (not isinstance(weights_every, int) or weights_every < 1):
            raise SpecError(f"weights_every must be a positive int or None; got {weights_every!r}.")
        for key in ("framework", "model_info"):
            if key in kwargs:
                raise SpecError(f"{key}= is set by the PyTorch recorder from the model; do not pass it.")
        self.model = model
        self.dist = distributed.context(model)
        named = distributed.unwrap(model)     # DDP's parameter names without "module."
        self.params = select_parameters(named, tensors)
        if not self.params:
            raise SpecError(f"tensors: {type(named).__name__} has no trainable 2-D weight to record; "
                            "pass tensors=[globs].")
        specs = resolve_heads(named, {n: tuple(p.shape) for n, p in self.params.items()}, heads)
        self._act_modules = select_modules(named, activations)
        attn_modules = attention_modules(named, attention) if attention else {}
        if attn_modules and self.dist is not None and self.dist.kind == "fsdp":
            raise SpecError("FSDP capture does not take attention= yet; record it from a DDP or single-process run.")
        if self.dist is not None:
            _check_distributed(self.dist, activations, weights_every, kwargs)
            kwargs["ranks"] = self.dist.plan()
        bounds = {n: BOUNDED[type(m).__name__.lower()] for n, m in self._act_modules.items()
                  if type(m).__name__.lower() in BOUNDED}
        bounds.update(act_bounds or {})
        self.weights_every = weights_every
        kwargs["dtypes"] = run_dtypes(named, kwargs.get("dtypes"))
        super().__init__(path, sources=sources, heads=specs, act_bounds=bounds, framework="torch",
                         model_info=model_info(named), **kwargs)
        self.head_specs = specs
        self._local = distributed.LocalGrads(model, self.params) if self.dist and self.dist.kind == "ddp" else None
        on_device = self.sketcher is not None and self.sketcher.method == "countsketch" and (
            sketch_on == "device" or (self.dist is not None and self.dist.kind == "fsdp"))
        self._device_sketch = DeviceSketch(self.sketcher) if on_device and self.sketcher else None
        #: Bytes copied from the gradients' device to the host, all records so far (sketches included).
        self.host_bytes = 0
        if self._device_sketch is not None:
            self.device_sketched = frozenset(self.params)
        self._full_names = tuple(n for n in self.params if any(fnmatch.fnmatchcase(n, pat) for pat in self.full))
        self._steps = 0
        self._hooks: list[Any] = []
        self._act_hooks = {n: _ActHook(n) for n in self._act_modules}
        for n, m in self._act_modules.items():
            self._hooks.append(m.register_forward_hook(self._act_hooks[n]))
        self._attn = AttentionTaps(named, attn_modules) if attn_modules else None
        self._warned: set[str] = set()
        self._pool: queue.Queue[dict[str, torch.Tensor]] | None = None
        self._pool_lock = threading.Lock()

    # ------------------------------------------------------------------ API
    def record(self, *, step: int | None = None, loss: Any = math.nan, source: str | None = None,
               mixture: Mapping[str, float] | None = None, n_samples: int = 1, lr: float = math.nan,
               rank: int | None = None, time: float | None = None, grads: Mapping[str, Any] | None = None,
               activations: Mapping[str, Any] | None = None, weights: Mapping[str, Any] | None = None,
               attention: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Record the current ``.grad`` of the selected parameters, and the hooked activations.

        Call it after ``loss.backward()`` (after the last micro-batch) and before
        ``optimizer.zero_grad()``.  Returns without waiting for the device copy.
        *grads*, *activations*, *weights*, *attention*: extra NumPy arrays recorded alongside
        (names must differ from the model's).
        """
        if self.dist is not None and self.dist.kind == "fsdp":
            if grads or activations or weights:
                raise SpecError("record(): extra grads=/activations=/weights= are not taken under FSDP.")
            self._record_fsdp(step=step, loss=_scalar(loss), source=source, mixture=mixture,
                              n_samples=int(n_samples), lr=float(lr), time=time)
            return
        g, events, release, on_device, sketches = self._grads()
        try:
            pending = self._make_pending(
                step=step, loss=_scalar(loss), source=source, mixture=mixture, n_samples=int(n_samples),
                lr=float(lr), rank=_rank() if rank is None else int(rank), time=time,
                grads=_merge("grads", g, grads), activations=activations,
                weights=_merge("weights", self._weights(), weights), copy=False)
            pending.act_stats = self._activations()
            pending.attn = self._take_attn(attention or {})
            if self._attn is not None:
                pending.attn = _merge_attn(pending.attn, self._attn.take())
            clash = sorted(set(pending.act_stats) & set(pending.acts))
            if clash:
                raise SpecError(f"record(): activations[{clash[0]!r}] is already recorded from the model; "
                                "give extras other names.")
        except BaseException:
            if release is not None:
                release()
            raise
        if events or release is not None:
            pending.settle = _device_copies_done(pending.grads, events, release, on_device)
        pending.sketches = sketches
        self._submit(pending)

    def _record_fsdp(self, *, step: int | None, loss: float, source: str | None,
                     mixture: Mapping[str, float] | None, n_samples: int, lr: float, time: float | None) -> None:
        """Collective: the step's reduced gradient, written whole by rank ``t mod R`` (see :mod:`.distributed`)."""
        assert self.dist is not None
        t, self._steps = self._steps, self._steps + 1
        grads: dict[str, Any] = {}     # DTensors
        for n, p in self.params.items():
            if p.grad is None:
                raise SpecError(f"record(): {n} has no .grad on rank {self.dist.rank}; call it after backward().")
            grads[n] = p.grad
        sketches = distributed.fsdp_sketches(grads, self.head_specs, self._device_sketch) \
            if self._device_sketch is not None else {}
        owner = t % self.dist.world
        whole = {n: distributed.gather_full(grads[n], owner) for n in self._full_names}   # collective
        loss_all, n_all, mix = distributed.reduce_meta(loss, n_samples, self._mixture(source, mixture))
        if owner != self.dist.rank:
            return
        pending = self._make_pending(
            step=t if step is None else step, loss=loss_all, source=None,
            mixture=dict(zip(self.sources, map(float, mix), strict=True)), n_samples=n_all, lr=lr,
            rank=self.dist.rank, time=time,
            grads={n: to_numpy(w.detach().cpu()) for n, w in whole.items() if w is not None},
            activations=None, weights=None, copy=False)
        pending.sketches = {n: (sk, tuple(grads[n].shape), _dtype_name(grads[n])) for n, sk in sketches.items()}
        self._submit(pending)

    def close(self) -> None:
        """Remove the hooks, then flush and close the store."""
        if self._term is not None:
            self._term.closing = True    # a SIGTERM now is held until the store is closed
        try:
            self.remove_hooks()
        finally:
            super().close()

    def remove_hooks(self) -> None:
        """Remove every forward hook (and DDP gradient hook) this recorder registered (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        taps = getattr(self, "_attn", None)
        if taps is not None:
            taps.remove()
        if self._local is not None:
            self._local.remove()

    @property
    def n_hooks(self) -> int:
        """Forward hooks in place (0 after :meth:`close`)."""
        return len(self._hooks)

    # ------------------------------------------------------ caller-side work
    def _grad_of(self, name: str, p: torch.nn.Parameter) -> torch.Tensor:
        import torch

        g = p.grad if self._local is None else self._local.take(name, p)
        if g is None:
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"gradforensics: {name} has no .grad at record {self.n_records}; "
                              "recording zeros for it.", RuntimeWarning, stacklevel=4)
            return torch.zeros(p.shape, dtype=p.dtype, device=p.device)   # same path as a real .grad
        return g.detach()

    def _grads(self) -> tuple[dict[str, np.ndarray], list[Any], Callable[[], None] | None, tuple[str, ...],
                              dict[str, tuple[np.ndarray, tuple[int, ...], str]]]:
        """Host copies of the gradients: fresh arrays (CPU), or pinned buffers being filled (CUDA).

        With a countsketch, every sketch is computed here, on the gradient's device
        (only ``k`` floats per head cross to the host), and only the ``full``
        tensors are copied.
        """
        grads = {n: self._grad_of(n, p) for n, p in self.params.items()}
        sketches = {}
        if self._device_sketch is not None:
            for n, g in grads.items():
                sk = self._device_sketch.project_heads(g, self.head_specs.get(n))
                sketches[n] = (sk.to(torch_float32()).cpu().numpy(), tuple(g.shape), _dtype_name(g))
            grads = {n: grads[n] for n in self._full_names}
        self.host_bytes += sum(sk.nbytes for sk, _, _ in sketches.values()) + \
            sum(g.numel() * g.element_size() for g in grads.values())
        on_device = {n: g for n, g in grads.items() if _is_device(g)}
        out = {n: to_numpy(g.clone()) for n, g in grads.items() if n not in on_device}
        if not on_device:
            return out, [], None, (), sketches
        bufs = self._acquire(on_device)
        events = _copy_async(on_device, bufs)
        out.update({n: to_numpy(bufs[n]) for n in on_device})
        pool = self._pool
        assert pool is not None
        return {n: out[n] for n in grads}, events, lambda: pool.put(bufs), tuple(on_device), sketches

    def _acquire(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        def new_set() -> dict[str, torch.Tensor]:
            return {n: _host_buffer(g.shape, g.dtype) for n, g in like.items()}

        with self._pool_lock:
            if self._pool is None:
                self._pool = queue.Queue()
                for _ in range(N_BUFFER_SETS):
                    self._pool.put(new_set())
        while True:   # backpressure: wait for the writer to hand a buffer set back
            try:
                return self._pool.get(timeout=0.1)
            except queue.Empty:
                self._raise_if_failed()
                if self._queue is None or self._queue.unfinished_tasks == 0:
                    return new_set()   # the writer is idle: a set was dropped with a failed record

    def _activations(self) -> dict[str, dict[str, np.ndarray]]:
        """Every hooked module's statistics since the last record, reduced on the device (see :class:`_ActHook`)."""
        out = {}
        for name, hook in self._act_hooks.items():
            first, sums = hook.take()
            if first is None and sums is None:
                raise SpecError(f"activations: module {name} produced no output since the previous record; "
                                "every hooked module must run in every recorded batch.")
            if first is not None:     # the module's first record: fix its range from it (all ranks alike)
                check_name(name, "activations module")
                hook.rng = self._ranges[name] = self._agreed_range(first, self._bounds_for(name))
                sums = combine(sums, partial_stats(first, hook.rng))
            assert sums is not None
            out[name] = finish(sums)
        return out

    def _agreed_range(self, first: torch.Tensor, bounds: tuple[float, float] | None) -> ActRange:
        """The module's range; under a process group every rank takes the largest rank's scale."""
        rng = make_range_torch(first, bounds)
        if self.dist is None or rng.bounds is not None:
            return rng
        import torch
        import torch.distributed as dist

        scale = torch.tensor([rng.scale], dtype=torch.float64, device=first.device)
        dist.all_reduce(scale, op=dist.ReduceOp.MAX)
        return with_scale(rng, float(scale))

    def _weights(self) -> dict[str, np.ndarray]:
        k = self.weights_every
        if k is None or self.n_records % k:
            return {}
        return {n: to_numpy(p.detach().to("cpu", copy=True)) for n, p in self.params.items()}


def _device_copies_done(grads: dict[str, np.ndarray], events: list[Any], release: Callable[[], None] | None,
                        on_device: tuple[str, ...]) -> Callable[[], None]:
    """The ``settle`` of a record whose gradients are being copied into reused host buffers.

    On the writer thread: wait for this record's copies only, copy the buffers
    out (in place in *grads*), then hand the buffer set back with *release*.
    """
    def settle() -> None:
        try:
            for event in events:
                event.synchronize()       # this record's copies only, never torch.cuda.synchronize()
            for n in on_device:
                grads[n] = np.array(grads[n], copy=True)
        finally:
            if release is not None:
                release()

    return settle


def _copy_async(grads: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor]) -> list[Any]:
    """Queue device-to-host copies on each device's current stream; one event per device."""
    import torch

    events = []
    for dev in {g.device for g in grads.values()}:
        stream = torch.cuda.current_stream(dev)
        with torch.cuda.stream(stream):
            for n, g in grads.items():
                if g.device == dev:
                    bufs[n].copy_(g.to_dense() if g.is_sparse else g, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        events.append(event)
    return events


def _is_device(t: torch.Tensor) -> bool:
    """Whether *t* lives on an accelerator and is copied asynchronously."""
    return bool(t.is_cuda)


def _host_buffer(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer for device-to-host copies: pinned where CUDA is present."""
    import torch

    return torch.empty(tuple(shape), dtype=dtype, pin_memory=torch.cuda.is_available())


def _merge(what: str, ours: dict[str, np.ndarray], extra: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    if not extra:
        return ours
    clash = sorted(set(ours) & set(extra))
    if clash:
        raise SpecError(f"record(): {what}[{clash[0]!r}] is already recorded from the model; give extras other names.")
    return {**ours, **{k: np.array(v, copy=True) for k, v in extra.items()}}


def _merge_attn(extra: dict[str, dict[str, np.ndarray]],
                ours: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    clash = sorted(set(ours) & set(extra))
    if clash:
        raise SpecError(f"record(): attention[{clash[0]!r}] is already recorded from the model; give extras other names.")
    return {**extra, **ours}


def _scalar(x: Any) -> float:
    detach = getattr(x, "detach", None)
    return float(detach() if callable(detach) else x)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def torch_float32() -> torch.dtype:
    import torch

    return torch.float32


def _check_distributed(ctx: distributed.Context, activations: Any, weights_every: int | None,
                       kwargs: Mapping[str, Any]) -> None:
    """Options a multi-rank recorder does not take (one line each)."""
    if ctx.kind != "fsdp":
        return
    sketch = kwargs.get("sketch")
    method = sketch.get("method", "countsketch") if isinstance(sketch, Mapping) else "countsketch"
    for bad, why in ((activations, "activations="), (weights_every, "weights_every="),
                     (method != "countsketch", "a gaussian sketch")):
        if bad:
            raise SpecError(f"FSDP capture does not take {why} yet; record them from a DDP or single-process run.")


def _rank() -> int:
    import torch.distributed as dist

    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0
