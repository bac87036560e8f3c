"""Load a problem checkpoint for ``gradforensics capture``, strictly offline.

Two kinds:

* a **Hugging Face model directory** (``config.json`` + weights + tokenizer),
  loaded with ``local_files_only=True`` under ``HF_HUB_OFFLINE=1``, never
  running code shipped in the directory (``trust_remote_code=False``); the
  model class and the loss follow from the config's ``architectures``
  (``*ForCausalLM`` / ``*LMHeadModel`` -> causal-LM loss; ``*ForMaskedLM`` /
  ``*ForPreTraining`` -> masked-LM loss with seeded masking; anything else, a
  bare encoder for instance, needs ``--loss module:function``).  Weights the
  directory lacks (a head that would be randomly initialised) are an error.
* a **raw PyTorch checkpoint** (a state dict in a ``.pt``/``.pth``/``.bin``
  or ``.safetensors`` file): ``--model-factory module:function`` builds the
  model, the state dict is read with ``torch.load(..., weights_only=True)`` -
  never an unrestricted unpickle of a file someone handed you - and loaded
  strictly; the tokenizer comes from ``--tokenizer DIR``.

While loading, a connection to anything but the local machine raises
:class:`OfflineError` (a guard on ``socket``), so a load that would need the
network fails with one clear line instead of a timeout or a download.

Files someone handed you are checked before a loader sees them, and every way
one can be broken is one :class:`CheckpointError` naming the file: the JSON
files (config, shard index, tokenizer) are read with a size cap and must hold a
JSON object (malformed or absurdly nested JSON is refused); a safetensors
header must fit the file (its length is checked against the file size before
anything is read for it, its tensors' ``data_offsets`` must lie inside the
file); a pickled ``.bin`` is read with ``torch.load(weights_only=True)``, so a
file that holds objects other than tensors and plain containers is refused
before anything in it runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pickle
import re
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import CheckpointError, GradforensicsError, NotACheckpointError, OfflineError, SpecError
from gradforensics.recording.autoheads import text_config
from gradforensics.replay import losses
from gradforensics.replay.plan import BUILTIN_LOSSES, MODEL_DTYPES

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CAUSAL_SUFFIXES",
    "JSON_FILES",
    "MASKED_SUFFIXES",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BYTES",
    "POSITION_KEYS",
    "WEIGHT_FILES",
    "Checkpoint",
    "LossFn",
    "check_safetensors",
    "checkpoint_step",
    "load_checkpoint",
    "load_tokenizer",
    "max_positions",
    "offline",
    "read_json_object",
    "read_state_dict",
    "resolve_callable",
    "torch_load",
]


LossFn = Callable[["nn.Module", Any], "torch.Tensor"]
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
MASKED_SUFFIXES = ("ForMaskedLM", "ForPreTraining")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length",
                 "max_seq_len", "block_size")
_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "", None})
#: JSON files of a model directory that transformers reads (each must hold a JSON object)
JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
              "special_tokens_map.json", "added_tokens.json")
#: the largest safetensors header read (the cap of the safetensors library itself)
MAX_HEADER_BYTES = 100_000_000
#: the largest JSON file (config, shard index, tokenizer) read
MAX_JSON_BYTES = 100_000_000
#: bytes per element of the safetensors dtypes whose sizes are checked against the data offsets
_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                   "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}


@dataclass
class Checkpoint:
    """A loaded checkpoint, ready for :func:`gradforensics.replay.replay`."""

    model: nn.Module
    tokenizer: Any
    loss_fn: LossFn
    loss_name: str
    max_positions: int | None
    path: Path
    kind: str                  # "hf" or "torch"
    step: int = 0


# ------------------------------------------------------------------ offline
@contextmanager
def offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1`` and no non-local connections, for the block."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    old_env = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    real_connect, real_gai = socket.socket.connect, socket.getaddrinfo

    def connect(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOCAL_HOSTS:
            raise OfflineError(_offline_message(address[0]))
        return real_connect(sock, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in _LOCAL_HOSTS:
            raise OfflineError(_offline_message(host))
        return real_gai(host, *args, **kwargs)

    socket.socket.connect = connect  # type: ignore[method-assign,assignment]
    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]
    try:
        yield
    finally:
        socket.socket.connect = real_connect  # type: ignore[method-assign]
        socket.getaddrinfo = real_gai  # type: ignore[assignment]
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _offline_message(host: Any) -> str:
    return (f"loading the checkpoint tried to reach {host!r}; gradforensics capture works offline only: "
            "put every file (config, weights, tokenizer) in the checkpoint directory.")


def _caused_by_offline(exc: BaseException) -> OfflineError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OfflineError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


# ------------------------------------------------------------------ helpers
def resolve_callable(spec: str, what: str) -> Callable[..., Any]:
    """``module:function`` or ``path/to/file.py:function`` -> the function."""
    mod_name, colon, fn_name = spec.rpartition(":")
    if not colon or not mod_name or not fn_name:
        raise SpecError(f"{what} {spec!r}: expected module:function (or file.py:function).")
    try:
        if mod_name.endswith(".py"):
            file = Path(mod_name)
            if not file.is_file():
                raise SpecError(f"{what} {spec!r}: file {file} not found.")
            mspec = importlib.util.spec_from_file_location(file.stem, file)
            assert mspec is not None and mspec.loader is not None
            module = importlib.util.module_from_spec(mspec)
            mspec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise SpecError(f"{what} {spec!r}: cannot import {mod_name} ({exc}).") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise SpecError(f"{what} {spec!r}: {mod_name} has no callable {fn_name!r}.")
    return fn


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in MODEL_DTYPES:
        raise SpecError(f"--model-dtype must be one of {MODEL_DTYPES}; got {name!r}.")
    return getattr(torch, name)


def max_positions(model: nn.Module) -> tuple[int | None, str]:
    """The longest sequence the model takes, and where that number comes from."""
    cfg = text_config(model)
    for obj, where in ((cfg, "config"), (model, type(model).__name__)):
        for key in POSITION_KEYS:
            v = getattr(obj, key, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v, f"{where} {key}"
    return None, ""


def checkpoint_step(path: Path) -> int | None:
    """``global_step`` from a Trainer checkpoint's ``trainer_state.json``, if there is one."""
    state = path / "trainer_state.json" if path.is_dir() else path.parent / "trainer_state.json"
    if not state.is_file():
        return None
    try:
        return int(read_json_object(state)["global_step"])
    except (CheckpointError, ValueError, KeyError, TypeError, OverflowError):   # no usable step: --step says it
        return None


