"""The PyTorch recorder: ``gf.Recorder(path, model=model, ...)``.

:class:`TorchRecorder` reads ``param.grad`` of the selected parameters when
``record()`` is called - so under gradient accumulation it stores the sum over
the micro-batches, exactly what the optimizer will see - keeps the outputs of
hooked modules since the previous record, and hands everything to the
framework-agnostic :class:`~gradforensics.capture.recorder.ArrayRecorder`
(its base class), whose background thread splits heads, sketches, computes
activation statistics and writes.

On CUDA the gradients are copied into pinned host buffers with
``non_blocking=True`` on the current stream and a CUDA event is recorded after
the copies; ``record()`` returns without waiting, and the writer thread waits
on that event (``event.synchronize()``, never ``torch.cuda.synchronize()``)
before it reads the buffers (the record carries that wait as its ``settle``,
:class:`~gradforensics.capture.recorder.PendingRecord`).  Two buffer sets are
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

from gradforensics.capture.actstats import BOUNDED
from gradforensics.capture.autoheads import resolve_heads
from gradforensics.capture.recorder import ArrayRecorder
from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import torch
    from torch import nn

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
    """Forward hook keeping a module's outputs, as ``(tokens, units)`` float32 on the CPU."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.parts: list[tuple[torch.Tensor, Any]] = []
        self.units: int | None = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        import torch

        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if not isinstance(out, torch.Tensor):
            raise SpecError(f"activations: module {self.name} returned {type(output).__name__}, not a tensor; "
                            "hook a module whose output is the activation (e.g. '*.mlp.act_fn').")
        a = out.detach().reshape(-1, out.shape[-1]) if out.ndim else out.detach().reshape(1, 1)
        self.units = int(a.shape[-1])
        if a.is_cuda:
            host = _host_buffer(a.shape, torch.float32)
            host.copy_(a.float(), non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(a.device))
            self.parts.append((host, event))
        else:
            self.parts.append((a.to(torch.float32, copy=True), None))

    def take(self) -> np.ndarray | None:
        """Every output since the last call, stacked ``(tokens, units)``; ``None`` if none."""
        import torch

        if not self.parts:
            return None
        for _, event in self.parts:
            if event is not None:
                event.synchronize()   # issued during the forward pass: long done by record()
        parts, self.parts = [t for t, _ in self.parts], []
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).numpy()


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
        ``nn.MultiheadAttention``; see :mod:`gradforensics.capture.autoheads`),
        ``{glob: H | {"heads": H, "axis": A, ...} | None}`` (add ``"auto": True`` to
        combine with the automatic rules), or ``None`` (no head split).
    activations
        Module-name globs; each module's outputs are kept (all micro-batches since
        the previous record) and summarised per unit.  Known bounded activations
        (``nn.Tanh``, ``nn.Sigmoid``, ``nn.Hardtanh``, ...) get their bounds.
    weights_every
        Snapshot the recorded weights every ``k`` records (record 0 included);
        ``None``: never.
    **kwargs
        Everything :class:`~gradforensics.capture.recorder.ArrayRecorder` takes
        (``sources``, ``sketch``, ``full``, ``dtype``, ``mode``, ...).

    Notes
    -----
    A recorded parameter whose ``.grad`` is ``None`` at ``record()`` is stored as
    zeros (with a warning once per parameter): every record carries the same
    tensors.  Hooks are removed by :meth:`close` (and on leaving ``with``).
    """

    def __init__(self, path: Any, *, model: nn.Module, sources: Sequence[str],
                 tensors: Sequence[str] | None = None, heads: str | Mapping[str, Any] | None = "auto",
                 activations: Sequence[str] | None = None, weights_every: int | None = None,
                 act_bounds: Mapping[str, tuple[float, float]] | None = None, **kwargs: Any) -> None:
        if weights_every is not None and (not isinstance(weights_every, int) or weights_every < 1):
            raise SpecError(f"weights_every must be a positive int or None; got {weights_every!r}.")
        for key in ("framework", "model_info"):
            if key in kwargs:
                raise SpecError(f"{key}= is set by the PyTorch recorder from the model; do not pass it.")
        self.model = model
        self.params = select_parameters(model, tensors)
        if not self.params:
            raise SpecError(f"tensors: {type(model).__name__} has no trainable 2-D weight to record; "
                            "pass tensors=[globs].")
        specs = resolve_heads(model, {n: tuple(p.shape) for n, p in self.params.items()}, heads)
        self._act_modules = select_modules(model, activations)
        bounds = {n: BOUNDED[type(m).__name__.lower()] for n, m in self._act_modules.items()
                  if type(m).__name__.lower() in BOUNDED}
        bounds.update(act_bounds or {})
        self.weights_every = weights_every
        super().__init__(path, sources=sources, heads=specs, act_bounds=bounds, framework="torch",
                         model_info=model_info(model), **kwargs)
        self.head_specs = specs
        self._hooks: list[Any] = []
        self._act_hooks = {n: _ActHook(n) for n in self._act_modules}
        for n, m in self._act_modules.items():
            self._hooks.append(m.register_forward_hook(self._act_hooks[n]))
        self._warned: set[str] = set()
        self._pool: queue.Queue[dict[str, torch.Tensor]] | None = None
        self._pool_lock = threading.Lock()

    # ------------------------------------------------------------------ API
    def record(self, *, step: int | None = None, loss: Any = math.nan, source: str | None = None,
               mixture: Mapping[str, float] | None = None, n_samples: int = 1, lr: float = math.nan,
               rank: int | None = None, time: float | None = None, grads: Mapping[str, Any] | None = None,
               activations: Mapping[str, Any] | None = None, weights: Mapping[str, Any] | None = None) -> None:
        """Record the current ``.grad`` of the selected parameters, and the hooked activations.

        Call it after ``loss.backward()`` (after the last micro-batch) and before
        ``optimizer.zero_grad()``.  Returns without waiting for the device copy.
        *grads*, *activations*, *weights*: extra NumPy arrays recorded alongside
        (names must differ from the model's).
        """
        g, events, release, on_device = self._grads()
        try:
            pending = self._make_pending(
                step=step, loss=_scalar(loss), source=source, mixture=mixture, n_samples=int(n_samples),
                lr=float(lr), rank=_rank() if rank is None else int(rank), time=time,
                grads=_merge("grads", g, grads), activations=_merge("activations", self._activations(), activations),
                weights=_merge("weights", self._weights(), weights), copy=False)
        except BaseException:
            if release is not None:
                release()
            raise
        if events or release is not None:
            pending.settle = _device_copies_done(pending.grads, events, release, on_device)
        self._submit(pending)

    def close(self) -> None:
        """Remove the hooks, then flush and close the store."""
        self.remove_hooks()
        super().close()

    def remove_hooks(self) -> None:
        """Remove every forward hook this recorder registered (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @property
    def n_hooks(self) -> int:
        """Forward hooks in place (0 after :meth:`close`)."""
        return len(self._hooks)

    # ------------------------------------------------------ caller-side work
    def _grad_of(self, name: str, p: torch.nn.Parameter) -> torch.Tensor:
        import torch

        g = p.grad
        if g is None:
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"gradforensics: {name} has no .grad at record {self.n_records}; "
                              "recording zeros for it.", RuntimeWarning, stacklevel=4)
            return torch.zeros(p.shape, dtype=p.dtype, device=p.device)   # same path as a real .grad
        return g.detach()

    def _grads(self) -> tuple[dict[str, np.ndarray], list[Any], Callable[[], None] | None, tuple[str, ...]]:
        """Host copies of the gradients: fresh arrays (CPU), or pinned buffers being filled (CUDA)."""
        grads = {n: self._grad_of(n, p) for n, p in self.params.items()}
        on_device = {n: g for n, g in grads.items() if _is_device(g)}
        out = {n: to_numpy(g.clone()) for n, g in grads.items() if n not in on_device}
        if not on_device:
            return out, [], None, ()
        bufs = self._acquire(on_device)
        events = _copy_async(on_device, bufs)
        out.update({n: to_numpy(bufs[n]) for n in on_device})
        pool = self._pool
        assert pool is not None
        return {n: out[n] for n in grads}, events, lambda: pool.put(bufs), tuple(on_device)

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

    def _activations(self) -> dict[str, np.ndarray]:
        out = {}
        for name, hook in self._act_hooks.items():
            a = hook.take()
            if a is None:
                raise SpecError(f"activations: module {name} produced no output since the previous record; "
                                "every hooked module must run in every recorded batch.")
            out[name] = a
        return out

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


def _scalar(x: Any) -> float:
    detach = getattr(x, "detach", None)
    return float(detach() if callable(detach) else x)


def _rank() -> int:
    import torch.distributed as dist

    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0
