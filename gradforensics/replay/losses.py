"""Objectives for ``gradforensics capture``: ``loss(model, batch) -> scalar tensor``.

A batch is ``{"input_ids": (B, T) int64, "attention_mask": (B, T) int64}``, as
:mod:`gradforensics.replay.data` packs it (padding, where there is any, has
``attention_mask == 0``).  ``--loss module:function`` takes any function of that
signature; the four here are:

* :func:`causal_lm` - next-token cross-entropy (decoder models);
* :class:`CausalLMSkipFirst` - the same without a document's first target nor
  BOS as a target (``--loss causal-lm-skip-first``: the demo's training loss);
* :class:`MaskedLM` - BERT's masked-token cross-entropy with seeded masking
  (Devlin et al. 2019, sec. 3.1: 15 % of tokens; of those 80 % ``[MASK]``,
  10 % a random token, 10 % unchanged);
* :func:`contrastive` - an in-batch-negatives contrastive loss for
  sentence-embedding encoders without an LM head (``--loss
  gradforensics.replay.losses:contrastive``).

All four compute the cross-entropy from the model's output themselves, so a
raw PyTorch model that returns logits (a tensor) works like a Hugging Face one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gradforensics.errors import SpecError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["IGNORE", "SCALE", "CausalLMSkipFirst", "MaskedLM", "causal_lm", "contrastive", "is_hf_model", "mean_pool", "span_masks"]


IGNORE = -100
#: Similarity scale of :func:`contrastive` (1 / temperature); sentence-transformers'
#: MultipleNegativesRankingLoss default, the loss all-MiniLM-L6-v2 was trained with.
SCALE = 20.0


def is_hf_model(model: nn.Module) -> bool:
    """A Hugging Face model (a ``transformers`` class, or a wrapper whose ``config`` is a transformers config).

    A ``config`` attribute alone does not make one: nanoGPT-style models keep their own.
    """
    def from_transformers(obj: Any) -> bool:
        return any((c.__module__ or "").split(".")[0] == "transformers" for c in type(obj).__mro__)

    return from_transformers(model) or from_transformers(getattr(model, "config", None))


def _call_plain(model: nn.Module, input_ids: torch.Tensor) -> Any:
    """``model(input_ids)``, or one line saying what a ``--model-factory`` model must accept."""
    import inspect

    try:
        inspect.signature(model.forward).bind(input_ids)
    except TypeError as exc:
        raise SpecError(f"{type(model).__name__}.forward cannot be called as model(input_ids) ({exc}); a "
                        "--model-factory model must accept the (B, T) int64 token ids as its one positional "
                        "argument and return the logits (B, T, V) (or a tuple / an object with .logits holding "
                        "them), else pass --loss module:function.") from None
    except ValueError:      # no signature to read (a C extension): just call it
        pass
    return model(input_ids)


def _forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any) -> Any:
    """Call a Hugging Face model with keywords, anything else as ``model(input_ids)``."""
    if is_hf_model(model):
        return model(input_ids=input_ids, attention_mask=attention_mask, **kw)
    return _call_plain(model, input_ids)


def _logits(out: Any) -> torch.Tensor:
    import torch

    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise SpecError(f"the model returned {type(out).__name__} without logits; "
                        "pass --loss module:function for this model.")
    return logits


def causal_lm(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over the non-padding targets.

    ``loss = -(1/|M|) sum_{(b,t) in M} log p(x_{b,t+1} | x_{b,<=t})`` with ``M``
    the positions whose target is not padding - what Hugging Face causal-LM
    heads compute with ``labels=input_ids``.
    """
    return _next_token_loss(model, batch, None)


@dataclass(frozen=True)
class CausalLMSkipFirst:
    """:func:`causal_lm` without the targets no context can predict: a document's first token, and BOS.

    ``M`` also leaves out every target right after a ``bos_token_id`` (the first
    token of a document: from BOS alone nothing tells the sources apart) and every
    target that is ``bos_token_id`` (the start of the next packed document).  This
    is the loss the demo trains with (:func:`gradforensics.demo.lm_loss`), so a
    capture of its checkpoint replays its training loss (``--loss
    causal-lm-skip-first``; the demo's ``config.json`` names it for ``--loss auto``).
    """

    bos_token_id: int

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return _next_token_loss(model, batch, self.bos_token_id)


def _next_token_loss(model: nn.Module, batch: dict[str, torch.Tensor], skip_after: int | None) -> torch.Tensor:
    """Next-token cross-entropy over the non-padding targets; with *skip_after*, not those after or equal to it."""
    import torch.nn.functional as F

    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = _logits(_forward(model, ids, mask))
    if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
        raise SpecError(f"causal-lm: {type(model).__name__} returned logits of shape {tuple(logits.shape)} for "
                        f"token ids {tuple(ids.shape)}; the loss needs logits at every position (B, T, V) "
                        "(a nanoGPT-style forward without targets returns only the last one), "
                        "else pass --loss module:function.")
    drop = mask[:, 1:] == 0
    if skip_after is not None:
        drop = drop | (ids[:, :-1] == skip_after) | (ids[:, 1:] == skip_after)
    target = ids[:, 1:].masked_fill(drop, IGNORE)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                           ignore_index=IGNORE)


