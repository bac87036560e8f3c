"""The user's head spec: ``heads={glob: H | {"heads": H, "axis": A, ...}}``.

:func:`match_heads` finds the entry whose glob matches a tensor name and
:func:`parse_head_spec` turns it into a :class:`~gradforensics.store.heads.HeadSpec`
(the layout itself, and the attributes it is stored with, live in
:mod:`gradforensics.store.heads`).  ``heads="auto"`` for a PyTorch model is
:mod:`gradforensics.recording.autoheads`.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from gradforensics.errors import SpecError
from gradforensics.store.heads import ROLES, HeadSpec, parse_parts

__all__ = ["cli_fix", "match_heads", "parse_cli_heads", "parse_head_spec", "python_fix"]


def _fused(name: str, value: Any, heads: int) -> tuple[int, tuple[tuple[str, int], ...]]:
    """``fused`` of a dict spec: an int (equal parts), ``"qkv"`` / ``"q8k2v2"``, a role list, or ``{role: H}``."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value), ()
    if isinstance(value, str):
        return 1, parse_parts(value, heads)
    if isinstance(value, (list, tuple)) and all(isinstance(r, str) for r in value):
        return 1, parse_parts("".join(value), heads)
    if isinstance(value, dict) and all(isinstance(n, int) for n in value.values()):
        return 1, parse_parts("".join(f"{r}{n}" for r, n in value.items()))
    raise SpecError(f"heads for {name}: fused must be an int, 'qkv', a role list or {{role: heads}}; got {value!r}.")


def parse_head_spec(name: str, value: Any) -> HeadSpec:
    """``H`` or ``{"heads": H, "axis": A, "role": R, "fused": F, "interleaved": bool}``.

    ``fused`` is a number of equal parts (3: q|k|v), ``"qkv"``, a role list
    (``["q", "k", "v"]``) or roles with their own head counts (``"q8k2v2"``,
    ``{"q": 8, "k": 2, "v": 2}``: grouped-query attention; ``heads`` is then the q count).
    """
    if isinstance(value, HeadSpec):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        spec = HeadSpec(int(value))
    elif isinstance(value, dict):
        unknown = set(value) - {"heads", "axis", "role", "fused", "interleaved"}
        if unknown or "heads" not in value:
            raise SpecError(
                f"heads for {name} must be an int or a dict with keys heads, axis, role, fused, interleaved; "
                f"got {value!r}."
            )
        heads, axis = int(value["heads"]), int(value.get("axis", 0))
        fused, parts = _fused(name, value.get("fused", 1), heads)
        if parts:
            if value.get("interleaved"):
                raise SpecError(f"heads for {name}: interleaved takes a number of equal parts (fused=3), not "
                                f"{value['fused']!r}.")
            spec = HeadSpec.of_parts(parts, axis, value.get("role"))
        else:
            spec = HeadSpec(heads, axis, value.get("role"), fused, bool(value.get("interleaved", False)))
    else:
        raise SpecError(f"heads for {name} must be an int or a dict; got {type(value).__name__} {value!r}.")
    if spec.heads < 1 or spec.fused < 1:
        raise SpecError(f"heads for {name}: heads and fused must be >= 1; got {value!r}.")
    if spec.role is not None and spec.role not in ROLES:
        raise SpecError(f"heads for {name}: role must be one of {ROLES}; got {spec.role!r}.")
    return spec


def match_heads(name: str, specs: dict[str, Any]) -> HeadSpec | None:
    """The spec of the first glob in *specs* that matches tensor *name*."""
    for glob, value in specs.items():
        if fnmatch.fnmatchcase(name, glob):
            return parse_head_spec(name, value)
    return None


# ------------------------------------------------------------------ the CLI form
_CLI_SYNTAX = ("expected auto, none, or GLOB=H[:axis=A,fused=F,role=R] (F: qkv, kv or q8k2v2; R: q, k, v, o, "
               "qkv), GLOB=none or FILE.json")


