"""A torch distributed-checkpoint (DCP) directory read without running anything from it.

A DCP directory (``torch.distributed.checkpoint.save``) holds ``.metadata``, a pickle of a
``Metadata`` (per tensor: dtype, size, chunks; per chunk: file, offset, length), and
``__<rank>_<n>.distcp`` files holding each chunk as a ``torch.save`` blob.  torch's own
reader unpickles ``.metadata`` with a plain ``pickle.load``; here a restricted unpickler
resolves only the metadata classes, ``torch.Size``, torch dtypes and layouts,
``pathlib`` paths and, per writer, the class it pickles per chunk (torch's
``_StorageInfo``; OLMo-core's own ``olmo_core.distributed.checkpoint.filesystem._StorageInfo``,
resolved by name to a local stand-in, :class:`OlmoCoreStorageInfo`, OLMo-core never imported),
and refuses any other global in one line.  Each chunk is read from its
byte range (checked against the file) with ``torch.load(weights_only=True)``, checked to
have its chunk's shape and dtype, and placed at its offsets in the full tensor; chunks
must cover the tensor exactly.  The weights are the ``model`` entry's of a nested save
(as a raw torch file's), or every top-level tensor of a flat one (torchtitan saves the model
flat beside nested ``optimizer``, ``lr_scheduler``, ``train_state`` entries: those are never
weights); the ``optimizer`` entry is rebuilt into a torch optimizer state dict - nested as
``opt.state_dict()`` gives it, or flattened by ``get_optimizer_state_dict(...,
flatten_optimizer_state_dict=True)`` (torchtitan, OLMo-core) into one keyed by parameter
name - its non-tensor values (``lr``, ``betas``, ``params``) read with
``torch.load(weights_only=True)`` too.  Other non-tensor entries are never read.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = ["OlmoCoreStorageInfo", "is_dcp", "read_dcp", "read_dcp_optimizer"]

_MD = "torch.distributed.checkpoint.metadata"


@dataclass
class OlmoCoreStorageInfo:
    """The stand-in for OLMo-core's per-chunk storage record: its fields, nothing of OLMo-core run or imported.

    OLMo-core saves with its own DCP storage writer (``RemoteFileSystemWriter``,
    ``olmo_core/distributed/checkpoint/filesystem.py``), which pickles its own dataclass
    ``olmo_core.distributed.checkpoint.filesystem._StorageInfo(relative_path, offset, length)``
    per chunk in ``.metadata``; the unpickler resolves that name to this class (its state is
    only set, and each field checked after).
    """

    relative_path: str
    offset: int
    length: int


#: Per writer, the class its ``.metadata`` pickles per chunk (file, offset, length), allowed by name: torch's
#: file-system writer's (resolved to torch's class; an entry is checked to be of it by name), OLMo-core's
#: ``RemoteFileSystemWriter``'s (resolved to the local stand-in :class:`OlmoCoreStorageInfo`).
_STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_OLMO_CORE_STORAGE_INFO = ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo")
_ALLOWED = {(_MD, n) for n in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                               "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    _STORAGE_INFO, ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath")}
_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")
_OPTIM_KEYS = ("optimizer", "optimizer_state_dict", "optim")


def is_dcp(d: Path) -> bool:
    """Whether *d* is a DCP checkpoint directory (it holds ``.metadata``)."""
    return d.is_dir() and (d / ".metadata").is_file()


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: Path) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        import importlib

        import torch

        if (module, name) == _OLMO_CORE_STORAGE_INFO:
            return OlmoCoreStorageInfo
        if (module, name) in _ALLOWED:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.where}: refers to the global {module}.{name}, which a DCP metadata file "
                              "never needs; refused without running it (the file may be hostile).")


def _metadata(d: Path) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    from gradforensics.replay.untrusted import open_regular

    f = d / ".metadata"
    try:
        with open_regular(f) as fh:
            md = _Unpickler(fh, f).load()
    except CheckpointError:
        raise
    except Exception as e:      # truncated, corrupt, or a class given bad state
        raise CheckpointError(f"{f}: not a readable DCP metadata pickle ({type(e).__name__}: {e}).") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{f}: holds {type(md).__name__}, not a DCP Metadata with tensors and storage data.")
    return md


def _storage(d: Path, md: Any) -> dict[tuple[str, tuple[int, ...]], tuple[Path, int, int]]:
    """``{(fqn, chunk offsets): (file, byte offset, length)}``, each checked against the directory."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    out = {}
    root = d.resolve()
    for key, info in md.storage_data.items():
        if not isinstance(key, MetadataIndex) or _writer(info) is None:
            raise CheckpointError(f"{d / '.metadata'}: a storage entry is {type(key).__name__} -> "
                                  f"{type(info).__name__}, not MetadataIndex -> _StorageInfo.")
        rel, off, n = info.relative_path, info.offset, info.length
        if not isinstance(rel, str) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in (off, n)):
            raise CheckpointError(f"{d / '.metadata'}: {key.fqn}: storage ({rel!r}, offset {off!r}, length {n!r}) "
                                  "is not a file name with non-negative integer offset and length.")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{d / '.metadata'}: {key.fqn} is stored through {list(info.transform_descriptors)}"
                                  "; only untransformed DCP storage is read.")
        file = (d / rel).resolve()
        if not file.is_relative_to(root) or file == root:
            raise CheckpointError(f"{d / '.metadata'}: {key.fqn} points to {rel!r}, outside {d}; refused.")
        if not file.is_file():
            raise CheckpointError(f"{d / '.metadata'}: {key.fqn} is stored in {rel}, which is missing from {d}.")
        size = file.stat().st_size
        if off + n > size:
            raise CheckpointError(f"{file}: {key.fqn} is said to lie at bytes {off}..{off + n}, past the end of "
                                  f"the file ({size} B); the file is truncated or the metadata wrong.")
        offsets = tuple(int(v) for v in key.offset) if key.offset is not None else ()
        out[(key.fqn, offsets)] = (file, off, n)
    return out


