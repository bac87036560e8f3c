"""Heads of imported tensors, as in ``capture``: ``"auto"``, ``None`` or ``{glob: H | dict}``.

``"auto"`` needs the model's attention layout.  A checkpoint series with a Hugging Face
``config.json`` gets it the way ``capture`` does: the model class of the config is built
on the ``meta`` device (no weights, no code from the checkpoint: ``trust_remote_code``
stays off) and :func:`gradforensics.recording.autoheads.resolve_heads` applies its rules.
Without a config, ``"auto"`` splits nothing (the globs of a dict still apply).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import CheckpointError, SpecError

if TYPE_CHECKING:
    from torch import nn

    from gradforensics.store.heads import HeadSpec

__all__ = ["meta_model", "resolve"]


def resolve(shapes: Mapping[str, tuple[int, ...]], heads: Any, model: nn.Module | None) -> dict[str, HeadSpec]:
    """``{tensor: HeadSpec}`` of the imported tensors (one-line :class:`SpecError` on a bad spec).

    *model* is the series' model on the meta device (:func:`meta_model`), or None.
    """
    from gradforensics.recording.autoheads import resolve_heads

    if heads is None:
        return {}
    if isinstance(heads, str) and heads != "auto":
        raise SpecError(f"heads must be 'auto', None or a dict {{glob: H}}; got {heads!r}.")
    wants_auto = heads == "auto" or (isinstance(heads, Mapping) and bool(heads.get("auto")))
    if model is None or not wants_auto:
        explicit = {} if isinstance(heads, str) else {k: v for k, v in heads.items() if k != "auto"}
        return resolve_heads(None, shapes, explicit)  # type: ignore[arg-type]   # no rule reads the model
    known = {n for n, _ in model.named_parameters()}      # a tensor the config's model lacks stays whole
    return resolve_heads(model, {n: s for n, s in shapes.items() if n in known}, heads)


def meta_model(config_dir: Path) -> nn.Module | None:
    """The model of ``config_dir/config.json`` on the ``meta`` device (no memory, no weights), or None."""
    import torch

    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError:
        return None
    try:
        cfg = AutoConfig.from_pretrained(str(config_dir), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{config_dir / 'config.json'}: transformers cannot read it "
                              f"({' '.join(str(exc).split())[:200]}); pass --heads none or GLOB=H.") from exc
    with torch.device("meta"):
        for cls in (AutoModelForCausalLM, AutoModel):
            try:
                return cls.from_config(cfg)  # type: ignore[no-any-return]
            except (ValueError, KeyError, TypeError):
                continue
    return None
