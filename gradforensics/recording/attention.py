"""Per-head attention statistics, computed where the attention runs: ``attention=`` of the recorders.

Per record and head (``attn/<module>/<stat>``, float32 ``(N, H)``):

* ``max_logit`` - the largest pre-softmax logit ``q·k·scaling`` (``scaling`` is
  ``1/√d`` unless the model says otherwise), after the position encoding (RoPE is
  applied to q and k before the attention kernel), over the batch's query/key
  pairs the mask allows;
* ``entropy_mean``, ``entropy_min`` - the attention entropy of each query,
  normalised by ``log n`` (``n`` the keys it may attend to, so 1 is uniform and 0
  one-hot), averaged and minimised over the batch's queries;
* ``onehot_frac`` - the share of those queries whose largest attention probability
  exceeds :data:`ONEHOT` (0.99).

Queries that may attend to one key only (the first position of a causal model)
or to none (padding) have no choice to make and are left out.  Micro-batches
between two records are combined (max of maxima, min of minima, summed counts).

How the logits are seen: the Hugging Face families (LLaMA/Mistral/Qwen incl. GQA,
GPT-2, GPT-NeoX, BERT, Phi-3) call their attention through transformers'
``AttentionInterface`` under the name their config selects.  gradforensics
registers its own entry there, :data:`IMPLEMENTATION` (``"gradforensics_eager"``,
:func:`tapped_eager`, with the eager mask in ``AttentionMaskInterface``), and a
recorder with ``attention=`` switches the recorded model to it with the public
``model.set_attn_implementation`` - and back to the model's own ``"eager"`` when
it closes.  The entry runs the model's own eager function (its output is the
model's output) and, for the modules being recorded, reduces the same query and
key tensors to ``(H,)`` statistics on their device; only those cross to the
host, at ``record()``.  No entry of transformers' own is replaced.  A model whose
attention runs in SDPA or flash kernels is refused in one line
(:class:`~gradforensics.errors.AttentionUnavailableError`) saying to load it with
``attn_implementation="eager"``.

The statistics are fed by a door (here the Hugging Face one) that hands each
call's query, key, mask and scaling to the module's :class:`HeadTap`; the other
door, :mod:`gradforensics.recording.sdpa`, feeds the same taps from every
``torch.nn.functional.scaled_dot_product_attention`` call of a model outside
transformers.
"""

from __future__ import annotations

import fnmatch
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics._compat import attn_implementation
from gradforensics.errors import AttentionUnavailableError, SpecError
from gradforensics.store.schema import ATTN_FIELDS

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["IMPLEMENTATION", "ONEHOT", "STATS", "AttentionTaps", "HeadTap", "attention_modules", "finish",
           "head_stats", "merge", "switchable_roots", "take_taps", "tapped_eager", "use_eager_attention"]


STATS = ATTN_FIELDS
ONEHOT = 0.99
#: The name of gradforensics' entry in transformers' attention interface.
IMPLEMENTATION = "gradforensics_eager"
_TAPS: weakref.WeakKeyDictionary[Any, HeadTap] = weakref.WeakKeyDictionary()
_SWITCHED: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()   # root -> [own impl, users]
_LOCK = threading.Lock()


