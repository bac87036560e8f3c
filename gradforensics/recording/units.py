"""Which axis of a module's output holds its units (channels, features, hidden size).

Activation statistics are kept per *unit*: a channel of a convolution, a feature
of a linear layer, a hidden unit of a recurrent layer.  The unit axis of a hooked
module's output is found, in this order:

1. ``unit_axes={glob: axis}`` given to the recorder (the axis of the output as
   the module returns it; negative counts from the end);
2. the module's kind:

   * channel-first modules - ``nn.Conv1d/2d/3d`` (and transposed), ``nn.BatchNorm1d/2d/3d``,
     ``nn.SyncBatchNorm``, ``nn.InstanceNorm1d/2d/3d``, ``nn.GroupNorm``, the pooling modules
     (``MaxPool``, ``AvgPool``, ``AdaptiveMax/AvgPool``, ``LPPool``, ``FractionalMaxPool``) and
     ``nn.Dropout1d/2d/3d``: the channel axis, axis 1 of a batched output (``N, C, ...``)
     and axis 0 of an unbatched one;
   * ``nn.Linear``, ``nn.Bilinear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``,
     ``nn.RNN/GRU/LSTM`` (the output tuple's first element, ``batch_first`` or not: its
     hidden axis is the last), ``nn.MultiheadAttention``: the last axis;

3. any other module (activation functions such as ``nn.ReLU`` or a library's
   ``GELUActivation``, dropout, identity, a module of your own): the axis of the
   tensor it was given.  During the model's first forward every module is
   watched; when the hooked module's input is the output of another module and it
   returns a tensor of the same shape, it takes that module's unit axis (rules 1-3
   again, so ``Conv2d -> BatchNorm2d -> ReLU -> Dropout`` all use the channel axis);
4. otherwise (the input came from a function, not a module; the shape changed): a 3-D
   output of a module with weights (GPT-2's ``Conv1D``, a block of your own) takes the
   axis, last or 1, whose length is one of its weights' dimensions when the other's is
   not; else by the output's rank: 4-D and 5-D outputs are channel-first images and volumes
   (axis 1), anything else uses its last axis - with a warning when a hooked
   module's 3-D output (``(N, T, D)`` or ``(N, C, L)``?) gets its axis so.

The rule used is stored (attribute ``unit_axis_from`` of ``acts/<module>/hist``)
beside ``unit_axis`` and ``units``.
"""

from __future__ import annotations

import fnmatch
import warnings
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["AxisFinder", "kind_axis"]


def _channel_kinds() -> dict[type, int | None]:
    """Channel-first module classes -> their number of spatial axes (``None``: any, channel axis 1)."""
    from torch import nn

    out: dict[type, int | None] = {}
    for d in (1, 2, 3):
        for stem in ("Conv{}d", "ConvTranspose{}d", "InstanceNorm{}d", "MaxPool{}d", "AvgPool{}d",
                     "AdaptiveMaxPool{}d", "AdaptiveAvgPool{}d", "LPPool{}d", "FractionalMaxPool{}d",
                     "Dropout{}d"):
            cls = getattr(nn, stem.format(d), None)
            if isinstance(cls, type):
                out[cls] = d
        bn = getattr(nn, f"BatchNorm{d}d", None)
        if isinstance(bn, type):
            out[bn] = None
    for name in ("SyncBatchNorm", "GroupNorm"):
        cls = getattr(nn, name, None)
        if isinstance(cls, type):
            out[cls] = None
    return out


def _last_kinds() -> tuple[type, ...]:
    from torch import nn

    names = ("Linear", "Bilinear", "Embedding", "EmbeddingBag", "LayerNorm", "RMSNorm", "RNN", "GRU", "LSTM",
             "MultiheadAttention")
    return tuple(c for c in (getattr(nn, n, None) for n in names) if isinstance(c, type))


def kind_axis(module: nn.Module, ndim: int) -> tuple[int, str] | None:
    """``(axis, rule)`` from the module's kind for an output of rank *ndim*, or ``None`` for other kinds."""
    kind = type(module).__name__
    for cls, spatial in _channel_kinds().items():
        if isinstance(module, cls):
            axis = 1 if spatial is None else ndim - 1 - spatial
            return max(min(axis, ndim - 1), 0), f"module kind {kind}: channel axis"
    if isinstance(module, _last_kinds()):
        return ndim - 1, f"module kind {kind}: last axis"
    return None