def _cli_entry(spec: str) -> tuple[str, Any]:
    glob, eq, rest = spec.partition("=")
    if not eq or not glob or not rest:
        raise SpecError(f"--heads {spec!r}: {_CLI_SYNTAX}.")
    if rest == "none":
        return glob, None
    h, _, opts = rest.partition(":")
    if not h.isdigit() or int(h) < 1:
        raise SpecError(f"--heads {spec!r}: expected auto, none, or GLOB=H with H a positive integer.")
    out: dict[str, Any] = {"heads": int(h)}
    for opt in filter(None, opts.split(",")):
        key, eq, val = opt.partition("=")
        if not eq or key not in ("axis", "fused", "role", "interleaved") or not val:
            raise SpecError(f"--heads {spec!r}: unknown option {opt!r}; {_CLI_SYNTAX}.")
        if key == "axis":
            if not val.lstrip("-").isdigit():
                raise SpecError(f"--heads {spec!r}: axis must be an integer; got {val!r}.")
            out["axis"] = int(val)
        elif key == "fused":
            out["fused"] = int(val) if val.isdigit() else val
        elif key == "interleaved":
            out["interleaved"] = val.lower() in ("1", "true", "yes")
        else:
            out["role"] = val
    parse_head_spec(glob, out)      # a bad value is refused here, in the command's words
    return glob, out if len(out) > 1 else out["heads"]


def parse_cli_heads(specs: Sequence[str]) -> str | dict[str, Any] | None:
    """``--heads`` entries -> the ``heads=`` of the recorder.

    ``["auto"]`` -> ``"auto"``; ``["none"]`` -> ``None``; ``GLOB=H[:axis=A,fused=F,role=R]``,
    ``GLOB=none`` and ``auto`` entries -> a dict; ``FILE.json`` -> the dict in the file
    (the Python form: ``{glob: H | {"heads": H, ...} | null, "auto": true}``).
    """
    specs = list(specs)
    if specs == ["auto"]:
        return "auto"
    if specs == ["none"]:
        return None
    out: dict[str, Any] = {}
    for spec in specs:
        if spec == "auto":
            out["auto"] = True
        elif spec.endswith(".json") and "=" not in spec:
            out.update(_json_file(spec))
        else:
            glob, value = _cli_entry(spec)
            out[glob] = value
    return out


def _json_file(path: str) -> dict[str, Any]:
    import os
    import stat

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):     # a named pipe would block the read
            raise SpecError(f"--heads {path}: not a regular file (a named pipe, socket or device); give a JSON file.")
        with open(path, "rb") as f:
            data = json.load(f)
    except UnicodeDecodeError as exc:
        raise SpecError(f"--heads {path}: not UTF-8 text (byte {exc.start}).") from None
    except OSError as exc:
        raise SpecError(f"--heads {path}: cannot read it ({exc.strerror or exc}).") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"--heads {path}: not JSON ({exc.msg} at line {exc.lineno}).") from None
    if not isinstance(data, dict):
        raise SpecError(f"--heads {path}: expected an object {{glob: H | {{\"heads\": H, ...}} | null}}; "
                        f"got {type(data).__name__}.")
    for glob, value in data.items():
        if glob == "auto":
            if not isinstance(value, bool):
                raise SpecError(f"--heads {path}: \"auto\" must be true or false; got {value!r}.")
        elif value is not None:
            parse_head_spec(glob, value)
    return data


def python_fix(glob: str, spec: dict[str, Any] | None) -> str:
    """The Python form of a heads entry: ``heads={'*.c_attn.weight': {...}, 'auto': True}``."""
    return f"heads={{{glob!r}: {spec!r}, 'auto': True}}"


def cli_fix(glob: str, spec: dict[str, Any] | None) -> str:
    """The CLI form of a heads entry: ``--heads auto '*.c_attn.weight=4:axis=0,fused=qkv'``."""
    if spec is None:
        return f"--heads auto '{glob}=none'"
    opts = ",".join(f"{k}={v}" for k, v in spec.items() if k != "heads")
    return f"--heads auto '{glob}={spec['heads']}{':' + opts if opts else ''}'"
