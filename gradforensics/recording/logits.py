"""Output-logit statistics: ``Recorder(logits="auto" | glob)``.

Which module (:func:`logit_modules`): with ``"auto"``, the module whose output are
the loss' logits, found by these rules, first that answers:

1. ``model.get_output_embeddings()`` (Hugging Face models: ``lm_head``, tied or not);
2. the last ``nn.Linear`` whose weight *is* an ``nn.Embedding``'s weight (tied
   embeddings, nanoGPT's ``lm_head.weight = wte.weight``);
3. the last ``nn.Linear`` whose weight has the shape ``(V, D)`` of the largest ``nn.Embedding``.

Otherwise one line asks for ``logits="<module name>"``.  A glob names the modules itself.

What is stored per record (:class:`LogitHook`, reduced on the device; six numbers
cross to the host), under ``logits/<module>/``, float32 ``(N,)``: over every position
of every micro-batch since the previous record, with ``log Z = logsumexp`` over the last
(vocabulary) axis, ``logz_mean`` and ``logz_max``; over every logit, ``logit_max`` and
``logit_mean``.  ``row_norm_ratio``: the output embedding's mean row norm over its
median row norm (the median interpolated between the two middle rows when V is even),
at the records where the recorder snapshots weights (``weights_every``; every record
without it), NaN at the others.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import SpecError
from gradforensics.store.names import check_name

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["LogitHook", "LogitTaps", "logit_modules", "row_norm_ratio"]



def logit_modules(model: nn.Module, spec: str | Sequence[str]) -> dict[str, nn.Module]:
    """``{name: module}`` whose outputs are the logits (see the module doc); one line when none is found."""
    from torch import nn

    named = dict(model.named_modules())
    if spec != "auto":
        globs = [spec] if isinstance(spec, str) else list(spec)
        out: dict[str, nn.Module] = {}
        for glob in globs:
            hits = [n for n in named if n and fnmatch.fnmatchcase(n, glob)]
            if not hits:
                raise SpecError(f"logits: glob {glob!r} matches no module of {type(model).__name__} "
                                f"(names look like {', '.join([n for n in named if n][:3])}).")
            out.update((n, named[n]) for n in hits)
        return {check_name(n, "logits module"): m for n, m in out.items()}
    by_id = {id(m): n for n, m in named.items() if n}
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except NotImplementedError:
            head = None
        if head is not None and id(head) in by_id:
            return {by_id[id(head)]: head}
    embeddings = [m for m in named.values() if isinstance(m, nn.Embedding)]
    linears = [(n, m) for n, m in named.items() if n and isinstance(m, nn.Linear)]
    tied = [(n, m) for n, m in linears if any(m.weight is e.weight for e in embeddings)]
    if tied:
        return dict(tied[-1:])
    if embeddings:
        big = max(embeddings, key=lambda e: e.weight.shape[0])
        shaped = [(n, m) for n, m in linears if tuple(m.weight.shape) == tuple(big.weight.shape)]
        if shaped:
            return dict(shaped[-1:])
    what = (f"{type(model).__name__} has no output embedding (no get_output_embeddings(), no nn.Linear tied to or "
            "shaped like an nn.Embedding)")
    raise SpecError(f"logits='auto': {what}; pass logits='<module name>'.",
                    cli=f"--logits: {what}; pass --logits GLOB naming the output module.")


def row_norm_ratio(weight: torch.Tensor) -> torch.Tensor:
    """Mean row norm over median row norm of a ``(V, D)`` output embedding, on its device (a 0-d tensor)."""
    import torch

    norms = weight.detach().float().norm(dim=1)
    return norms.mean() / torch.quantile(norms, 0.5)


class LogitHook:
    """Forward hook: running log Z and logit sums / maxima on the output's device since the last :meth:`take`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sums: Any = None        # tensor [Σ logZ, max logZ, max logit, Σ logit, n positions, n logits]

    def __call__(self, module: nn.Module, inputs: Any, output: Any) -> None:
        import torch

        if not isinstance(output, torch.Tensor) or output.ndim < 1:
            what = (f"module {self.name} ({type(module).__name__}) returned {type(output).__name__}, not a (..., V) "
                    "tensor")
            raise SpecError(f"logits: {what}; pass logits='<module name>' of the module that outputs the logits.",
                            cli=f"--logits: {what}; pass --logits GLOB naming the module that outputs the logits.")
        with torch.no_grad():
            x = output.detach().float()
            lz = torch.logsumexp(x, dim=-1)
            s = torch.stack([lz.sum(), lz.max(), x.max(), x.sum(),
                             torch.tensor(float(lz.numel()), device=x.device),
                             torch.tensor(float(x.numel()), device=x.device)]).double()
            if self.sums is None:
                self.sums = s
            else:
                prev = self.sums
                self.sums = torch.stack([prev[0] + s[0], torch.maximum(prev[1], s[1]),
                                         torch.maximum(prev[2], s[2]), prev[3] + s[3], prev[4] + s[4], prev[5] + s[5]])

    def take(self) -> np.ndarray | None:
        s, self.sums = self.sums, None
        return None if s is None else s.cpu().numpy()


class LogitTaps:
    """Hooks on the logit modules; :meth:`take` gives each one's per-record row ``{path: (array, attrs)}``."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = {check_name(n, "logits module"): m for n, m in modules.items()}
        self.hooks = {n: LogitHook(n) for n in modules}
        self.handles = [m.register_forward_hook(self.hooks[n]) for n, m in modules.items()]

    def take(self, snapshot: bool) -> dict[str, tuple[np.ndarray, dict[str, Any]]]:
        out: dict[str, tuple[np.ndarray, dict[str, Any]]] = {}
        for name, hook in self.hooks.items():
            s = hook.take()
            if s is None:
                raise SpecError(f"logits: module {name} produced no output since the previous record; "
                                "the logit module must run in every recorded batch.")
            stats = {"logz_mean": s[0] / s[4], "logz_max": s[1], "logit_max": s[2], "logit_mean": s[3] / s[5],
                     "row_norm_ratio": math.nan}
            w = getattr(self.modules[name], "weight", None)
            if snapshot and w is not None and getattr(w, "ndim", 0) == 2:
                stats["row_norm_ratio"] = float(row_norm_ratio(w))
            out.update({f"logits/{name}/{k}": (np.asarray(v, dtype=np.float32), {}) for k, v in stats.items()})
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