def _writer(info: Any) -> str | None:
    """Which writer's storage record *info* is (``"torch"``, ``"olmo-core"``), or None: not one of them."""
    if isinstance(info, OlmoCoreStorageInfo):
        return "olmo-core"
    return "torch" if (type(info).__module__, type(info).__qualname__) == _STORAGE_INFO else None


def _chunk(where: tuple[Path, int, int], fqn: str, *, tensor: bool = True) -> Any:
    import torch

    from gradforensics.replay.untrusted import check_tensors, open_regular

    file, off, n = where
    with open_regular(file) as fh:
        fh.seek(off)
        blob = fh.read(n)
    try:
        t = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{file}: {fqn}: bytes {off}..{off + n} are not a torch tensor "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).") from None
    if tensor and not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{file}: {fqn}: bytes {off}..{off + n} hold {type(t).__name__}, not a tensor.")
    check_tensors(t, file, fqn)
    return t


def _assemble(fqn: str, tmd: Any, storage: dict, d: Path) -> torch.Tensor:
    import torch

    size = tuple(int(v) for v in tmd.size)
    dtype = tmd.properties.dtype
    if not isinstance(dtype, torch.dtype) or any(s < 0 for s in size):
        raise CheckpointError(f"{d / '.metadata'}: {fqn}: dtype {dtype!r} / shape {size} is not a tensor's.")
    stored = sum(storage.get((fqn, tuple(int(v) for v in ch.offsets)), (None, 0, 0))[2] for ch in tmd.chunks)
    if math.prod(size) * dtype.itemsize > stored:
        raise CheckpointError(f"{d / '.metadata'}: {fqn}: shape {size} needs {math.prod(size) * dtype.itemsize} B "
                              f"but its chunks are stored in {stored} B.")
    full = torch.empty(size, dtype=dtype)
    covered = torch.zeros(size, dtype=torch.bool) if len(tmd.chunks) > 1 else None
    for ch in tmd.chunks:
        offs, sizes = tuple(int(v) for v in ch.offsets), tuple(int(v) for v in ch.sizes)
        if len(offs) != len(size) or len(sizes) != len(size) or any(
                o < 0 or o + s > t for o, s, t in zip(offs, sizes, size, strict=True)):
            raise CheckpointError(f"{d / '.metadata'}: {fqn}: chunk at {offs} of shape {sizes} lies outside its "
                                  f"tensor of shape {size}.")
        if (fqn, offs) not in storage:
            raise CheckpointError(f"{d / '.metadata'}: {fqn}: chunk at {offs} has no storage entry.")
        t = _chunk(storage[(fqn, offs)], fqn)
        if tuple(t.shape) != sizes or t.dtype != dtype:
            raise CheckpointError(f"{storage[(fqn, offs)][0]}: {fqn}: chunk at {offs} holds {t.dtype} "
                                  f"{tuple(t.shape)}; the metadata says {dtype} {sizes}.")
        region = tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))
        full[region] = t
        if covered is not None:
            covered[region] = True
    if covered is not None and not bool(covered.all()):
        raise CheckpointError(f"{d / '.metadata'}: {fqn}: its chunks do not cover the tensor of shape {size}.")
    return full


