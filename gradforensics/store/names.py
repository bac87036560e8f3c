"""The one rule for names that become store keys or file names.

Tensor, module and source names are the framework's own (``model.layers.3.mlp.up_proj.weight``);
they become array keys (``grads/<tensor>``, ``acts/<module>/hist``) and, for analyses,
file names (``tables/<kind>.csv``).  A name is refused when it could address
something else than itself: empty, a ``/`` or ``\\``, a ``.``/``..`` segment, a
control character, a name the backends reserve (``zarr.json``, ``__``-prefixed,
Zarr v2's dot files), or longer than a file name may be.  ``check_name`` is called
where names enter (``record()``, store open) so everything after trusts them.
"""

from __future__ import annotations

import re
import unicodedata

from gradforensics.errors import UnsafeNameError

__all__ = ["MAX_NAME_BYTES", "check_analysis_name", "check_name", "has_control", "layer_of", "name_problem",
           "split_layer"]


MAX_NAME_BYTES = 255
_RESERVED = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})
#: Names of analyses (``tables/<name>.csv``, ``--only``): lower-case identifiers.
_ANALYSIS_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")


def has_control(text: str) -> bool:
    """True when *text* holds a control or format character (C0/C1, DEL, bidi overrides...)
    or a lone surrogate (not encodable as UTF-8)."""
    return any(unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp") for ch in text)


def name_problem(name: object, *, allow_slash: bool = False) -> str | None:
    """Why *name* is not a safe store key, or None when it is."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not name:
        return "is empty"
    if has_control(name):
        return "holds a control character"
    if "\\" in name:
        return "holds a backslash"
    if "/" in name and not allow_slash:
        return "holds a '/'"
    for seg in name.split("/"):
        if seg in ("", ".", ".."):
            return "has an empty, '.' or '..' segment"
        if seg in _RESERVED or seg.startswith("__"):
            return f"uses the reserved name {seg!r}"
        if len(seg.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            return f"has a segment longer than {MAX_NAME_BYTES} bytes"
    return None


def check_name(name: object, what: str) -> str:
    """*name* itself when it is a safe store key; else :class:`UnsafeNameError` naming *what*."""
    problem = name_problem(name)
    if problem is not None:
        raise UnsafeNameError(f"{what} {name!r} {problem}; names must be non-empty, without '/', '\\', "
                              "control characters, '.'/'..' or the backends' reserved names.")
    return name  # type: ignore[return-value]


#: ``prefix.N.rest``: the first path component that is a whole number (at most 6 digits:
#: a longer run is a damaged or hostile name, not a layer), after a component that is not one.
_LAYER = re.compile(r"^(?P<prefix>(?:[^.]+\.)*?[^.\d][^.]*)\.(?P<idx>\d{1,6})(?:\.(?P<rest>.+))?$")


def split_layer(name: str) -> tuple[str, int, str] | None:
    """``(prefix, layer, rest)`` of a parameter or module name in a layer stack, or None.

    The layer index is the first path component that is a whole number, which
    covers the stacks of the common model families: LLaMA/Qwen/Mistral
    (``model.layers.N``), GPT-2 (``transformer.h.N``), GPT-NeoX (``gpt_neox.layers.N``),
    BERT (``encoder.layer.N``), T5 (``encoder.block.N`` / ``decoder.block.N``), BART
    (``decoder.layers.N``), CLIP (``transformer.resblocks.N``) and ViT/timm
    (``blocks.N``).  ``rest`` is what follows (empty when the name ends there).

    >>> split_layer("model.layers.5.self_attn.q_proj.weight")
    ('model.layers', 5, 'self_attn.q_proj.weight')
    >>> split_layer("lm_head.weight") is None
    True
    """
    m = _LAYER.match(name)
    return None if m is None else (m["prefix"], int(m["idx"]), m["rest"] or "")


def layer_of(name: str) -> int | None:
    """Layer index of a parameter or module name (``model.layers.5.mlp.up_proj.weight`` -> 5); None outside a stack.

    The one rule (:func:`split_layer`) for the analyses' ``layer`` column and the report's layer axis.
    """
    parts = split_layer(name)
    return None if parts is None else parts[1]


def check_analysis_name(name: object, where: str) -> str:
    """*name* when it is a valid analysis name (``tables/<name>.csv``); else :class:`UnsafeNameError`."""
    if not isinstance(name, str) or not _ANALYSIS_NAME.match(name):
        raise UnsafeNameError(f"{where}: analysis name {name!r} is not a lower-case identifier "
                              "(a-z, 0-9, _); refused as a file name.")
    return name
