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
GPT-2, GPT-NeoX, BERT, Phi-3) call their attention through
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)``.
While a recorder with ``attention=`` is open, the ``"eager"`` entry of that
interface is a pass-through (:func:`_tapped_eager`) that runs the model's own
eager function unchanged (its output is the model's output, bit for bit) and, for
the modules being recorded, reduces the query/key logits to ``(H,)`` statistics
on their device.  Only those cross to the host, at ``record()``.  A model whose
attention runs in SDPA or flash kernels has no weights to give: it is refused in
one line (:class:`~gradforensics.errors.AttentionUnavailableError`) saying to load
it with ``attn_implementation="eager"``.
"""

from __future__ import annotations

import fnmatch
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import AttentionUnavailableError, SpecError
from gradforensics.store.schema import ATTN_FIELDS

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ONEHOT", "STATS", "AttentionTaps", "attention_modules", "finish", "head_stats", "merge",
           "use_eager_attention"]


STATS = ATTN_FIELDS
ONEHOT = 0.99
_TAPS: weakref.WeakKeyDictionary[Any, _Tap] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_INSTALLED: list[Any] = []     # [previous "eager" entry or None] while installed
_USERS = 0


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


def logits_of(query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """``q·kᵀ·scaling`` in float32, ``(B, H, Q, K)``; grouped key heads (GQA) repeated to the query heads."""
    import torch

    q, k = query.detach().to(torch.float32), key.detach().to(torch.float32)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else float(scaling))


# ------------------------------------------------------------------ the taps
class _Tap:
    """The running statistics of one attention module since the last record."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.part: dict[str, torch.Tensor] | None = None

    def add(self, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None) -> None:
        import torch

        with torch.no_grad():
            s = logits_of(query, key, scaling)
            self.part = merge(self.part, head_stats(s, allowed_keys(mask, tuple(s.shape))))


def _tapped_eager(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any,
                  **kwargs: Any) -> Any:
    """The ``"eager"`` attention entry while recording: the module's own eager function, tapped."""
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is None:
        own = _INSTALLED[0] if _INSTALLED and _INSTALLED[0] is not None else _generic_eager()
    out = own(module, query, key, value, attention_mask, *args, **kwargs)
    tap = _TAPS.get(module)
    if tap is not None:
        scaling = kwargs.get("scaling", args[0] if args else None)
        tap.add(query, key, attention_mask, scaling)
    return out


def _generic_eager() -> Any:
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


def _install() -> None:
    global _USERS
    from transformers.modeling_utils import AttentionInterface

    with _LOCK:
        if _USERS == 0:
            _INSTALLED[:] = [AttentionInterface._global_mapping.get("eager")]
            AttentionInterface._global_mapping["eager"] = _tapped_eager
        _USERS += 1


def _uninstall() -> None:
    global _USERS
    from transformers.modeling_utils import AttentionInterface

    with _LOCK:
        _USERS -= 1
        if _USERS == 0:
            previous = _INSTALLED[0] if _INSTALLED else None
            if previous is None:
                AttentionInterface._global_mapping.pop("eager", None)
            else:
                AttentionInterface._global_mapping["eager"] = previous
            _INSTALLED.clear()


def _is_attention(m: Any) -> bool:
    return type(m).__name__.endswith("Attention") and hasattr(m, "config")


def attention_modules(model: nn.Module, spec: str | Sequence[str]) -> dict[str, nn.Module]:
    """The attention modules named by *spec* (``"auto"``: every innermost Hugging Face ``*Attention`` module).

    Raises
    ------
    SpecError
        Nothing matched, or a glob names a module that is not an attention module.
    AttentionUnavailableError
        The model's attention runs in a kernel that returns no weights (SDPA, flash).
    """
    named = dict(model.named_modules())
    if spec == "auto":
        found = {n: m for n, m in named.items() if n and _is_attention(m)
                 and not any(_is_attention(c) for c in m.modules() if c is not m)}
        if not found:
            raise SpecError(f"attention='auto': {type(model).__name__} has no Hugging Face attention module "
                            "(a '*Attention' module with a config); give attention=[module globs].")
    else:
        globs = [spec] if isinstance(spec, str) else list(spec)
        found = {}
        for glob in globs:
            hits = {n: m for n, m in named.items() if n and fnmatch.fnmatchcase(n, glob)}
            if not hits:
                raise SpecError(f"attention: glob {glob!r} matches no module of {type(model).__name__}.")
            bad = [n for n, m in hits.items() if not _is_attention(m)]
            if bad:
                raise SpecError(f"attention: {bad[0]} is a {type(hits[bad[0]]).__name__}, not a Hugging Face "
                                "attention module; name the '*Attention' modules (e.g. '*.self_attn').")
            found.update(hits)
    for n, m in found.items():
        impl = getattr(m.config, "_attn_implementation", None) or "eager"
        if impl != "eager":
            raise AttentionUnavailableError(
                f"attention=: {n} runs attention with {impl!r}, whose kernel returns no attention weights; load the "
                "model with attn_implementation=\"eager\" (or call model.set_attn_implementation(\"eager\")) to "
                "record them.")
    return found


def use_eager_attention(model: nn.Module) -> None:
    """Switch a Hugging Face model to eager attention (replay: the weights then exist); others are left as they are."""
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter) and getattr(getattr(model, "config", None), "_attn_implementation", "eager") != "eager":
        setter("eager")


class AttentionTaps:
    """The taps of one recorder: installed at construction, removed by :meth:`remove`."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.taps = {n: _Tap(n) for n in modules}
        self._modules = dict(modules)
        for n, m in modules.items():
            if m in _TAPS:
                raise SpecError(f"attention: {n} is already recorded by another open recorder.")
        _install()
        for n, m in modules.items():
            _TAPS[m] = self.taps[n]
        self._live = True

    def take(self) -> dict[str, dict[str, np.ndarray]]:
        """Every module's ``(H,)`` statistics since the last call."""
        out = {}
        for name, tap in self.taps.items():
            part, tap.part = tap.part, None
            if part is None:
                raise SpecError(f"attention: module {name} ran no attention since the previous record; every "
                                "recorded attention module must run in every recorded batch.")
            out[name] = finish(part)
        return out

    def remove(self) -> None:
        """Stop tapping (idempotent)."""
        if not self._live:
            return
        self._live = False
        for m in self._modules.values():
            _TAPS.pop(m, None)
        _uninstall()