# ------------------------------------------------------------------ files someone handed you
def _json_kind(obj: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "true/false", int: "a number", float: "a number"}
    return "null" if obj is None else kinds.get(type(obj), type(obj).__name__)


def _parse_json(raw: bytes, file: Path, what: str = "") -> dict[str, Any]:
    where = f"{file}: {what}: " if what else f"{file}: "
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{where}not UTF-8 text (byte {exc.start}).") from exc
    except ValueError as exc:                     # json.JSONDecodeError: says line and column
        raise CheckpointError(f"{where}not valid JSON ({_one_line(exc)[:160]}).") from exc
    except RecursionError as exc:
        raise CheckpointError(f"{where}JSON nested too deeply to read (past Python's recursion limit); no file "
                              "transformers or safetensors write looks like that.") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}holds {_json_kind(obj)}, not a JSON object {{...}}.")
    return obj


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in *file* (at most :data:`MAX_JSON_BYTES`); one-line :class:`CheckpointError` otherwise."""
    try:
        size = file.stat().st_size
        raw = file.read_bytes() if size <= MAX_JSON_BYTES else b""
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({_one_line(exc)}).") from exc
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
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            raw = f.read(n) if len(head) == 8 and n <= min(size - 8, MAX_HEADER_BYTES) else b""
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({_one_line(exc)}).") from exc
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


def _torch_load(file: Path, *, mmap: bool = False) -> Any:
    """``torch.load(file, weights_only=True)`` (memory-mapped when asked and the file is a zip archive).

    Every way a file handed to it can fail is one :class:`CheckpointError` naming it; a pickle
    that names a global outside torch's allowlist is refused before anything in it is called.
    """
    import struct
    import zipfile

    import torch

    try:
        with file.open("rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"     # what torch.load takes for its zip format
        whole = zipped and zipfile.is_zipfile(file)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({_one_line(exc)}).") from exc
    if zipped and not whole:
        raise CheckpointError(f"{file}: a zip archive (torch.save's format) without its central directory: "
                              "truncated.")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap and zipped)
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
        why = _one_line(exc)[:200] or "the file ends early"
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


def _check_weight_files(path: Path) -> None:
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
            _torch_load(file, mmap=True)        # the pickle only: the tensors stay on disk


# ------------------------------------------------------------------ Hugging Face
def _check_hf_dir(path: Path) -> None:
    if not path.exists():
        raise NotACheckpointError(f"{path}: no such file or directory.")
    if path.is_dir() and not (path / "config.json").is_file():
        raise NotACheckpointError(
            f"{path} is not a checkpoint: no config.json (a Hugging Face model directory has config.json, "
            "weights and a tokenizer); for a raw PyTorch checkpoint file pass --model-factory module:function.")
    if path.is_file():
        raise NotACheckpointError(f"{path} is a file, not a Hugging Face model directory; for a raw PyTorch "
                                  "checkpoint pass --model-factory module:function (and --tokenizer DIR).")
    if not any((path / f).is_file() for f in WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        raise NotACheckpointError(f"{path} has config.json but no weights ({', '.join(WEIGHT_FILES[::2])}).")


def _objective(config: Any, loss: str, path: Path) -> str:
    """``causal-lm``, ``masked-lm`` or ``custom``, from ``--loss`` and the config."""
    if loss in ("causal-lm", "masked-lm"):
        return loss
    if loss != "auto":
        return "custom"
    arch = (getattr(config, "architectures", None) or [""])[0]
    if not arch:
        raise CheckpointError(f"{path}/config.json names no architectures, so the loss is not known; pass "
                              "--loss causal-lm, masked-lm or module:function.")
    if getattr(config, "is_encoder_decoder", False):
        raise CheckpointError(f"{path}: {arch} is an encoder-decoder; pass "
                              "--loss module:function.")
    if arch.endswith(CAUSAL_SUFFIXES):
        return "causal-lm"
    if arch.endswith(MASKED_SUFFIXES):
        return "masked-lm"
    raise CheckpointError(f"{path}: {arch} has no language-model head (config architectures "
                          f"{getattr(config, 'architectures', None)}); pass --loss module:function, e.g. "
                          "--loss gradforensics.replay.losses:contrastive for a sentence encoder.")


def _model_class(objective: str, config: Any) -> Any:
    import transformers

    if objective == "causal-lm":
        return transformers.AutoModelForCausalLM
    if objective == "masked-lm":
        return transformers.AutoModelForMaskedLM
    arch = (getattr(config, "architectures", None) or [""])[0]
    cls = getattr(transformers, arch, None) if arch else None
    return cls if cls is not None else transformers.AutoModel


def _check_json_files(path: Path) -> dict[str, Any]:
    """The directory's ``config.json``; every JSON file transformers reads there must be a JSON object."""
    raw = read_json_object(path / "config.json")
    for name in JSON_FILES[1:]:
        if (path / name).is_file():
            read_json_object(path / name)
    arch = raw.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise CheckpointError(f"{path}/config.json: architectures must be a list of class names; it holds "
                              f"{_json_kind(arch)}.")
    return raw


