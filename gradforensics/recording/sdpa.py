"""Attention statistics of any model: a tap on ``torch.nn.functional.scaled_dot_product_attention``.

``attention=`` of :class:`~gradforensics.recording.torch.TorchRecorder` on a model
whose attention is not a Hugging Face module (nanoGPT, torchtitan-style, most
research code) reads every ``scaled_dot_product_attention`` (SDPA) call made
inside the recorded model's forward - its ``query``, ``key``, ``attn_mask``,
``is_causal``, ``scale`` and ``enable_gqa`` (fewer key heads than query heads) -
and feeds them to the module's :class:`~gradforensics.recording.attention.HeadTap`,
the same statistics as the Hugging Face door (max logit, mean/min entropy, one-hot
share per head), computed on the call's device a block of queries at a time.

The door is public: a :class:`torch.overrides.TorchFunctionMode` entered by a
forward pre-hook of the recorded model and left by its forward hook
(``always_call``: left even when the forward raises), so nothing of
``torch.nn.functional`` is replaced and nothing runs outside the recorded
forward.  A call is attributed to the innermost selected module whose forward
is running (forward pre/post hooks keep the stack):

* ``attention=[globs]`` - the modules named; an SDPA call inside one of them is
  its module's (a nested selected module wins);
* ``attention="auto"`` on a model without Hugging Face attention modules - every
  module is watched during the first forward that calls SDPA; the modules that
  called it directly (innermost) are kept, the other hooks removed.

Gradient checkpointing: ``torch.utils.checkpoint`` re-runs a block's forward
during backward, outside the recorded model's forward; the mode is not entered
then, so the recomputed calls are not counted (the forward's own calls are,
reentrant checkpointing's ``no_grad`` forward included).  The same gate closes
the Hugging Face door during recomputation.  A model whose *whole* forward is
checkpointed by its caller would be counted twice; checkpoint inside the model.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import SpecError
from gradforensics.recording.attention import AttentionTaps, HeadTap, attention_modules, take_taps

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ModelTaps", "SdpaTaps", "open_taps"]

_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_CLAIMED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _is_hf_attention(m: Any) -> bool:
    return type(m).__name__.endswith("Attention") and hasattr(m, "config")


class ForwardScope:
    """Whether the recorded model's own forward is running (forward pre-hook / ``always_call`` forward hook)."""

    def __init__(self, model: nn.Module, enter: Any = None, leave: Any = None) -> None:
        self.depth = 0
        self._enter, self._leave = enter, leave
        self.hooks = [model.register_forward_pre_hook(self._pre),
                      model.register_forward_hook(self._post, always_call=True)]

    def open(self) -> bool:
        return self.depth > 0

    def _pre(self, module: Any, args: Any) -> None:
        self.depth += 1
        if self.depth == 1 and self._enter is not None:
            self._enter()

    def _post(self, module: Any, args: Any, out: Any) -> None:
        self.depth -= 1
        if self.depth == 0 and self._leave is not None:
            self._leave()

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


def _mode_class() -> type:
    from torch.overrides import TorchFunctionMode

    class SdpaMode(TorchFunctionMode):
        """Hands every ``scaled_dot_product_attention`` call to *taps*, then runs it unchanged."""

        def __init__(self, taps: SdpaTaps) -> None:
            super().__init__()
            self.taps = taps

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is self.taps.sdpa:
                self.taps.seen(dict(zip(_PARAMS, args, strict=False)) | kwargs)
            return func(*args, **kwargs)

    return SdpaMode