@dataclass
class MaskedLM:
    """Masked-LM loss with seeded masking (Devlin et al. 2019, sec. 3.1).

    Each call draws the next mask from one ``torch.Generator`` seeded with
    *seed*, on the CPU, so a replay in the same batch order masks the same
    tokens on any device.  Special tokens and padding are never masked; a
    batch where the draw masks nothing gets one masked token per row.

    Parameters
    ----------
    mask_token_id, vocab_size
        The tokenizer's ``[MASK]`` id and the model's vocabulary size.
    special_ids
        Token ids never masked (``[CLS]``, ``[SEP]``, ...).
    seed
        Seed of the mask draws.
    probability
        Share of tokens selected (0.15).
    """

    mask_token_id: int
    vocab_size: int
    special_ids: tuple[int, ...] = ()
    seed: int = 0
    probability: float = 0.15
    _gen: Any = field(default=None, repr=False)

    def mask(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(masked input ids, labels)``; labels are ``-100`` where nothing is predicted."""
        import torch

        if self._gen is None:
            self._gen = torch.Generator().manual_seed(int(self.seed))
        ids_c, am = ids.detach().cpu(), attention_mask.detach().cpu()
        can = am.bool() & ~torch.isin(ids_c, torch.tensor(self.special_ids, dtype=ids_c.dtype))
        u = torch.rand(ids_c.shape, generator=self._gen)
        chosen = can & (u < self.probability)
        for b in torch.nonzero(~chosen.any(dim=1) & can.any(dim=1)).flatten().tolist():
            where = torch.nonzero(can[b]).flatten()
            chosen[b, where[torch.randint(len(where), (1,), generator=self._gen)]] = True
        r = torch.rand(ids_c.shape, generator=self._gen)
        random_ids = torch.randint(self.vocab_size, ids_c.shape, generator=self._gen)
        masked = ids_c.clone()
        masked[chosen & (r < 0.8)] = self.mask_token_id
        swap = chosen & (r >= 0.8) & (r < 0.9)
        masked[swap] = random_ids[swap]
        labels = ids_c.masked_fill(~chosen, IGNORE)
        return masked.to(ids.device), labels.to(ids.device)

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch.nn.functional as F

        masked, labels = self.mask(batch["input_ids"], batch["attention_mask"])
        logits = _logits(_forward(model, masked, batch["attention_mask"]))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                               ignore_index=IGNORE)


def _hidden(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states ``(B, T, D)`` of an encoder (or of any model that returns them)."""
    import torch

    if not is_hf_model(model):
        out = _call_plain(model, ids)
        return out if isinstance(out, torch.Tensor) else out[0]
    out = _forward(model, ids, mask, output_hidden_states=True)
    h = getattr(out, "last_hidden_state", None)
    if h is None:
        h = out.hidden_states[-1]
    return h


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the hidden states over the tokens where *mask* is 1 (sentence-transformers' pooling)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


def span_masks(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split each row's real tokens into its first and second half: two disjoint masks."""
    import torch

    n = attention_mask.sum(dim=1, keepdim=True)
    pos = torch.cumsum(attention_mask, dim=1) - 1          # index among the row's real tokens
    first = (attention_mask == 1) & (pos < (n + 1) // 2)
    second = (attention_mask == 1) & ~first
    return first.long(), second.long()


def contrastive(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """In-batch-negatives contrastive loss over span pairs, for sentence-embedding encoders.

    Each row of the batch is split into two halves, which form a positive pair
    (two spans of the same text, as in DeCLUTR, Giorgi et al. 2021); the other
    rows' halves are the negatives.  Each half is encoded on its own (the
    attention mask hides the other half), mean-pooled and L2-normalised
    (``u_i``, ``v_j``); the loss is InfoNCE (van den Oord et al. 2018) /
    MultipleNegativesRankingLoss (Henderson et al. 2017):

    ``L = -(1/B) sum_i log( exp(s u_i.v_i) / sum_j exp(s u_i.v_j) )``, ``s = 20``.

    A model that embeds related text close together scores well below the
    chance level ``log B``.  Needs ``B >= 2`` rows with at least two real
    tokens each.

    References
    ----------
    Henderson et al. 2017, "Efficient Natural Language Response Suggestion for Smart Reply".
    van den Oord et al. 2018, "Representation Learning with Contrastive Predictive Coding".
    Reimers & Gurevych 2019, "Sentence-BERT".
    """
    import torch
    import torch.nn.functional as F

    ids, am = batch["input_ids"], batch["attention_mask"]
    if ids.shape[0] < 2:
        raise SpecError("contrastive loss needs --batch-size >= 2 (the other rows are the negatives); "
                        f"got {ids.shape[0]}.")
    first, second = span_masks(am)
    u = F.normalize(mean_pool(_hidden(model, ids, first), first).float(), dim=-1)
    v = F.normalize(mean_pool(_hidden(model, ids, second), second).float(), dim=-1)
    scores = SCALE * (u @ v.T)
    return F.cross_entropy(scores, torch.arange(ids.shape[0], device=scores.device))