def read_dcp(d: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """``(model weights, optimizer state dict or None)`` of the DCP directory *d*.

    The weights: the ``model`` entry's (prefix stripped, as a raw torch file's) or every tensor
    of a flat save; the optimizer state rebuilt from the ``optimizer`` entry (see :func:`_optimizer`).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _metadata(d)
    tensors = {k: v for k, v in md.state_dict_metadata.items()
               if isinstance(k, str) and isinstance(v, TensorStorageMetadata)}
    prefix = _model_prefix(tensors, md.planner_data)
    chosen = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not prefix:       # flat weights beside nested entries (torchtitan): the nested ones are not weights
        chosen = {k: v for k, v in chosen.items() if not _nested_other(k, md.planner_data)}
    if not chosen:
        raise CheckpointError(f"{d / '.metadata'}: lists no tensor; not a DCP checkpoint of a model.")

    def read(storage: dict) -> tuple[dict[str, torch.Tensor], Any]:
        sd = {name: _assemble(prefix + name, tmd, storage, d) for name, tmd in chosen.items()}
        return sd, _optimizer(d, md, storage)

    return _guarded(d, md, read)


def read_dcp_optimizer(d: Path) -> dict[str, Any]:
    """The optimizer state dict of a DCP directory that holds only an optimizer entry.

    accelerate's ``save_fsdp_optimizer`` under ``SHARDED_STATE_DICT`` saves ``{"optimizer":
    optim_state}`` into a directory of its own (``optimizer_0/``, beside the model's
    ``pytorch_model_fsdp_0/``); rebuilt as :func:`read_dcp` rebuilds an ``optimizer`` entry.
    """
    md = _metadata(d)
    opt = _guarded(d, md, lambda storage: _optimizer(d, md, storage))
    if opt is None:
        raise CheckpointError(f"{d / '.metadata'}: holds no optimizer entry (an 'optimizer' key with 'state' and "
                              "'param_groups'); not a DCP checkpoint of an optimizer.")
    return opt


def _guarded(d: Path, md: Any, read: Callable[[dict], Any]) -> Any:
    """``read(storage)`` with *d*'s storage checked, every malformed metadata field one :class:`CheckpointError`."""
    try:
        return read(_storage(d, md))
    except CheckpointError:      # already the one line, naming the file (a ValueError too: not wrapped again)
        raise
    except (TypeError, ValueError, AttributeError) as e:    # metadata fields of the wrong type
        raise CheckpointError(f"{d / '.metadata'}: a tensor entry is malformed ({type(e).__name__}: {e}).") from None


def _nested_other(fqn: str, planner_data: Any) -> bool:
    """Whether *fqn* sits under a top-level entry that is not the model's (``optimizer``, ``lr_scheduler`` ...).

    torchtitan saves the model's tensors flat at the top level beside ``optimizer``,
    ``lr_scheduler``, ``dataloader`` and ``train_state`` entries (``CheckpointManager.
    _flattened_model_states_sd``, torchtitan/components/checkpoint.py); ``planner_data`` gives
    each key's path, ``("optimizer", "state.layers.0.w.exp_avg")`` for a nested one.  Without
    planner_data, a name beginning with an optimizer key and a dot is taken as nested.
    """
    paths = planner_data if isinstance(planner_data, dict) else {}
    path = paths.get(fqn)
    if isinstance(path, (tuple, list)) and path:
        return len(path) >= 2 and str(path[0]) not in _MODEL_KEYS
    return any(fqn.startswith(k + ".") for k in _OPTIM_KEYS)