# ------------------------------------------------------------------ the maths
def allowed_keys(mask: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """Boolean ``(B, 1|H, Q, K)`` of the key positions each query may attend to (``mask`` as eager gets it)."""
    import torch

    if mask is None:
        return torch.ones((1, 1, *shape[-2:]), dtype=torch.bool)
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2      # additive mask: 0 allowed, the dtype's minimum not


def head_stats(logits: torch.Tensor, allowed: torch.Tensor) -> dict[str, torch.Tensor]:
    """Partial statistics ``{max_logit, ent_sum, ent_min, onehot, n}`` of one batch, each ``(H,)``, on the device.

    *logits* ``(B, H, Q, K)`` are the pre-softmax ``q·k·scaling`` (mask not added);
    *allowed* broadcasts against them.
    """
    import torch

    s = logits.to(torch.float32)
    ok = allowed.to(s.device)
    n_keys = ok.sum(-1).expand(s.shape[:-1])                    # (B, H, Q)
    chosen = n_keys >= 2                                         # queries with a choice to make
    s_in = s.masked_fill(~ok, float("-inf"))
    row_max = s_in.amax(-1)                                      # the query's max logit
    z = s_in - row_max[..., None]                                # <= 0 where allowed, -inf where not
    e = z.exp()
    total = e.sum(-1)
    lse = total.log()                                            # log-sum-exp of z: p_max = exp(-lse)
    ent = (lse - (e * torch.where(ok, z, 0.0)).sum(-1) / total) / torch.log(n_keys.clamp(min=2).to(s.dtype))
    inf = torch.tensor(float("inf"), device=s.device)
    return {
        "max_logit": torch.where(chosen, row_max, -inf).amax(dim=(0, 2)),
        "ent_sum": torch.where(chosen, ent, 0.0).sum(dim=(0, 2)),
        "ent_min": torch.where(chosen, ent, inf).amin(dim=(0, 2)),
        "onehot": (chosen & (lse < -np.log(ONEHOT))).sum(dim=(0, 2)).to(torch.float32),
        "n": chosen.sum(dim=(0, 2)).to(torch.float32),
    }


def merge(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Combine the partial statistics of two micro-batches."""
    import torch

    if a is None:
        return b
    return {"max_logit": torch.maximum(a["max_logit"], b["max_logit"]), "ent_min": torch.minimum(a["ent_min"], b["ent_min"]),
            "ent_sum": a["ent_sum"] + b["ent_sum"], "onehot": a["onehot"] + b["onehot"], "n": a["n"] + b["n"]}


def finish(part: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The record's ``(H,)`` statistics on the host (NaN for a head that saw no query with a choice)."""
    import torch

    n = part["n"]
    none = n == 0
    nan = torch.tensor(float("nan"), device=n.device)
    out = {"max_logit": torch.where(none, nan, part["max_logit"]),
           "entropy_mean": torch.where(none, nan, part["ent_sum"] / n.clamp(min=1)),
           "entropy_min": torch.where(none, nan, part["ent_min"]),
           "onehot_frac": torch.where(none, nan, part["onehot"] / n.clamp(min=1))}
    host = torch.stack([out[k] for k in STATS]).to("cpu", torch.float32).numpy()
    return {k: host[i].copy() for i, k in enumerate(STATS)}


def take_taps(taps: dict[str, HeadTap], missing: str) -> dict[str, dict[str, np.ndarray]]:
    """Every tap's ``(H,)`` statistics since the last call, each tap emptied; a tap that saw no call is
    refused: ``attention: module <name> <missing>``."""
    out = {}
    for name, tap in taps.items():
        part, tap.part = tap.part, None
        if part is None:
            raise SpecError(f"attention: module {name} {missing}")
        out[name] = finish(part)
    return out


def logits_of(query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """``q·kᵀ·scaling`` in float32, ``(B, H, Q, K)``; grouped key heads (GQA) repeated to the query heads."""
    import torch

    q, k = query.detach().to(torch.float32), key.detach().to(torch.float32)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else float(scaling))


# ------------------------------------------------------------------ the taps
class HeadTap:
    """The running statistics of one attention module since the last record, fed by a door with each call's tensors.

    *gate*: when given, a call is counted only while it returns true (the recorded model's own forward
    is running: a forward re-run by gradient checkpointing during backward is not counted twice).
    """

    def __init__(self, name: str, gate: Callable[[], bool] | None = None) -> None:
        self.name = name
        self.part: dict[str, torch.Tensor] | None = None
        self.gate = gate

    def add(self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None, *,
            causal: bool = False, block: int | None = None) -> None:
        """Add one call: *query* ``(B, H, Q, d)``, *key* ``(B, H_kv, K, d)``, *mask* as eager attention gets it.

        A float *mask* is added to the logits where it allows the key (an additive bias counts, as
        in the softmax); *causal*: query ``i`` sees keys ``0..i`` (top-left aligned, as
        ``scaled_dot_product_attention``'s ``is_causal``).  Computed ``block`` queries at a time
        (default: as many as keep a block's logits under :data:`BLOCK` elements), so no ``Q×K``
        matrix of every head is ever held.
        """
        import torch

        if self.gate is not None and not self.gate():
            return
        with torch.no_grad():
            q, k = query.detach(), key.detach().to(torch.float32)
            if k.shape[-3] != q.shape[-3]:
                k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            n_q, n_k = q.shape[-2], k.shape[-2]
            step = block or max(1, BLOCK // max(1, q.shape[0] * q.shape[1] * n_k))
            for i in range(0, n_q, step):
                j = min(n_q, i + step)
                s = logits_of(q[..., i:j, :], k, scaling)
                m = _rows(mask, i, j, n_q)
                if causal:
                    ok = torch.arange(n_k, device=s.device)[None, :] <= torch.arange(i, j, device=s.device)[:, None]
                else:
                    ok = allowed_keys(m, tuple(s.shape)).to(s.device)
                if m is not None and m.dtype != torch.bool:
                    s = s + torch.where(ok, m.to(s.device, torch.float32), 0.0)
                self.part = merge(self.part, head_stats(s, ok))


#: Elements of one query block's logits ``(B, H, block, K)`` (float32: 16 MiB).
BLOCK = 1 << 22


def _rows(mask: torch.Tensor | None, i: int, j: int, n_q: int) -> torch.Tensor | None:
    """Rows ``i:j`` of a mask broadcast against ``(..., Q, K)`` (a mask with one query row is everyone's)."""
    if mask is None or mask.ndim < 2 or mask.shape[-2] != n_q:
        return mask
    return mask[..., i:j, :]


# ------------------------------------------------------------------ the Hugging Face door
def tapped_eager(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
    """gradforensics' entry in transformers' ``AttentionInterface``: the module's own eager attention, tapped."""
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None) or _llama_eager()
    out = own(module, query, key, value, attention_mask, *args, **kwargs)
    tap = _TAPS.get(module)
    if tap is not None:        # HeadTap.add skips the call when its gate is shut
        tap.add(query, key, attention_mask, kwargs.get("scaling", args[0] if args else None))
    return out


def _llama_eager() -> Any:
    """The eager attention of LLaMA's modeling file, for a family whose own file defines none."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


def _register() -> None:
    """Register :func:`tapped_eager` (and the eager mask) under :data:`IMPLEMENTATION`; idempotent."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    if AttentionInterface().get(IMPLEMENTATION) is not tapped_eager:
        AttentionInterface.register(IMPLEMENTATION, tapped_eager)
        AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)


def switchable_roots(model: nn.Module, modules: dict[str, nn.Module]) -> list[nn.Module]:
    """The outermost modules of *model* with ``set_attn_implementation`` (Hugging Face models) holding *modules*.

    Raises
    ------
    SpecError
        A module of *modules* in no such model (its attention cannot be switched by the public door).
    """
    roots: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if callable(getattr(m, "set_attn_implementation", None)) and not any(_under(name, r) for r in roots):
            roots[name] = m
    for n in modules:
        if not any(_under(n, r) for r in roots):
            raise SpecError(f"attention: {n} is in no Hugging Face model (no set_attn_implementation above it); "
                            "record the attention of a transformers PreTrainedModel.")
    return [m for r, m in roots.items() if any(_under(n, r) for n in modules)]


def _under(name: str, root: str) -> bool:
    return root == "" or name == root or name.startswith(root + ".")


def _switch(root: nn.Module) -> None:
    """Switch *root* to :data:`IMPLEMENTATION` (counted: several recorders may hold one model)."""
    with _LOCK:
        held = _SWITCHED.get(root)
        if held is not None:
            held[1] += 1
            return
        _register()
        own = attn_implementation(root.config)
        root.set_attn_implementation(IMPLEMENTATION)       # type: ignore[operator]
        if attn_implementation(root.config) != IMPLEMENTATION:
            raise AttentionUnavailableError(f"attention=: {type(root).__name__} does not switch its attention "
                                            "implementation (set_attn_implementation); its attention cannot be tapped.")
        _SWITCHED[root] = [own, 1]


def _restore(root: nn.Module) -> None:
    """Hand *root* its own attention implementation back when its last recorder closes."""
    with _LOCK:
        held = _SWITCHED.get(root)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _SWITCHED[root]
            root.set_attn_implementation(held[0])          # type: ignore[operator]


# ------------------------------------------------------------------ the recorders' side
def _is_attention(m: Any) -> bool:
    return type(m).__name__.endswith("Attention") and hasattr(m, "config")


def attention_modules(model: nn.Module, spec: str | Sequence[str]) -> dict[str, nn.Module]:
    """The attention modules named by *spec* (``"auto"``: every innermost Hugging Face ``*Attention`` module).

    Raises
    ------
    SpecError
        Nothing matched, a glob names a module that is not an attention module, or one outside a
        Hugging Face model.
    AttentionUnavailableError
        The model's attention runs in a kernel that returns no weights (SDPA, flash).
    """
    named = dict(model.named_modules())
    if spec == "auto":
        found = {n: m for n, m in named.items() if n and _is_attention(m)
                 and not any(_is_attention(c) for c in m.modules() if c is not m)}
        if not found:
            what = f"{type(model).__name__} has no Hugging Face attention module (a '*Attention' module with a config)"
            raise SpecError(f"attention='auto': {what}; give attention=[module globs].",
                            cli=f"--attention: {what}; give --attention GLOB (the modules that compute attention), "
                                "or capture without --attention.")
    else:
        found = _globbed(named, [spec] if isinstance(spec, str) else list(spec), type(model).__name__)
    for n, m in found.items():
        impl = attn_implementation(m.config) or "eager"
        if impl not in ("eager", IMPLEMENTATION):
            raise AttentionUnavailableError(
                f"attention=: {n} runs attention with {impl!r}, whose kernel returns no attention weights; load the "
                "model with attn_implementation=\"eager\" (or call model.set_attn_implementation(\"eager\")) to "
                "record them.")
    switchable_roots(model, found)
    return found


def _globbed(named: dict[str, nn.Module], globs: list[str], what: str) -> dict[str, nn.Module]:
    found: dict[str, nn.Module] = {}
    for glob in globs:
        hits = {n: m for n, m in named.items() if n and fnmatch.fnmatchcase(n, glob)}
        if not hits:
            raise SpecError(f"attention: glob {glob!r} matches no module of {what}.")
        bad = [n for n, m in hits.items() if not _is_attention(m)]
        if bad:
            raise SpecError(f"attention: {bad[0]} is a {type(hits[bad[0]]).__name__}, not a Hugging Face "
                            "attention module; name the '*Attention' modules (e.g. '*.self_attn').")
        found.update(hits)
    return found


def use_eager_attention(model: nn.Module) -> None:
    """Switch a Hugging Face model to eager attention (replay: the weights then exist); others are left as they are."""
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter) and attn_implementation(getattr(model, "config", None)) not in (None, "eager"):
        setter("eager")


class AttentionTaps:
    """The taps of one recorder on *modules* of *model*: switched on at construction, off by :meth:`remove`."""

    def __init__(self, model: nn.Module, modules: dict[str, nn.Module]) -> None:
        self.taps = {n: HeadTap(n) for n in modules}
        self._modules = dict(modules)
        for n, m in modules.items():
            if m in _TAPS:
                raise SpecError(f"attention: {n} is already recorded by another open recorder.")
        self._roots: list[nn.Module] = []
        try:
            for root in switchable_roots(model, modules):
                _switch(root)
                self._roots.append(root)
        except BaseException:
            for root in self._roots:
                _restore(root)
            raise
        for n, m in modules.items():
            _TAPS[m] = self.taps[n]
        self._live = True

    def take(self) -> dict[str, dict[str, np.ndarray]]:
        """Every module's ``(H,)`` statistics since the last call."""
        return take_taps(self.taps, "ran no attention since the previous record; every recorded attention "
                                    "module must run in every recorded batch.")

    def remove(self) -> None:
        """Stop tapping and give the model its own attention implementation back (idempotent)."""
        if not self._live:
            return
        self._live = False
        for m in self._modules.values():
            _TAPS.pop(m, None)
        for root in self._roots:
            _restore(root)
