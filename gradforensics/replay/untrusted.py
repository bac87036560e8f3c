"""Files someone handed you, checked before a loader sees them: JSON, safetensors headers, pickles.

Every way one can be broken is one :class:`~gradforensics.errors.CheckpointError` naming
the file: the JSON files (config, shard index, tokenizer) are read with a size cap and must
hold a JSON object (malformed or absurdly nested JSON is refused); a safetensors header must
fit the file (its length is checked against the file size before anything is read for it,
its tensors' ``data_offsets`` must lie inside the file); a pickled ``.bin`` is read with
``torch.load(weights_only=True)``, so a file that holds objects other than tensors and plain
containers is refused before anything in it runs.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from gradforensics.errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_HEADER_BYTES", "MAX_JSON_BYTES", "check_regular", "check_safetensors", "check_tensors",
           "check_weight_files", "json_kind", "one_line", "open_regular", "read_json_object", "read_state_dict",
           "torch_load"]


#: the largest safetensors header read (the cap of the safetensors library itself)
MAX_HEADER_BYTES = 100_000_000
#: the largest JSON file (config, shard index, tokenizer) read
MAX_JSON_BYTES = 100_000_000
#: bytes per element of the safetensors dtypes whose sizes are checked against the data offsets
_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                   "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}


def _not_regular(mode: int) -> str | None:
    """What a file of *mode* is when it is not a regular file (``None`` for a regular one)."""
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def _refuse_kind(file: Path | str, what: str, error: type[Exception]) -> Exception:
    return error(f"{file}: {what}, not a regular file; only regular files are read (a pipe or device can block "
                 "or never end).")


def check_regular(file: Path | str, error: type[Exception] = CheckpointError) -> int:
    """The size of *file*, refused in one line (*error*) unless it is a regular file (symbolic links followed).

    A named pipe would block ``open()`` until a writer comes, a device never ends; neither is data.
    """
    try:
        mode = os.stat(file)
    except OSError as exc:
        raise error(f"{file}: cannot be read ({one_line(exc)}).") from exc
    what = _not_regular(mode.st_mode)
    if what is not None:
        raise _refuse_kind(file, what, error)
    return mode.st_size


def open_regular(file: Path | str, error: type[Exception] = CheckpointError) -> IO[bytes]:
    """*file* opened for binary reading, refused in one line (*error*) unless it is a regular file.

    Checked with ``os.stat`` first, then opened with ``O_NONBLOCK`` (a FIFO swapped in after the
    check does not block the open) and checked again on the open descriptor.
    """
    check_regular(file, error)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(file, flags)
    except OSError as exc:
        raise error(f"{file}: cannot be read ({one_line(exc)}).") from exc
    try:
        what = _not_regular(os.fstat(fd).st_mode)
        if what is not None:
            raise _refuse_kind(file, what, error)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def json_kind(obj: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "true/false", int: "a number", float: "a number"}
    return "null" if obj is None else kinds.get(type(obj), type(obj).__name__)


def _parse_json(raw: bytes, file: Path, what: str = "") -> dict[str, Any]:
    where = f"{file}: {what}: " if what else f"{file}: "
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where}not UTF-8 text (byte {exc.start}).") from exc
    except ValueError as exc:                     # json.JSONDecodeError: says line and column
        raise CheckpointError(f"{where}not valid JSON ({one_line(exc)[:160]}).") from exc
    except RecursionError as exc:
        raise CheckpointError(f"{where}JSON nested too deeply to read (past Python's recursion limit); no file "
                              "transformers or safetensors write looks like that.") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}holds {json_kind(obj)}, not a JSON object {{...}}.")
    return obj


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in *file* (at most :data:`MAX_JSON_BYTES`); one-line :class:`CheckpointError` otherwise."""
    try:
        with open_regular(file) as fh:
            size = os.fstat(fh.fileno()).st_size
            raw = fh.read(MAX_JSON_BYTES + 1) if size <= MAX_JSON_BYTES else b""
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({one_line(exc)}).") from exc
    if size > MAX_JSON_BYTES:
        raise CheckpointError(f"{file}: {size} B, too large for a JSON file (at most {MAX_JSON_BYTES} B are read).")
    return _parse_json(raw, file)