def _optimizer(d: Path, md: Any, storage: dict) -> dict[str, Any] | None:
    """The ``optimizer`` entry as a torch optimizer state dict (``state`` by int id, ``param_groups`` a list).

    Rebuilt from ``planner_data``'s paths; its tensors assembled like the weights, its other
    values (``lr``, ``betas``, ``params``, ...) read with ``torch.load(weights_only=True)``.
    None where the save has no such entry or no planner_data.
    """

    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    top = next((k for k in _OPTIM_KEYS if any(isinstance(p, (tuple, list)) and len(p) >= 3 and p[0] == k
                                              for p in paths.values())), None)
    if top is None:
        top = next((k for k in _OPTIM_KEYS if any(_flat_optim(p, k) for p in paths.values())), None)
        if top is None:
            return None
        return _flat_optimizer(d, md, storage, paths, top)
    nested: dict[Any, Any] = {}
    for fqn, path in paths.items():
        entry = md.state_dict_metadata.get(fqn)
        if not isinstance(path, (tuple, list)) or len(path) < 3 or path[0] != top:
            continue
        value = _entry(fqn, entry, storage, d)
        if value is _ABSENT:
            continue
        node = nested
        for key in path[1:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise CheckpointError(f"{d / '.metadata'}: {fqn}: its path {tuple(path)} runs through a value.")
        node[path[-1]] = value
    state, groups = nested.get("state", {}), nested.get("param_groups", {})
    return {"state": {int(k) if str(k).isdigit() else k: v for k, v in state.items()},
            "param_groups": [groups[k] for k in sorted(groups, key=lambda k: int(k) if str(k).isdigit() else -1)] if isinstance(groups, dict) else []}


_ABSENT = object()


def _entry(fqn: str, entry: Any, storage: dict, d: Path) -> Any:
    """One saved value: a tensor assembled from its chunks, a non-tensor read with ``weights_only=True``, or
    :data:`_ABSENT` (an entry of another kind, or one with no stored bytes)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if isinstance(entry, TensorStorageMetadata):
        return _assemble(fqn, entry, storage, d)
    if isinstance(entry, BytesStorageMetadata) and (fqn, ()) in storage:
        return _chunk(storage[(fqn, ())], fqn, tensor=False)
    return _ABSENT


def _flat_optim(path: Any, top: str) -> bool:
    return isinstance(path, (tuple, list)) and len(path) == 2 and path[0] == top and isinstance(path[1], str) \
        and path[1].startswith(("state.", "param_groups."))


def _flat_optimizer(d: Path, md: Any, storage: dict, paths: dict, top: str) -> dict[str, Any]:
    """A flattened optimizer entry (``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, as
    torchtitan's ``OptimizersContainer.state_dict`` saves it) as a state dict keyed by parameter name.

    Keys are ``state.<parameter fqn>.<exp_avg|exp_avg_sq|step>`` and ``param_groups.<parameter
    fqn>.<lr|betas|...>``: the last dotted part is the optimizer's key (parameter names end in
    ``weight``/``bias``; optimizer keys hold no dot).  Each parameter gets its own group.
    """

    state: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    for fqn, path in paths.items():
        if not _flat_optim(path, top):
            continue
        kind, _, rest = str(path[1]).partition(".")
        name, _, key = rest.rpartition(".")
        if not name or not key:
            continue
        value = _entry(fqn, md.state_dict_metadata.get(fqn), storage, d)
        if value is _ABSENT:
            continue
        (state if kind == "state" else groups).setdefault(name, {})[key] = value
    return {"state": state, "param_groups": [{**g, "params": [n]} for n, g in groups.items()]}


def _model_prefix(tensors: dict[str, Any], planner_data: Any) -> str:
    """``"model."`` (or ``state_dict.`` ...) when the save nested the weights under that key, else ``""``.

    DCP's ``planner_data`` gives each flattened key's path in the saved dict: ``("model",
    "layers.0.weight")`` for ``{"model": sd, ...}``, ``("model.layers.0.weight",)`` for a flat
    state dict whose names merely begin with ``model.`` (kept whole).  Without it, the
    first of the model keys that some tensor name begins with.
    """
    paths = planner_data if isinstance(planner_data, dict) else {}
    if all(isinstance(paths.get(k), (tuple, list)) and paths[k] for k in tensors):
        tops = {str(paths[k][0]) for k in tensors if len(paths[k]) >= 2}
        return next((p + "." for p in _MODEL_KEYS if p in tops), "")
    return next((p + "." for p in _MODEL_KEYS if any(k.startswith(p + ".") for k in tensors)), "")
