"""The PyTorch recorder: ``gf.Recorder(path, model=model, ...)``.

:class:`TorchRecorder` reads ``param.grad`` of the selected parameters when
``record()`` is called - so under gradient accumulation it stores the sum over
the micro-batches, exactly what the optimizer will see - keeps the outputs of
hooked modules since the previous record, and hands everything to the
framework-agnostic :class:`~gradforensics.recording.recorder.ArrayRecorder`
(its base class), whose background thread splits heads, sketches, computes
activation statistics and writes.

On CUDA the gradients cross to the host asynchronously, through reused pinned
buffers (:mod:`gradforensics.recording.hostcopy`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import SpecError
from gradforensics.recording import distributed
from gradforensics.recording.actstats import (
    BOUNDED,
    ActHook,
    ActRange,
    combine,
    finish,
    make_range_torch,
    partial_stats,
    with_scale,
)
from gradforensics.recording.autoheads import resolve_heads
from gradforensics.recording.encoding import mixture_row
from gradforensics.recording.experts import ExpertPlan, ModelAuxTap, RouterTaps, resolve_experts, stack_units
from gradforensics.recording.hostcopy import HostCopies, device_copies_done, to_numpy
from gradforensics.recording.logits import LogitTaps, logit_modules
from gradforensics.recording.recorder import ArrayRecorder
from gradforensics.recording.sdpa import open_taps
from gradforensics.recording.selection import model_info, run_dtypes, select_modules, select_parameters
from gradforensics.recording.sketch import DeviceSketch
from gradforensics.recording.units import AxisFinder
from gradforensics.store.names import check_name
from gradforensics.store.schema import MODEL_AUX_LOSS

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["TorchRecorder", "torch_float32"]




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
        the previous record) and summarised per unit, the units on the module kind's
        feature axis (:mod:`gradforensics.recording.units`: channels of convolutions,
        BatchNorm and pooling; the last axis of Linear and RNN outputs; for activation
        functions the axis of the module that made their input).  Known bounded
        activations (``nn.Tanh``, ``nn.Sigmoid``, ``nn.Hardtanh``, ...) get their bounds.
    unit_axes
        ``{module_glob: axis}``: the unit axis of those hooked modules' outputs,
        overriding the rule.
    weights_every
        Snapshot the recorded weights every ``k`` records (record 0 included);
        ``None``: never.
    attention
        ``"auto"`` (every Hugging Face attention module; in a model without any,
        every module that calls ``scaled_dot_product_attention``, found on the
        first forward) or module globs: per record and head, the max attention
        logit, the mean and minimum attention entropy and the share of one-hot
        queries, reduced on the device (:mod:`gradforensics.recording.attention`,
        :mod:`gradforensics.recording.sdpa`).  A Hugging Face model must run
        eager attention (``attn_implementation="eager"``); its SDPA/flash are refused.
    logits
        ``"auto"`` (the output embedding / ``lm_head``, tied included) or module globs: per
        record log Z and logit statistics of the output logits, and the output embedding's
        row-norm ratio at weight snapshots (:mod:`gradforensics.recording.logits`).
    experts
        ``"auto"`` or ``{experts module glob: E}``: mixture-of-experts layers
        (:mod:`gradforensics.recording.experts`): each expert weight is recorded as one
        unit ``(E, ...)`` (fused ``(E, ...)`` tensors as they are, an ``nn.ModuleList``'s
        same-named weights stacked), stored ``(N, E, ...)`` with the attribute ``experts``,
        and each router's weight is recorded with, per record, its load per expert, the
        largest share, the entropy of its mean routing distribution, its mean squared
        log-sum-exp and its load-balancing loss (``router/<router>/...``); the model's own
        reported ``aux_loss`` as ``router/aux_loss``.  With ``sketch=`` each expert is
        sketched on its own.  Taken under DDP and FSDP2 (router sums all-reduced).
    optimizer, optimizer_every
        An Adam-family ``torch.optim`` optimizer of *model*: every ``optimizer_every`` records
        its state is summarised per tensor and per row (:mod:`gradforensics.recording.optimlive`).
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
                 attention: str | Sequence[str] | None = None, unit_axes: Mapping[str, int] | None = None,
                 logits: str | Sequence[str] | None = None, optimizer: Any = None, optimizer_every: int = 1,
                 experts: str | Mapping[str, int] | None = None, **kwargs: Any) -> None:
        _check_options(sketch_on, weights_every, kwargs)
        self.model = model
        self.dist = distributed.context(model)
        named = distributed.unwrap(model)     # DDP's parameter names without "module."
        self.params = select_parameters(named, tensors)
        self.experts_plan = plan = resolve_experts(named, experts)
        self.params = _with_experts(named, self.params, plan, tensors is None)
        self._listed = {u: ms for u, ms in plan.listed.items() if all(m in self.params for m in ms)}
        partial = [u for u, ms in plan.listed.items() if u not in self._listed and any(m in self.params for m in ms)]
        if partial:
            raise SpecError(f"tensors: selects some but not all experts of {partial[0]}; select all of them "
                            f"({plan.listed[partial[0]][0]} ...) or none.")
        shapes = stack_units({n: tuple(p.shape) for n, p in self.params.items()}, self._listed,
                             lambda xs: (len(xs), *xs[0]))
        self._names = tuple(shapes)
        unit_e = {u: e for u, e in plan.units.items() if u in shapes}
        if not self.params:
            raise SpecError(f"tensors: {type(named).__name__} has no trainable 2-D weight to record; "
                            "pass tensors=[globs].",
                            cli=f"--tensors: {type(named).__name__} has no trainable 2-D weight to record; "
                                "pass --tensors GLOB.")
        specs = resolve_heads(named, shapes, heads)
        specs = {n: s for n, s in specs.items() if n not in unit_e}
        self._act_modules = select_modules(named, activations)
        if attention and self.dist is not None and self.dist.kind == "fsdp":
            raise SpecError("FSDP capture does not take attention= yet; record it from a DDP or single-process run.")
        if (logits or optimizer is not None) and self.dist is not None and self.dist.kind == "fsdp":
            raise SpecError("FSDP capture does not take logits= or optimizer= yet; record them from a DDP or "
                            "single-process run.")
        if self.dist is not None:
            _check_distributed(self.dist, activations, weights_every, kwargs)
            kwargs["ranks"] = self.dist.plan()
        bounds = {n: BOUNDED[type(m).__name__.lower()] for n, m in self._act_modules.items()
                  if type(m).__name__.lower() in BOUNDED}
        bounds.update(act_bounds or {})
        self.weights_every = weights_every
        kwargs["dtypes"] = run_dtypes(named, kwargs.get("dtypes"))
        self._attn = open_taps(named, attention) if attention else None
        try:
            super().__init__(path, sources=sources, heads=specs, act_bounds=bounds, framework="torch",
                             model_info=model_info(named), experts=unit_e, **kwargs)
        except BaseException:
            if self._attn is not None:
                self._attn.remove()
            raise
        self.head_specs = specs
        self._unit_e = unit_e          # experts units: sketched per expert
        self._local = distributed.LocalGrads(model, self.params) if self.dist and self.dist.kind == "ddp" else None
        on_device = self.sketcher is not None and self.sketcher.method == "countsketch" and (
            sketch_on == "device" or (self.dist is not None and self.dist.kind == "fsdp"))
        self._device_sketch = DeviceSketch(self.sketcher) if on_device and self.sketcher else None
        #: Bytes copied from the gradients' device to the host, all records so far (sketches included).
        self.host_bytes = 0
        if self._device_sketch is not None:
            self.device_sketched = frozenset(self._names)
        self._full_names = tuple(n for n in self._names if any(fnmatch.fnmatchcase(n, pat) for pat in self.full))
        self._steps = 0
        self._hooks: list[Any] = []
        self._axes = AxisFinder(named, self._act_modules, unit_axes) if self._act_modules or unit_axes else None
        self._act_hooks = {n: ActHook(n, self._axes) for n in self._act_modules}
        for n, m in self._act_modules.items():
            self._hooks.append(m.register_forward_hook(self._act_hooks[n]))
        self._logits = LogitTaps(logit_modules(named, logits)) if logits else None
        self._routers = RouterTaps(plan.routers) if plan.routers else None
        self._aux = ModelAuxTap(model) if plan.routers else None
        self._aux_on: bool | None = None      # the model reported aux_loss at record 0: written at every record
        self._optim = None
        if optimizer is not None:
            from gradforensics.recording.optimlive import LiveOptim

            self._optim = LiveOptim(named, optimizer, optimizer_every)
        self._warned: set[str] = set()
        self._batch_rows = 0                  # rows the model's forwards took since the last record (n_samples)
        self._batch_hook: Any = model.register_forward_pre_hook(self._count_rows, with_kwargs=True)
        self._copies = HostCopies(self._raise_if_failed,
                                  lambda: self._queue is None or self._queue.unfinished_tasks == 0)

    # ------------------------------------------------------------------ API
    def record(self, *, step: int | None = None, loss: Any = math.nan, source: str | None = None,
               mixture: Mapping[str, float] | None = None, n_samples: int | None = None, lr: float = math.nan,
               rank: int | None = None, time: float | None = None, grads: Mapping[str, Any] | None = None,
               activations: Mapping[str, Any] | None = None, weights: Mapping[str, Any] | None = None,
               attention: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Record the current ``.grad`` of the selected parameters, and the hooked activations.

        Call it after ``loss.backward()`` (after the last micro-batch) and before
        ``optimizer.zero_grad()``.  Returns without waiting for the device copy.
        *grads*, *activations*, *weights*, *attention*: extra NumPy arrays recorded alongside
        (names must differ from the model's).

        *n_samples*: the samples this record's gradient averages over (the noise analysis
        reads it).  Not given, it is inferred: the leading dimension of the first tensor
        argument of each call of *model* with gradients enabled since the previous record,
        summed (micro-batches of gradient accumulation add up; calls under ``torch.no_grad()``,
        an evaluation, do not count).  Pass it where that is not the batch: sequence-first
        inputs, two calls per batch, a loss averaged over tokens you want counted.  With no
        such call seen (a model called through something else), it is 1, with a warning, once.
        """
        n_samples = self._n_samples(n_samples)
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
            n = self.n_records
            if self._logits is not None:
                pending.rows.update(self._logits.take(self.weights_every is None or n % self.weights_every == 0))
            if self._optim is not None:
                pending.rows.update(self._optim.take(n))
            if self._routers is not None:
                pending.rows.update(self._routers.take())
            pending.rows.update(self._take_aux())
            clash = sorted(set(pending.act_stats) & set(pending.acts))
            if clash:
                raise SpecError(f"record(): activations[{clash[0]!r}] is already recorded from the model; "
                                "give extras other names.")
        except BaseException:
            if release is not None:
                release()
            raise
        if events or release is not None:
            pending.settle = device_copies_done(pending.grads, events, release, on_device)
        pending.sketches = sketches
        self._submit(pending)

    def _take_aux(self, reduce: Callable[[Any], Any] | None = None) -> dict[str, tuple[np.ndarray, dict[str, Any]]]:
        """``router/aux_loss`` of this record: written from record 0 on when the model reported one there
        (NaN at a later record without one), never when it did not.  *reduce*: under FSDP (collective)."""
        if self._aux is None:
            return {}
        v = self._aux.take(reduce)
        if self._aux_on is None:
            self._aux_on = v is not None
        if not self._aux_on:
            return {}
        return {MODEL_AUX_LOSS: (np.asarray(np.nan if v is None else v, dtype=np.float32), {})}

    def _count_rows(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the model: add the leading dimension of its first tensor argument (with grad on)."""
        import torch

        if not torch.is_grad_enabled():
            return
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and first.ndim >= 1:
            self._batch_rows += int(first.shape[0])

    def _n_samples(self, given: int | None) -> int:
        """*given*, else the rows the model's forwards took since the last record (see :meth:`record`)."""
        seen, self._batch_rows = self._batch_rows, 0
        if given is not None:
            return int(given)
        if seen:
            return seen
        if "n_samples" not in self._warned:
            self._warned.add("n_samples")
            warnings.warn("gradforensics: record(): n_samples not given and no call of the model with gradients "
                          "was seen since the previous record to read the batch size from; recording 1 (the "
                          "noise analysis reads it: pass record(n_samples=BATCH_SIZE)).", RuntimeWarning,
                          stacklevel=3)
        return 1

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
        fused = {n for n in self._unit_e if n not in self._listed}       # sketched per expert (rows of axis 0)
        sketches = distributed.fsdp_sketches(grads, self.head_specs, self._device_sketch, rows=fused) \
            if self._device_sketch is not None else {}
        sketches = stack_units(sketches, self._listed, np.stack)          # a listed unit: its members' sketches
        shapes = stack_units({n: (tuple(g.shape), _dtype_name(g)) for n, g in grads.items()}, self._listed,
                             lambda xs: ((len(xs), *xs[0][0]), xs[0][1]))
        owner = t % self.dist.world
        whole = {n: self._gather_unit(grads, n, owner) for n in self._full_names}   # collective
        loss_all, n_all, mix = distributed.reduce_meta(loss, n_samples, mixture_row(self.sources, source, mixture))
        device = next(iter(grads.values())).device

        def reduce(x: Any) -> Any:           # collective: the sum over the ranks, on the gradients' device
            import torch.distributed as dist

            x = x.to(device)
            dist.all_reduce(x)
            return x

        rows = self._routers.take(reduce) if self._routers is not None else {}
        rows.update(self._take_aux(reduce))
        if owner != self.dist.rank:
            return
        pending = self._make_pending(
            step=t if step is None else step, loss=loss_all, source=None,
            mixture=dict(zip(self.sources, map(float, mix), strict=True)), n_samples=n_all, lr=lr,
            rank=self.dist.rank, time=time,
            grads={n: to_numpy(w.detach().cpu()) for n, w in whole.items() if w is not None},
            activations=None, weights=None, copy=False)
        pending.sketches = {n: (sk, *shapes[n]) for n, sk in sketches.items()}
        pending.rows.update(rows)
        self._submit(pending)

    def _gather_unit(self, grads: Mapping[str, Any], name: str, owner: int) -> Any:
        """The whole gradient of *name* on rank *owner* (None elsewhere); a listed unit's members stacked."""
        members = self._listed.get(name)
        if members is None:
            return distributed.gather_full(grads[name], owner)
        parts = [distributed.gather_full(grads[m], owner) for m in members]
        whole = [p for p in parts if p is not None]
        if len(whole) < len(parts):
            return None
        import torch

        return torch.stack(whole)

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
        batch_hook = getattr(self, "_batch_hook", None)
        if batch_hook is not None:
            batch_hook.remove()
            self._batch_hook = None
        axes = getattr(self, "_axes", None)
        if axes is not None:
            axes.remove()
        taps = getattr(self, "_attn", None)
        if taps is not None:
            taps.remove()
        logit_taps = getattr(self, "_logits", None)
        if logit_taps is not None:
            logit_taps.remove()
        routers = getattr(self, "_routers", None)
        if routers is not None:
            routers.remove()
        aux = getattr(self, "_aux", None)
        if aux is not None:
            aux.remove()
        if self._local is not None:
            self._local.remove()

    @property
    def n_hooks(self) -> int:
        """Forward hooks in place on the recorded modules (0 after :meth:`close`); the model's own pre-hook,
        which counts the batch for ``n_samples``, is not one of them (it goes at :meth:`close` too)."""
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
        grads = stack_units({n: self._grad_of(n, p) for n, p in self.params.items()}, self._listed)
        sketches = {}
        if self._device_sketch is not None:
            for n, g in grads.items():
                sk = self._device_sketch.project_rows(g) if n in self._unit_e else \
                    self._device_sketch.project_heads(g, self.head_specs.get(n))
                sketches[n] = (sk.to(torch_float32()).cpu().numpy(), tuple(g.shape), _dtype_name(g))
            grads = {n: grads[n] for n in self._full_names}
        self.host_bytes += sum(sk.nbytes for sk, _, _ in sketches.values()) + \
            sum(g.numel() * g.element_size() for g in grads.values())
        out, events, release, on_device = self._copies.start(grads)
        return out, events, release, on_device, sketches

    def _activations(self) -> dict[str, dict[str, np.ndarray]]:
        """Every hooked module's statistics since the last record, reduced on the device (see :class:`~gradforensics.recording.actstats.ActHook`)."""
        out = {}
        for name, hook in self._act_hooks.items():
            first, sums = hook.take()
            if first is None and sums is None:
                raise SpecError(f"activations: module {name} produced no output since the previous record; "
                                "every hooked module must run in every recorded batch.")
            if first is not None:     # the module's first record: fix its range from it (all ranks alike)
                check_name(name, "activations module")
                hook.rng = self._ranges[name] = dataclasses.replace(
                    self._agreed_range(first, self._bounds_for(name)), unit_axis=hook.unit_axis, units=hook.units,
                    unit_axis_from=hook.unit_axis_from)
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
        return {n: to_numpy(p.detach().to("cpu", copy=True))
                for n, p in stack_units({n: p.detach() for n, p in self.params.items()}, self._listed).items()}


def _with_experts(model: nn.Module, params: dict[str, torch.nn.Parameter], plan: ExpertPlan,
                  default: bool) -> dict[str, torch.nn.Parameter]:
    """*params* and, under the default selection, every experts unit's tensors and every router's weight
    (in model order)."""
    if not default or not plan.units:
        return params
    routers = {f"{r}.weight" for r in plan.routers}
    want = set(params) | set(plan.units) | plan.members | routers
    return {n: p for n, p in model.named_parameters() if n in want and p.requires_grad}


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


def _check_options(sketch_on: str, weights_every: int | None, kwargs: Mapping[str, Any]) -> None:
    """The recorder's own options, and the base-class ones it sets itself (one line each)."""
    if sketch_on not in ("device", "host"):
        raise SpecError(f"sketch_on must be 'device' or 'host'; got {sketch_on!r}.")
    if weights_every is not None and (not isinstance(weights_every, int) or weights_every < 1):
        raise SpecError(f"weights_every must be a positive int or None; got {weights_every!r}.")
    for key in ("framework", "model_info"):
        if key in kwargs:
            raise SpecError(f"{key}= is set by the PyTorch recorder from the model; do not pass it.")


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