def _short(name: str) -> str:
    return repr(name if len(name) <= 80 else name[:77] + "...")


def check_safetensors(file: Path) -> None:
    """Refuse *file* unless its safetensors header fits it: length, JSON, each tensor's ``data_offsets``.

    A safetensors file is an 8-byte little-endian header length, a JSON header of that many
    bytes, then the tensors' data.  The length is checked against the file size and
    :data:`MAX_HEADER_BYTES` before anything is read for it (a length of 2**62 allocates nothing).
    """
    try:
        with open_regular(file) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = int.from_bytes(head, "little")
            raw = f.read(n) if len(head) == 8 and n <= min(size - 8, MAX_HEADER_BYTES) else b""
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({one_line(exc)}).") from exc
    if len(head) < 8:
        raise CheckpointError(f"{file}: {size} B, too short for a safetensors file (it starts with an 8-byte "
                              "header length).")
    if n > size - 8:
        raise CheckpointError(f"{file}: the safetensors header length says {n} B but the file is {size} B in all: "
                              "truncated, or not a safetensors file.")
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{file}: the safetensors header length says {n} B (the file is {size} B); a header "
                              f"may take at most {MAX_HEADER_BYTES} B.")
    header = _parse_json(raw, file, "safetensors header")
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
            raise CheckpointError(f"{file}: tensor {_short(name)} has no valid data_offsets [begin, end] in the "
                                  "safetensors header.")
        if offsets[1] > data:
            raise CheckpointError(f"{file}: tensor {_short(name)} ends at byte {offsets[1]} of the data, but the file "
                                  f"holds {data} B after its header: truncated.")
        shape, dtype = info.get("shape"), info.get("dtype")
        if (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(dtype, str) and dtype in _ST_DTYPE_BYTES):
            need = _ST_DTYPE_BYTES[dtype]
            for d in shape:
                need *= d
            if need != offsets[1] - offsets[0]:
                raise CheckpointError(f"{file}: tensor {_short(name)} ({dtype} {shape}) takes {need} B but its "
                                      f"data_offsets span {offsets[1] - offsets[0]} B.")


def torch_load(file: Path, *, mmap: bool = False) -> Any:
    """The one safe ``torch.load`` of a file someone handed you: ``weights_only=True``, memory-mapped when asked
    and the file is a zip archive.

    Every way the file can fail is one :class:`CheckpointError` naming it; a pickle that names a
    global outside torch's allowlist is refused before anything in it is called.
    """
    import zipfile

    with open_regular(file) as f:
        try:
            zipped = f.read(4) == b"PK\x03\x04"     # what torch.load takes for its zip format
            whole = zipped and zipfile.is_zipfile(f)
            f.seek(0)
        except OSError as exc:
            raise CheckpointError(f"{file}: cannot be read ({one_line(exc)}).") from exc
        if zipped and not whole:
            raise CheckpointError(f"{file}: a zip archive (torch.save's format) without its central directory: "
                                  "truncated.")
        # the open regular file itself, unless memory-mapped (torch maps by name: checked just above)
        obj = _torch_load(file, file if mmap and zipped else f, mmap and zipped)
    check_tensors(obj, file)
    return obj


def check_tensors(obj: Any, file: Path | str, what: str = "") -> None:
    """Refuse every tensor in *obj* whose declared shape needs more bytes than its storage holds.

    A view's elements may overlap in storage (``torch.zeros(1).expand(30000, 30000)``: strides
    0, 3.6 GB declared over 4 B saved); ``torch.load`` checks only that the view lies inside its
    storage, and the first copy or arithmetic would materialise the declared size.  Checked on
    the loaded object before anything reads the data (a memory-mapped storage is not touched):
    a tensor's distinct content is its storage, so its declared bytes must fit the storage.
    """
    import torch

    stack, seen = [(what, obj)], set()
    while stack:
        name, o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            _check_tensor(o, name, file)
        elif isinstance(o, Mapping):
            stack += [(f"{name}.{k}" if name else str(k), v) for k, v in o.items()]
        elif isinstance(o, (list, tuple)):
            stack += [(f"{name}[{i}]", v) for i, v in enumerate(o)]


