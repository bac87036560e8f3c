"""Megatron-LM's saved arguments: the run's own parallel layout, heads and vocabulary, read without running anything.

Megatron-LM keeps its ``argparse.Namespace`` in every checkpoint (read from NVIDIA/Megatron-LM at
commit ``d98e8a64ddf34856e74b24714e3bedb2f5a39553``):

* ``megatron/training/checkpointing.py`` ``generate_state_dict``: ``state_dict['args'] = args``;
  the legacy ``torch`` format saves it per rank as
  ``<save>/iter_<N:07d>/mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]/model_optim_rng.pt``
  (``get_checkpoint_name``), the tracker ``<save>/latest_checkpointed_iteration.txt`` names the
  newest iteration (or ``release``);
* ``megatron/core/dist_checkpointing/strategies/common.py`` ``save_common``: a ``torch_dist``
  checkpoint of the older form keeps the same dict in ``<save>/iter_<N:07d>/common.pt``; the current
  form stores it inside the distributed checkpoint (``.metadata`` + ``__*.distcp``) as the
  ``common_state`` object (:func:`_common_state`);
* ``--ckpt-format torch_dcp`` and ``fsdp_dtensor`` (``save_checkpoint``, ``CheckpointType.GLOBAL``): the whole
  state dict goes through ``torch.distributed.checkpoint.save`` into ``<save>/iter_<N:07d>/`` (``.metadata`` +
  ``__*.distcp``, no ``metadata.json``: ``_get_checkpoint_format``), ``args`` a top-level non-tensor entry, stored
  as the bytes of ``torch.save(args)`` under the key ``args`` (``preprocess_fsdp_dtensor_state_dict`` leaves it
  as is); the two formats write the same files.

All are ``torch.save`` bytes.  Only their pickle (``<archive>/data.pkl`` of the zip form, or the
fourth pickle of the old stream form) is read, with a restricted unpickler: ``argparse.Namespace``,
``collections.OrderedDict``, a few plain builtins and ``_codecs.encode(str, "latin1")`` (how protocol 2
pickles ``bytes``) are resolved by name; every other global (an
enum, a torch dtype, a tensor rebuild function, ``os.system``) becomes an :class:`Opaque` object
that records its qualified name and the arguments it was pickled with - nothing of it is imported,
constructed or called, and no tensor storage is read.  What is taken from the arguments is
:class:`RunArgs`; each field must have the type Megatron gives it, else a one-line
:class:`~gradforensics.errors.CheckpointError` names it.
"""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar

from gradforensics.errors import CheckpointError

__all__ = ["ARGS_FILES", "COMMON_STATE_KEY", "DCP_ARGS_KEY", "Opaque", "RunArgs", "find_checkpoint", "read_args",
           "read_run_args"]

#: the files of a checkpoint iteration directory that hold the arguments (torch_dist, legacy torch)
ARGS_FILES = ("common.pt", "model_optim_rng.pt", ".metadata")
#: the largest pickle read from a checkpoint (the pickle of a legacy ``model_optim_rng.pt`` holds the
#: structure of the whole state dict, not its tensors' bytes)
MAX_PICKLE_BYTES = 1 << 30
#: the distributed-checkpoint key of Megatron-LM's common state (arguments, iteration) in a torch_dist checkpoint
COMMON_STATE_KEY = "common_state/shard_0_1"
#: the distributed-checkpoint key of the arguments in a torch_dcp / fsdp_dtensor checkpoint
DCP_ARGS_KEY = "args"
_ITER = re.compile(r"^iter_(\d{7})$")
_RANK_DIR = re.compile(r"^mp_rank_\d{2}(?:_\d{3})?(?:_\d{3})?$")
#: torch's legacy (non-zip) serialization starts with this magic number
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
def _latin1(text: Any, encoding: Any = None) -> Any:
    """``_codecs.encode(text, "latin1")``, how pickle protocol 2 writes ``bytes``; any other call stays inert."""
    if isinstance(text, str) and encoding == "latin1":
        return text.encode("latin1")
    return _opaque("_codecs.encode")(text, encoding)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("_codecs", "encode"): _latin1,
    ("argparse", "Namespace"): argparse.Namespace,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "complex"): complex,
}