class AxisFinder:
    """Finds the unit axis of each hooked module at its first forward (see the module docstring).

    While a hooked module of another kind is unresolved, a forward hook on every
    module of *model* (put on when the model's forward starts) notes which module
    produced which tensor; they are removed as soon as every hooked module is
    resolved (in the first forward).
    """

    def __init__(self, model: nn.Module, hooked: Mapping[str, nn.Module],
                 unit_axes: Mapping[str, int] | None = None) -> None:
        self.unit_axes = dict(unit_axes or {})
        for glob, axis in self.unit_axes.items():
            if not isinstance(axis, int) or isinstance(axis, bool):
                raise SpecError(f"unit_axes[{glob!r}] must be an int axis of the module's output; got {axis!r}.")
            if not any(fnmatch.fnmatchcase(n, glob) for n in hooked):
                raise SpecError(f"unit_axes: glob {glob!r} matches none of the hooked activation modules "
                                f"({', '.join(list(hooked)[:3])}).")
        self.modules = dict(model.named_modules())
        #: resolved (negative axis, rule) per module name
        self.resolved: dict[str, tuple[int, str]] = {}
        self._seen: dict[int, tuple[weakref.ref[Any], str, int, str]] = {}
        self._pending = {n for n, m in hooked.items()
                         if self._override(n) is None and kind_axis(m, 4) is None}
        self._hooks: list[Any] = []
        if self._pending:    # the watchers go on at the start of the model's first forward
            self._hooks.append(model.register_forward_pre_hook(self._install))
        self._model = model

    def _install(self, module: nn.Module, args: Any) -> None:
        if len(self._hooks) == 1:
            for name, m in self._model.named_modules():
                self._hooks.append(m.register_forward_hook(self._watch(name)))

    def _override(self, name: str) -> int | None:
        return next((a for g, a in self.unit_axes.items() if fnmatch.fnmatchcase(name, g)), None)

    def _watch(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            import torch

            out = output[0] if isinstance(output, (tuple, list)) and output else output
            old = self._seen.get(id(out)) if isinstance(out, torch.Tensor) else None
            if isinstance(out, torch.Tensor) and (old is None or old[0]() is not out):   # the innermost keeps it
                neg, rule = self._find(name, module, args, out, max(int(out.ndim), 1))
                self._seen[id(out)] = (weakref.ref(out), name, neg, rule)
        return hook

    def axis(self, name: str, module: nn.Module, args: Any, out: Any) -> tuple[int, str]:
        """The non-negative unit axis of *out* (the module's output) and the rule that gave it."""
        ndim = max(int(out.ndim), 1)
        if name not in self.resolved:
            self.resolved[name] = self._find(name, module, args, out, ndim)
            if "rank 3" in self.resolved[name][1]:
                warnings.warn(f"gradforensics: activations: {name}'s 3-D output is taken as (N, T, units) (last "
                              f"axis; {self.resolved[name][1]}). For (N, C, L) pass unit_axes={{{name!r}: 1}}.",
                              RuntimeWarning, stacklevel=4)
            self._pending.discard(name)
            if not self._pending:
                self.remove()
        neg, rule = self.resolved[name]
        axis = neg + ndim
        if not 0 <= axis < ndim:
            raise SpecError(f"activations: module {name} returned a {ndim}-D output; its unit axis {neg} "
                            f"({rule}) is not one of its axes. Pass unit_axes={{{name!r}: AXIS}}.")
        return axis, rule

    def _find(self, name: str, module: nn.Module, args: Any, out: Any, ndim: int) -> tuple[int, str]:
        """(negative axis, rule) of *out*: rules 1-4 of the module docstring."""
        if name in self.resolved:
            return self.resolved[name]
        given = self._override(name)
        if given is not None:
            if not -ndim <= given < ndim:
                raise SpecError(f"unit_axes: axis {given} for {name} is not an axis of its {ndim}-D output.")
            return (given if given < 0 else given - ndim), "unit_axes option"
        kind = kind_axis(module, ndim)
        if kind is not None:
            return kind[0] - ndim, kind[1]
        src = self._producer(args, out)
        if src is not None:
            producer, neg, rule = src
            return neg, rule if rule.startswith("input from") else f"input from {producer}: {rule}"
        if ndim == 3:
            by_weights = _by_weights(module, tuple(out.shape))
            if by_weights is not None:
                return by_weights
        return _by_rank(ndim)

    def _producer(self, args: Any, out: Any) -> tuple[str, int, str] | None:
        import torch

        x = args[0] if isinstance(args, tuple) and args else None
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(out.shape):
            return None
        seen = self._seen.get(id(x))
        if seen is None or seen[0]() is not x:
            return None
        return seen[1], seen[2], seen[3]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._seen.clear()


def _by_rank(ndim: int) -> tuple[int, str]:
    if ndim in (4, 5):
        return 1 - ndim, f"rank {ndim}: channel axis 1"
    return -1, f"rank {ndim}: last axis"


def _by_weights(module: nn.Module, shape: tuple[int, ...]) -> tuple[int, str] | None:
    """A 3-D output of a module of another kind with weights (GPT-2's ``Conv1D``, a block of your own):
    the axis, last or 1, whose length is a dimension of its weights when the other's is not."""
    dims = {int(d) for p in module.parameters() for d in p.shape}
    last, chan = shape[-1] in dims, shape[1] in dims
    if last != chan:
        return (-1, f"{type(module).__name__}'s weights have {shape[-1]}: last axis") if last else \
            (-2, f"{type(module).__name__}'s weights have {shape[1]}: channel axis 1")
    return None