def _check_tensor(t: torch.Tensor, name: str, file: Path | str) -> None:
    import torch

    if t.layout is not torch.strided or t.numel() == 0:
        return
    declared = t.numel() * t.element_size()
    held = t.untyped_storage().nbytes()
    if declared > held:
        raise CheckpointError(f"{file}: tensor {_short(name[:200])} declares shape {tuple(t.shape)} ({declared:,} B) "
                              f"with strides {tuple(t.stride())} over a storage of {held:,} B: an expanded or "
                              "overlapping view, refused before it is materialised; save it with .contiguous().")


def _torch_load(file: Path, src: Any, mmap: bool) -> Any:
    """``torch.load(src, weights_only=True)``; every failure one :class:`CheckpointError` naming *file*."""
    import struct

    import torch

    try:
        return torch.load(src, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        text = " ".join(str(exc).split()).rpartition("WeightsUnpickler error: ")[2]
        text = text.partition(" Check the documentation of torch.load")[0]
        found = re.search(r"GLOBAL ([\w.]+)", text)
        if found is not None or "allowlisted" in text:
            what = f" ({found.group(1)})" if found is not None else ""
            raise CheckpointError(f"{file}: refused to unpickle - it holds objects outside plain tensors and "
                                  f"containers{what}; torch.load(weights_only=True) stopped before calling any, so "
                                  "nothing in the file was executed. Save model.state_dict() or safetensors "
                                  "instead.") from exc
        raise CheckpointError(f"{file}: not a PyTorch checkpoint torch.load can read (the pickle is damaged: "
                              f"{text[:160]}).") from exc
    # what torch's readers raise on a truncated or damaged file (the legacy reader: also struct, index and
    # key errors and its own asserts); a bug of ours does not get here: nothing else runs in the block
    except (RuntimeError, OSError, EOFError, ValueError, IndexError, KeyError, struct.error, AssertionError) as exc:
        why = one_line(exc)[:200] or "the file ends early"
        raise CheckpointError(f"{file}: not a PyTorch checkpoint torch.load can read ({type(exc).__name__}: "
                              f"{why}); truncated, or not written by torch.save?") from exc


def _shards(index: Path, path: Path) -> list[Path]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: the shard index has no weight_map of tensor names -> shard files.")
    files = []
    for name in sorted(set(weight_map.values())):
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{index}: shard {_short(name)} is outside the checkpoint directory.")
        if not (path / name).is_file():
            raise CheckpointError(f"{index}: names shard {_short(name)}, which is not in {path}.")
        files.append(path / name)
    return files


def check_weight_files(path: Path) -> None:
    """Check the weight files transformers will load from *path* (safetensors first, as it prefers)."""
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif (path / "model.safetensors.index.json").is_file():
        files = _shards(path / "model.safetensors.index.json", path)
    elif (path / "pytorch_model.bin").is_file():
        files = [path / "pytorch_model.bin"]
    elif (path / "pytorch_model.bin.index.json").is_file():
        files = _shards(path / "pytorch_model.bin.index.json", path)
    else:
        return                                  # nothing transformers looks for: it says so, in one line
    for file in files:
        if file.suffix == ".safetensors":
            check_safetensors(file)
        else:
            torch_load(file, mmap=True)        # the pickle only: the tensors stay on disk


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from *path*: safetensors, or ``torch.load(weights_only=True)``.

    Nested checkpoints (``{"model": ...}``, ``{"state_dict": ...}``,
    ``{"model_state_dict": ...}``) are unwrapped.
    """
    import torch

    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        check_safetensors(path)
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: safetensors cannot read it ({one_line(exc)}).") from exc
    obj = torch_load(path)
    for key in ("model", "state_dict", "model_state_dict", "module"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in obj.items()):
        raise CheckpointError(f"{path}: expected a state dict (names -> tensors); found {type(obj).__name__}.")
    return dict(obj)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."