class Opaque:
    """A pickled object of a class that is not constructed: its qualified name and pickled arguments, inert."""

    qualname: ClassVar[str] = "?"
    args: tuple[Any, ...]
    state: Any
    items: list[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        self = object.__new__(cls)
        self.args = args
        self.state = None
        self.items = []
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items.append((key, value))

    def append(self, value: Any) -> None:
        self.items.append(value)

    def extend(self, values: Any) -> None:
        self.items.extend(values)

    def __repr__(self) -> str:
        return f"<not constructed: {self.qualname}>"


class _Persistent(Opaque):
    qualname = "torch storage (not read)"


_MADE: dict[str, type[Opaque]] = {}


def _opaque(qual: str) -> type[Opaque]:
    """The :class:`Opaque` subclass that stands for the global *qual* (made once, holds nothing of it)."""
    cls = _MADE.get(qual)
    if cls is None:
        cls = _MADE[qual] = type("Opaque", (Opaque,), {"qualname": qual})
    return cls


class _Unpickler(pickle.Unpickler):
    """Resolves :data:`_ALLOWED` by name; every other global is an :class:`Opaque` subclass named after it."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        return _opaque(f"{module}.{name}"[:200])

    def persistent_load(self, pid: Any) -> Any:
        return _Persistent(pid)


def _unpickle(raw: bytes, path: Path | str) -> Any:
    try:
        up = _Unpickler(io.BytesIO(raw))
        obj = up.load()
        if isinstance(obj, int) and not isinstance(obj, bool) and obj == _LEGACY_MAGIC:     # torch's stream form
            up.load()           # protocol version
            up.load()           # system info
            obj = up.load()
        return obj
    except Exception as exc:            # any malformed pickle: one line naming the file
        raise CheckpointError(f"{path}: its pickle cannot be read ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else ''}).") from exc


def _torch_saved(fh: IO[bytes], size: int, path: Path | str) -> Any:
    """The object of a ``torch.save`` stream *fh*: its zip's ``data.pkl`` or the old stream form, unpickled inertly."""
    try:
        is_zip = zipfile.is_zipfile(fh)
        fh.seek(0)
        if not is_zip:
            if size > MAX_PICKLE_BYTES:
                raise CheckpointError(f"{path}: {size} bytes, above the {MAX_PICKLE_BYTES}-byte cap for a pickle.")
            return _unpickle(fh.read(), path)
        with zipfile.ZipFile(fh) as zf:
            pkls = [i for i in zf.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            if len(pkls) != 1:
                raise CheckpointError(f"{path}: a zip without one <archive>/data.pkl; not a torch.save file.")
            if pkls[0].file_size > MAX_PICKLE_BYTES:
                raise CheckpointError(f"{path}: its pickle is {pkls[0].file_size} bytes, above the "
                                      f"{MAX_PICKLE_BYTES}-byte cap for a checkpoint's pickle.")
            raw = zf.read(pkls[0])
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise CheckpointError(f"{path}: not a readable torch.save file ({type(exc).__name__}).") from exc
    return _unpickle(raw, path)


def read_pickle(path: Path) -> Any:
    """The object a ``torch.save`` file pickles, read with the restricted unpickler (no tensor data read).

    *path* may be a distributed checkpoint's ``.metadata``: then the object is its ``common_state``
    (:func:`_common_state`).
    """
    from gradforensics.replay.untrusted import check_regular, open_regular

    if path.name == ".metadata":
        if (path.parent / "metadata.json").is_file():           # torch_dist (check_is_distributed_checkpoint)
            return _common_state(path)
        return {"args": _common_state(path, DCP_ARGS_KEY)}      # torch_dcp / fsdp_dtensor: the state dict itself
    size = check_regular(path)
    with open_regular(path) as fh:
        return _torch_saved(fh, size, path)


def _common_state(meta: Path, fqn: str = COMMON_STATE_KEY) -> Any:
    """The ``common_state`` object of a current-form ``torch_dist`` checkpoint (a DCP directory); with *fqn*
    :data:`DCP_ARGS_KEY`, the ``args`` object of a ``torch_dcp`` / ``fsdp_dtensor`` one.

    Megatron-LM saves the common dict as ``ShardedObject("common_state", ..., global_shape=(1,),
    global_offset=(0,))`` (``megatron/core/dist_checkpointing/serialization.py``), which the distributed
    checkpoint stores under ``common_state/shard_0_1`` as the bytes of ``torch.save([common dict])``
    (``strategies/torch.py`` ``_mcore_to_torch_sharded_object``).  ``.metadata`` is unpickled with the same
    inert unpickler: its index entries are read by their field names, the byte range checked against the file.
    """
    from gradforensics.replay.untrusted import check_regular, open_regular

    if check_regular(meta) > MAX_PICKLE_BYTES:
        raise CheckpointError(f"{meta}: above the {MAX_PICKLE_BYTES}-byte cap for a pickle.")
    with open_regular(meta) as fh:
        md = _unpickle(fh.read(), meta)
    state = md.state if isinstance(md, Opaque) else None
    state = state[1] if isinstance(state, tuple) and len(state) == 2 else state    # (dict state, slot state)
    storage = state.get("storage_data") if isinstance(state, dict) else None
    if not isinstance(storage, dict):
        raise CheckpointError(f"{meta}: not a distributed checkpoint's metadata (no storage_data).")
    for key, info in storage.items():
        k, i = getattr(key, "state", None), getattr(info, "state", None)
        if isinstance(k, dict) and k.get("fqn") == fqn and isinstance(i, dict):
            rel, off, n = i.get("relative_path"), i.get("offset"), i.get("length")
            if not (isinstance(rel, str) and "/" not in rel and rel not in ("", ".", "..") and isinstance(off, int)
                    and isinstance(n, int) and off >= 0 and 0 < n <= MAX_PICKLE_BYTES):
                raise CheckpointError(f"{meta}: {fqn} is stored at ({rel!r}, {off!r}, {n!r}): not a "
                                      "file of this directory with a byte range.")
            file = meta.parent / rel
            if off + n > check_regular(file):
                raise CheckpointError(f"{file}: {fqn} is said to lie at bytes {off}..{off + n}, past "
                                      "the end of the file.")
            with open_regular(file) as fh:
                fh.seek(off)
                blob = fh.read(n)
            where = f"{file} ({fqn})"
            obj = _torch_saved(io.BytesIO(blob), n, where)
            inner = obj.state if isinstance(obj, Opaque) and obj.qualname == "_io.BytesIO" else None
            if isinstance(inner, tuple) and inner and isinstance(inner[0], bytes):    # the BytesIO pickled itself
                obj = _torch_saved(io.BytesIO(inner[0]), len(inner[0]), where)
            return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj      # [common dict], as saved
    fmt = "torch_dist" if fqn == COMMON_STATE_KEY else "torch_dcp / fsdp_dtensor (no metadata.json)"
    raise CheckpointError(f"{meta}: no {fqn} entry (Megatron-LM's saved arguments) in this distributed checkpoint "
                          f"(read as --ckpt-format {fmt}).")


@dataclass(frozen=True)
class RunArgs:
    """What the import takes from a run's saved arguments (Megatron-LM's names in the comments)."""

    source: str
    tp: int                         #: tensor_model_parallel_size
    pp: int                         #: pipeline_model_parallel_size
    ep: int                         #: expert_model_parallel_size
    etp: int                        #: expert_tensor_parallel_size (None there: the tensor-parallel size)
    vp: int                         #: virtual_pipeline_model_parallel_size (None there: 1)
    cp: int                         #: context_parallel_size
    sp: bool                        #: sequence_parallel
    num_heads: int | None           #: num_attention_heads
    num_query_groups: int | None    #: num_query_groups when group_query_attention, else None
    gated_mlp: bool                 #: swiglu
    padded_vocab_size: int | None   #: padded_vocab_size
    vocab_size: int | None          #: vocab_size (set for the tokenizers that take --vocab-size)
    divisible_by: int | None        #: make_vocab_size_divisible_by
    moe_topk: int | None = None     #: moe_router_topk (the experts each token is routed to)
    tp_pp_dp: bool = False          #: use_tp_pp_dp_mapping (rank order tp-cp-ep-pp-dp, not tp-cp-ep-dp-pp)

    def as_attrs(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _field(ns: argparse.Namespace, name: str, path: Path, *, default: Any = None, kind: type = int) -> Any:
    v = getattr(ns, name, default)
    if v is None:
        return default
    ok = isinstance(v, bool) if kind is bool else (isinstance(v, int) and not isinstance(v, bool) and v >= 1)
    if not ok:
        what = v.qualname if isinstance(v, Opaque) else type(v).__name__
        raise CheckpointError(f"{path}: the saved argument {name} is {what} {str(v)[:40]!r}; Megatron-LM saves "
                              f"{'a bool' if kind is bool else 'a positive integer'} there.")
    return v


def read_args(path: Path) -> RunArgs:
    """The :class:`RunArgs` of one ``common.pt`` / ``model_optim_rng.pt`` file."""
    obj = read_pickle(path)
    ns = obj.get("args") if isinstance(obj, dict) else None
    if not isinstance(ns, argparse.Namespace):
        found = type(ns).__name__ if not isinstance(ns, Opaque) else ns.qualname
        raise CheckpointError(f"{path}: no saved arguments (Megatron-LM keeps an argparse.Namespace under 'args'; "
                              f"found {found if isinstance(obj, dict) else type(obj).__name__}).")
    tp = _field(ns, "tensor_model_parallel_size", path, default=1)
    gqa = _field(ns, "group_query_attention", path, default=False, kind=bool)
    return RunArgs(
        source=str(path), tp=tp, pp=_field(ns, "pipeline_model_parallel_size", path, default=1),
        ep=_field(ns, "expert_model_parallel_size", path, default=1),
        etp=_field(ns, "expert_tensor_parallel_size", path, default=tp),
        vp=_field(ns, "virtual_pipeline_model_parallel_size", path, default=1),
        cp=_field(ns, "context_parallel_size", path, default=1),
        sp=_field(ns, "sequence_parallel", path, default=False, kind=bool),
        num_heads=_field(ns, "num_attention_heads", path),
        num_query_groups=_field(ns, "num_query_groups", path) if gqa else None,
        gated_mlp=_field(ns, "swiglu", path, default=False, kind=bool),
        padded_vocab_size=_field(ns, "padded_vocab_size", path), vocab_size=_field(ns, "vocab_size", path),
        divisible_by=_field(ns, "make_vocab_size_divisible_by", path),
        moe_topk=_field(ns, "moe_router_topk", path),
        tp_pp_dp=_field(ns, "use_tp_pp_dp_mapping", path, default=False, kind=bool))


def _args_file(d: Path) -> Path | None:
    """The file holding the arguments in checkpoint iteration directory *d*, or ``None``."""
    if (d / "common.pt").is_file():
        return d / "common.pt"
    for sub in sorted(p for p in d.iterdir() if p.is_dir() and _RANK_DIR.match(p.name)):
        if (sub / "model_optim_rng.pt").is_file():
            return sub / "model_optim_rng.pt"
    if (d / ".metadata").is_file():     # torch_dist (with metadata.json), else torch_dcp / fsdp_dtensor
        return d / ".metadata"
    return None


def find_checkpoint(save: Path) -> Path | None:
    """The arguments file of *save*'s checkpoint: the tracker's iteration, else the newest that has one.

    *save* may also be an iteration directory or the file itself.
    """
    if save.is_file():
        return save
    if not save.is_dir():
        return None
    if _ITER.match(save.name) or save.name == "release" or (save / ".metadata").is_file():
        return _args_file(save)
    tracker = save / "latest_checkpointed_iteration.txt"
    if tracker.is_file() and tracker.stat().st_size < 64:
        text = tracker.read_text(errors="replace").strip()
        d = save / ("release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else "")
        if d != save and d.is_dir() and (f := _args_file(d)) is not None:
            return f
    iters = sorted((p for p in save.iterdir() if p.is_dir() and _ITER.match(p.name)), reverse=True)
    return next((f for d in iters if (f := _args_file(d)) is not None), None)


def read_run_args(save: Path, args_from: Path | None) -> tuple[RunArgs | None, str]:
    """The run's arguments (from *args_from*, else a checkpoint in *save*) and where they were looked for.

    *args_from* that holds none is refused in one line; *save* without a checkpoint gives ``None``, and so
    does ``args_from="none"`` (no search: for a checkpoint beside the dumps that is not this run's).
    """
    if args_from is not None and str(args_from) == "none":
        return None, "not read (--args-from none)"
    if args_from is not None:
        f = find_checkpoint(args_from)
        if f is None:
            raise CheckpointError(f"--args-from {args_from}: no Megatron-LM checkpoint arguments there (looked for "
                                  "iter_*/common.pt, iter_*/mp_rank_*/model_optim_rng.pt and iter_*/.metadata).")
        return read_args(f), str(f)
    f = find_checkpoint(save)
    if f is None:
        return None, (f"{save}/iter_*/{{common.pt,mp_rank_*/model_optim_rng.pt,.metadata}}: the torch, torch_dist, "
                      "torch_dcp and fsdp_dtensor checkpoint formats")
    return read_args(f), str(f)