class SdpaTaps:
    """The SDPA taps of one recorder on *model*: *modules* (``None``: discover them on the first forward)."""

    def __init__(self, model: nn.Module, modules: dict[str, nn.Module] | None, block: int | None = None) -> None:
        import torch.nn.functional as F

        if model in _CLAIMED:
            raise SpecError(f"attention: {type(model).__name__} is already recorded by another open recorder.")
        self.sdpa = F.scaled_dot_product_attention
        self.block = block
        self.taps: dict[str, HeadTap] = {n: HeadTap(n) for n in (modules or {})}
        self._discover = modules is None
        self._stack: list[str] = []
        self._hooks: dict[str, list[Any]] = {}
        watch = {n: m for n, m in model.named_modules() if n} if modules is None else modules
        for n, m in watch.items():
            self._hooks[n] = [m.register_forward_pre_hook(lambda mod, a, n=n: self._stack.append(n)),
                              m.register_forward_hook(lambda mod, a, o, n=n: self._pop(n), always_call=True)]
        self._mode = _mode_class()(self)
        self.scope = ForwardScope(model, self._mode.__enter__, self._left)
        _CLAIMED[model] = True
        self._model = weakref.ref(model)

    def _pop(self, name: str) -> None:
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i] == name:
                del self._stack[i]
                return

    def _left(self) -> None:
        self._mode.__exit__(None, None, None)
        if self._discover and self.taps:     # discovery done: keep the hooks of the modules that call SDPA
            self._discover = False
            for n in [n for n in self._hooks if n not in self.taps]:
                for h in self._hooks.pop(n):
                    h.remove()

    def seen(self, call: dict[str, Any]) -> None:
        """One SDPA call inside the recorded forward: feed the innermost running selected module's tap."""
        if not self._stack:
            return
        name = self._stack[-1]
        tap = self.taps.get(name)
        if tap is None:
            if not self._discover:
                return
            tap = self.taps[name] = HeadTap(name)
        q, k, mask = call["query"], call["key"], call.get("attn_mask")
        if q.ndim == 3:                                   # (N, L, E): one head
            q, k = q[:, None], k[:, None]
            mask = mask[:, None] if mask is not None and mask.ndim == 3 else mask
        elif q.ndim > 4:
            q, k = q.flatten(0, q.ndim - 4), k.flatten(0, k.ndim - 4)
            mask = mask.flatten(0, mask.ndim - 4) if mask is not None and mask.ndim > 4 else mask
        tap.add(q, k, mask, call.get("scale"), causal=bool(call.get("is_causal", False)), block=self.block)

    def take(self) -> dict[str, dict[str, np.ndarray]]:
        """Every tapped module's ``(H,)`` statistics since the last call."""
        if not self.taps:
            model = self._model()
            what = (f"{type(model).__name__} ran no scaled_dot_product_attention call and has no Hugging Face "
                    "attention module")
            raise SpecError(f"attention='auto': {what}; give attention=[module globs].",
                            cli=f"--attention: {what}; give --attention GLOB (the modules that compute attention), "
                                "or capture without --attention.")
        return take_taps(self.taps, "made no scaled_dot_product_attention call since the previous record; "
                                    "name modules that call it in every recorded batch.")

    def remove(self) -> None:
        """Remove every hook and release the model (idempotent)."""
        for hs in self._hooks.values():
            for h in hs:
                h.remove()
        self._hooks.clear()
        self.scope.remove()
        model = self._model()
        if model is not None:
            _CLAIMED.pop(model, None)


class ModelTaps:
    """The attention taps of one recorder: the Hugging Face door and/or the SDPA door, one ``take``/``remove``."""

    def __init__(self, hf: AttentionTaps | None, sdpa: SdpaTaps | None, scope: ForwardScope | None) -> None:
        self.hf, self.sdpa, self.scope = hf, sdpa, scope
        gate = (sdpa.scope if sdpa is not None else scope)
        if hf is not None and gate is not None:
            for tap in hf.taps.values():
                tap.gate = gate.open

    def take(self) -> dict[str, dict[str, np.ndarray]]:
        out = self.hf.take() if self.hf is not None else {}
        if self.sdpa is not None:
            out.update(self.sdpa.take())
        return out

    def remove(self) -> None:
        for t in (self.hf, self.sdpa, self.scope):
            if t is not None:
                t.remove()


def open_taps(model: nn.Module, spec: str | Sequence[str], block: int | None = None) -> ModelTaps:
    """The taps ``attention=spec`` asks for on *model*.

    ``"auto"``: the Hugging Face attention modules if the model has any, else every module
    that calls SDPA (found on the first forward).  Globs: Hugging Face attention modules
    through the Hugging Face door, every other module through the SDPA door.

    Raises
    ------
    SpecError
        A glob that matches no module; a module already recorded by another open recorder.
    AttentionUnavailableError
        A Hugging Face module running SDPA/flash attention (load it with eager attention).
    """
    named = dict(model.named_modules())
    if spec == "auto":
        has_hf = any(n and _is_hf_attention(m) for n, m in named.items())
        hf_mods = attention_modules(model, "auto") if has_hf else {}
        own: dict[str, nn.Module] | None = None if not has_hf else {}
    else:
        hf_mods, own = {}, {}
        for glob in [spec] if isinstance(spec, str) else list(spec):
            hits = {n: m for n, m in named.items() if n and fnmatch.fnmatchcase(n, glob)}
            if not hits:
                raise SpecError(f"attention: glob {glob!r} matches no module of {type(model).__name__}.")
            for n, m in hits.items():
                (hf_mods if _is_hf_attention(m) else own)[n] = m
        if hf_mods:
            hf_mods = attention_modules(model, [_literal(n) for n in hf_mods])
    hf = AttentionTaps(model, hf_mods) if hf_mods else None
    try:
        sdpa = SdpaTaps(model, own, block) if own is None or own else None
        scope = ForwardScope(model) if hf is not None and sdpa is None else None
    except BaseException:
        if hf is not None:
            hf.remove()
        raise
    return ModelTaps(hf, sdpa, scope)


def _literal(name: str) -> str:
    """A glob matching exactly *name*."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)

