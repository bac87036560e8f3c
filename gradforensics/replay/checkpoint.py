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
:class:`~gradforensics.errors.OfflineError` (:mod:`gradforensics.replay.offline`).

Files someone handed you are checked before a loader sees them
(:mod:`gradforensics.replay.untrusted`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import CheckpointError, NotACheckpointError, SpecError
from gradforensics.recording.autoheads import text_config
from gradforensics.replay import losses
from gradforensics.replay.offline import caused_by_offline, offline
from gradforensics.replay.plan import BUILTIN_LOSSES, MODEL_DTYPES
from gradforensics.replay.untrusted import (
    check_weight_files,
    json_kind,
    one_line,
    read_json_object,
    read_state_dict,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CAUSAL_OBJECTIVES",
    "CAUSAL_SUFFIXES",
    "JSON_FILES",
    "LOSS_KEY",
    "MASKED_SUFFIXES",
    "OBJECTIVES",
    "POSITION_KEYS",
    "WEIGHT_FILES",
    "Checkpoint",
    "LossFn",
    "checkpoint_step",
    "load_checkpoint",
    "load_tokenizer",
    "max_positions",
    "resolve_callable",
]


LossFn = Callable[["nn.Module", Any], "torch.Tensor"]
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
MASKED_SUFFIXES = ("ForMaskedLM", "ForPreTraining")
#: The built-in objectives (``--loss`` names besides ``auto`` and ``module:function``).
OBJECTIVES = ("causal-lm", "causal-lm-skip-first", "masked-lm")
CAUSAL_OBJECTIVES = ("causal-lm", "causal-lm-skip-first")
#: ``config.json`` key naming the checkpoint's training loss among :data:`OBJECTIVES` (read by ``--loss auto``).
LOSS_KEY = "gradforensics_loss"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length",
                 "max_seq_len", "block_size")
#: JSON files of a model directory that transformers reads (each must hold a JSON object)
JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
              "special_tokens_map.json", "added_tokens.json")


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
    """One of :data:`OBJECTIVES` or ``custom``, from ``--loss`` and the config.

    With ``--loss auto`` a config that names its training loss among
    :data:`OBJECTIVES` in ``gradforensics_loss`` (the demo's does) gets that one.
    """
    if loss in OBJECTIVES:
        return loss
    if loss != "auto":
        return "custom"
    declared = getattr(config, LOSS_KEY, None)
    if isinstance(declared, str) and declared in OBJECTIVES:
        return declared
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

    if objective in CAUSAL_OBJECTIVES:
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
                              f"{json_kind(arch)}.")
    return raw


def _load_hf_model(path: Path, loss: str, dtype: torch.dtype) -> tuple[nn.Module, str]:
    from safetensors import SafetensorError
    from transformers import AutoConfig

    raw = _check_json_files(path)
    check_weight_files(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        if raw.get("auto_map"):
            raise CheckpointError(f"{path}/config.json asks for modelling code shipped with the checkpoint "
                                  "(auto_map); gradforensics does not run it: build the model with "
                                  "--model-factory module:function.") from exc
        raise CheckpointError(f"{path}/config.json cannot be read by transformers: {one_line(exc)}") from exc
    objective = _objective(config, loss, path)
    cls = _model_class(objective, config)
    try:
        model, info = cls.from_pretrained(path, config=config, local_files_only=True, trust_remote_code=False,
                                          dtype=dtype, output_loading_info=True, weights_only=True)
    except (OSError, ValueError, KeyError, RuntimeError, EOFError, SafetensorError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"{path}: transformers cannot load the model as {getattr(cls, '__name__', cls)}: "
                              f"{one_line(exc)}") from exc
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise CheckpointError(f"{path}: the weights lack {len(missing)} tensors of {type(model).__name__} "
                              f"(e.g. {', '.join(missing[:3])}); they would be random. Pick another --loss "
                              "(a model without that head) or a complete checkpoint.")
    return model, objective


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
                              f"{one_line(exc)}; pass --tokenizer DIR.") from exc


# ------------------------------------------------------------------ raw PyTorch
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
    if objective == "causal-lm-skip-first":
        if tokenizer.bos_token_id is None:
            raise CheckpointError("causal-lm-skip-first loss needs a tokenizer with a BOS token; it has none.")
        return losses.CausalLMSkipFirst(int(tokenizer.bos_token_id))
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
        return loss if loss in OBJECTIVES else "custom"
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
        ``"auto"`` (from the config), ``"causal-lm"``, ``"causal-lm-skip-first"``, ``"masked-lm"`` or
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
    except Exception as exc:            # a refused connection deep inside a loader: say that, in its own words
        cause = caused_by_offline(exc)
        if cause is not None and cause is not exc:
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
        raise SpecError(f"--device {device!r} is not a torch device ({one_line(exc)}).") from exc