def _load_hf_model(path: Path, loss: str, dtype: torch.dtype) -> tuple[nn.Module, str]:
    from safetensors import SafetensorError
    from transformers import AutoConfig

    raw = _check_json_files(path)
    _check_weight_files(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        if raw.get("auto_map"):
            raise CheckpointError(f"{path}/config.json asks for modelling code shipped with the checkpoint "
                                  "(auto_map); gradforensics does not run it: build the model with "
                                  "--model-factory module:function.") from exc
        raise CheckpointError(f"{path}/config.json cannot be read by transformers: {_one_line(exc)}") from exc
    objective = _objective(config, loss, path)
    cls = _model_class(objective, config)
    try:
        model, info = cls.from_pretrained(path, config=config, local_files_only=True, trust_remote_code=False,
                                          dtype=dtype, output_loading_info=True, weights_only=True)
    except (OSError, ValueError, KeyError, RuntimeError, EOFError, SafetensorError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"{path}: transformers cannot load the model as {getattr(cls, '__name__', cls)}: "
                              f"{_one_line(exc)}") from exc
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise CheckpointError(f"{path}: the weights lack {len(missing)} tensors of {type(model).__name__} "
                              f"(e.g. {', '.join(missing[:3])}); they would be random. Pick another --loss "
                              "(a model without that head) or a complete checkpoint.")
    return model, objective


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved in directory *path*, from local files only."""
    from transformers import AutoTokenizer

    for name in JSON_FILES[2:]:
        if (path / name).is_file():
            read_json_object(path / name)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: no usable tokenizer (tokenizer.json / tokenizer_config.json / vocab): "
                              f"{_one_line(exc)}; pass --tokenizer DIR.") from exc


def torch_load(file: Path, *, mmap: bool = False) -> Any:
    """The one safe ``torch.load`` of a file someone handed you (``weights_only=True``; one-line errors).

    Every failure is a :class:`CheckpointError` naming *file*; a pickle naming a global
    outside torch's allowlist is refused before anything in it is called.
    """
    return _torch_load(file, mmap=mmap)


# ------------------------------------------------------------------ raw PyTorch
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
            raise CheckpointError(f"{path}: safetensors cannot read it ({_one_line(exc)}).") from exc
    obj = _torch_load(path)
    for key in ("model", "state_dict", "model_state_dict", "module"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in obj.items()):
        raise CheckpointError(f"{path}: expected a state dict (names -> tensors); found {type(obj).__name__}.")
    return dict(obj)


def _load_raw(path: Path, factory: str, dtype: torch.dtype) -> nn.Module:
    from torch import nn

    if not path.is_file():
        raise NotACheckpointError(f"{path}: no checkpoint file there (with --model-factory, CHECKPOINT is a "
                                  "state-dict file: .pt, .pth, .bin or .safetensors).")
    model = resolve_callable(factory, "--model-factory")()
    if not isinstance(model, nn.Module):
        raise SpecError(f"--model-factory {factory}: returned {type(model).__name__}, not a torch.nn.Module.")
    state = read_state_dict(path)
    result = model.load_state_dict(state, strict=False)
    bad = [("missing", result.missing_keys), ("unexpected", result.unexpected_keys)]
    for what, keys in bad:
        if keys:
            raise CheckpointError(f"{path}: {len(keys)} {what} tensors for the model {factory} builds "
                                  f"(e.g. {', '.join(sorted(keys)[:3])}); the factory must build the model "
                                  "the state dict was saved from.")
    return model.to(dtype)


# ------------------------------------------------------------------ entry point
def _loss_fn(objective: str, custom: LossFn | None, model: nn.Module, tokenizer: Any, seed: int) -> LossFn:
    if custom is not None:
        return custom
    if objective == "causal-lm":
        return losses.causal_lm
    if objective == "masked-lm":
        if tokenizer.mask_token_id is None:
            raise CheckpointError("masked-lm loss needs a tokenizer with a mask token; it has none.")
        vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or len(tokenizer))
        return losses.MaskedLM(int(tokenizer.mask_token_id), vocab, tuple(tokenizer.all_special_ids), seed)
    raise AssertionError(objective)   # pragma: no cover


def _custom_loss(loss: str) -> LossFn | None:
    if loss in BUILTIN_LOSSES:
        return None
    if ":" not in loss:
        raise SpecError(f"--loss must be one of {', '.join(BUILTIN_LOSSES)} or module:function; got {loss!r}.")
    return resolve_callable(loss, "--loss")


def _raw_objective(loss: str, model: nn.Module) -> str:
    if loss != "auto":
        return loss if loss in ("causal-lm", "masked-lm") else "custom"
    name = type(model).__name__
    if name.endswith(CAUSAL_SUFFIXES):
        return "causal-lm"
    if name.endswith(MASKED_SUFFIXES):
        return "masked-lm"
    raise SpecError(f"--loss is needed for a raw checkpoint of a {name}: causal-lm, masked-lm or module:function.")


def load_checkpoint(path: str | os.PathLike[str], *, loss: str = "auto", model_factory: str | None = None,
                    tokenizer: str | os.PathLike[str] | None = None, device: str = "cpu",
                    model_dtype: str = "float32", seed: int = 0) -> Checkpoint:
    """Load *path* offline: model (on *device*, eval mode), tokenizer and loss function.

    Parameters
    ----------
    path
        A Hugging Face model directory, or (with *model_factory*) a state-dict file.
    loss
        ``"auto"`` (from the config), ``"causal-lm"``, ``"masked-lm"`` or
        ``"module:function"`` / ``"file.py:function"`` taking ``(model, batch)``.
    model_factory
        ``"module:function"`` returning the ``nn.Module`` the state dict fits.
    tokenizer
        Directory of a saved tokenizer; default the checkpoint directory.
    device, model_dtype, seed
        Where the model runs, its parameter dtype, and the seed of masked-LM masking.

    Raises
    ------
    NotACheckpointError, CheckpointError, OfflineError, SpecError
    """
    p = Path(path)
    dtype = _torch_dtype(model_dtype)
    _check_device(device)
    custom = _custom_loss(loss)
    try:
        with offline():
            if model_factory is None:
                _check_hf_dir(p)
                model, objective = _load_hf_model(p, loss, dtype)
            else:
                model = _load_raw(p, model_factory, dtype)
                objective = _raw_objective(loss, model)
            tok_dir = Path(tokenizer) if tokenizer is not None else (p if p.is_dir() else None)
            if tok_dir is None:
                raise SpecError(f"{p}: a raw checkpoint needs --tokenizer DIR (a saved Hugging Face tokenizer).")
            tok = load_tokenizer(tok_dir)
    except GradforensicsError as exc:
        cause = _caused_by_offline(exc)
        if cause is not None and cause is not exc:
            raise cause from exc
        raise
    except Exception as exc:
        cause = _caused_by_offline(exc)
        if cause is not None:
            raise cause from exc
        raise
    model.eval()
    model.to(device)
    n, _ = max_positions(model)
    fn = _loss_fn(objective, custom, model, tok, seed)
    return Checkpoint(model, tok, fn, objective if objective != "custom" else loss, n, p,
                      "torch" if model_factory else "hf", checkpoint_step(p) or 0)


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecError(f"--device {device}: torch sees no CUDA device here; use --device cpu.")
    try:
        torch.device(device)
    except RuntimeError as exc:
        raise SpecError(f"--device {device!r} is not a torch device ({_one_line(exc)}).") from exc
