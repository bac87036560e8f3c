"""A series of checkpoints as a store: weight snapshots and the update of every interval.

Sources read (:func:`discover`), every file with ``torch.load(weights_only=True)`` or
safetensors' own reader, nothing else in the directories opened:

* Hugging Face Trainer output: ``SOURCE/checkpoint-N/`` directories holding
  ``model.safetensors`` or ``pytorch_model.bin`` (or their sharded ``*.index.json``),
  ``optimizer.pt`` and ``trainer_state.json``; the step is ``N``, the last
  ``trainer_state.json``'s ``log_history`` gives ``batches/loss`` and ``batches/lr``.
  ``training_args.bin``, ``rng_state.pth`` and ``scheduler.pt`` are never opened.
* Hugging Face Trainer output under FSDP (accelerate's ``save_fsdp_model`` /
  ``save_fsdp_optimizer``, kind ``hf-fsdp``): ``SHARDED_STATE_DICT`` writes
  ``checkpoint-N/pytorch_model_fsdp_0/`` and ``optimizer_0/``, two DCP directories read by
  :mod:`gradforensics.importing.dcp`; ``FULL_STATE_DICT`` writes ``pytorch_model_fsdp.bin`` and
  ``optimizer.bin`` (the optimizer state keyed by parameter name), read with ``torch.load(weights_only=True)``.
  FSDP wrapper segments (``_fsdp_wrapped_module.``, ``_orig_mod.``, ``_checkpoint_wrapped_module.``)
  are dropped from names; per-rank files (``LOCAL_STATE_DICT``, or ``use_dcp=False``) are refused.
* raw torch files ``SOURCE/<name><step>.pt|.pth|.bin`` holding a state dict, or a dict
  with ``model`` (``state_dict``, ``model_state_dict``) and maybe ``optimizer``;
* ``SOURCE/<name><step>.safetensors`` files.

* DeepSpeed universal checkpoints ``SOURCE/<name><step>/zero/<parameter>/{fp32,exp_avg,exp_avg_sq}.pt``
  (:mod:`gradforensics.importing.deepspeed`): fp32 master weights and Adam state by parameter name;

* OLMo-core checkpoints ``SOURCE/step<N>/`` (``Checkpointer``): ``model_and_optim/``, a DCP
  written by OLMo-core's own storage writer, holds ``{"model": ..., "optim": ...}`` with the
  optimizer flattened (keyed by parameter name); ``train/rank*.pt``, ``.metadata.json`` and the
  save folder's ``config.json`` (OLMo-core's, not a Hugging Face one) are never opened;

* torch distributed-checkpoint directories ``SOURCE/<name><step>/`` (a ``.metadata`` and
  ``*.distcp`` files), read by :mod:`gradforensics.importing.dcp` with a restricted
  unpickler (torch's own reader would run a plain ``pickle.load``); the model and optimizer entries.

Record ``i`` holds the update ``W(step_{i+1}) - W(step_i)`` of every selected tensor
(in float32, half-precision weights widened first), ``batches/step`` the
later step; weight snapshot ``j`` is checkpoint ``j`` (snapshots 0 and 1 are both taken
at record 0, snapshot ``j >= 1`` at record ``j - 1``).
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradforensics.errors import CheckpointError, ImportSourceError, NotACheckpointError
from gradforensics.importing.dcp import is_dcp, read_dcp
from gradforensics.importing.deepspeed import is_universal, read_universal
from gradforensics.importing.records import ImportWriter, Interval
from gradforensics.store.names import check_name

if TYPE_CHECKING:
    import torch

    from gradforensics.runlog import RunLog
    from gradforensics.store.heads import HeadSpec

__all__ = ["ADAPTER_WEIGHTS", "FSDP_MODEL_DIR", "FSDP_MODEL_FILE", "FSDP_OPTIM_DIR", "FSDP_OPTIM_FILE", "HF_WEIGHTS", "Checkpoint", "discover", "import_checkpoints", "load_checkpoint_file", "select",
           "trainer_log"]


HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
#: A PEFT (LoRA ...) model's Trainer checkpoint holds only its adapter: the tensors that train.
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_HF_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_RAW_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
_HF_DIR = re.compile(r"^checkpoint-(\d+)$")
#: accelerate's FSDP names (accelerate/utils/fsdp_utils.py, ``FSDP_MODEL_NAME`` / ``OPTIMIZER_NAME`` + index 0)
FSDP_MODEL_DIR = "pytorch_model_fsdp_0"
FSDP_MODEL_FILE = "pytorch_model_fsdp.bin"
FSDP_OPTIM_DIR = "optimizer_0"
FSDP_OPTIM_FILE = "optimizer.bin"
_FSDP_NAMES = (FSDP_MODEL_DIR, FSDP_MODEL_FILE, FSDP_OPTIM_DIR, FSDP_OPTIM_FILE)
_FSDP_RANK_FILE = re.compile(r"^(pytorch_model_fsdp|optimizer)(_\d+)?_rank\d+\.bin$")
_FSDP_OTHER_MODEL = re.compile(r"^pytorch_model_fsdp_([1-9]\d*)(\.bin)?$")
#: module wrappers whose attribute name shows up as a name segment (FSDP1, torch.compile, activation checkpointing)
_WRAPPERS = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
#: OLMo-core's ``Checkpointer.CHECKPOINT_DIR`` (``step{step}``), holding ``model_and_optim/`` (a DCP).
_OLMO_CORE_DIR = re.compile(r"^step(\d+)$")
_LAST_INT = re.compile(r"(\d+)(?!.*\d)")
_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")
_OPTIM_KEYS = ("optimizer", "optimizer_state_dict", "optim")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a series: its step, where it is and how it is laid out (``hf``, ``hf-fsdp``, ``torch``,
    ``dcp``, ``olmo-core``, ``deepspeed``)."""

    step: int
    path: Path
    kind: str


# ------------------------------------------------------------------ finding the series
def discover(source: Path) -> list[Checkpoint]:
    """The checkpoints under *source*, by step; at least two, steps distinct (one-line errors)."""
    if not source.is_dir():
        raise NotACheckpointError(f"{source}: not a directory; --format checkpoints reads a directory of "
                                  "checkpoint-N/ directories or of <name><step>.pt / .safetensors files.")
    entries = sorted(source.iterdir())
    found = [Checkpoint(int(m.group(1)), p, "hf-fsdp" if _is_fsdp(p) else "hf") for p in entries
             if p.is_dir() and (m := _HF_DIR.match(p.name))]
    if not found:
        found = [Checkpoint(int(m.group(1)), p, "olmo-core") for p in entries
                 if (m := _OLMO_CORE_DIR.match(p.name)) and is_dcp(p / "model_and_optim")]
    if not found:
        found = [Checkpoint(int(m.group(1)), p, "dcp") for p in entries
                 if is_dcp(p) and (m := _LAST_INT.search(p.name))]
    if not found:
        found = [Checkpoint(int(m.group(1)), p, "deepspeed") for p in entries
                 if is_universal(p) and (m := _LAST_INT.search(p.name))]
    if not found:
        found = [Checkpoint(int(m.group(1)), p, "torch") for p in entries
                 if p.is_file() and p.suffix in _RAW_SUFFIXES and (m := _LAST_INT.search(p.stem))]
    if len(found) < 2:
        raise ImportSourceError(f"{source}: {len(found)} checkpoint(s) found; an import needs at least two (an update "
                                "is the difference of consecutive ones): checkpoint-N/ directories, DCP directories "
                                "or files named with their step (step_100/, step_100.pt, model-200.safetensors).")
    found.sort(key=lambda c: c.step)
    for a, b in itertools.pairwise(found):
        if a.step == b.step:
            raise ImportSourceError(f"{source}: {a.path.name} and {b.path.name} both read as step {a.step}; "
                                    "keep one checkpoint per step.")
    return found


# ------------------------------------------------------------------ reading one checkpoint
def _hf_files(d: Path) -> list[Path]:
    for name in HF_WEIGHTS + ADAPTER_WEIGHTS:
        if (d / name).is_file():
            return [d / name]
    for name in _HF_INDEX:
        if (d / name).is_file():
            return _index_files(d, d / name)
    raise NotACheckpointError(f"{d}: no {', '.join(HF_WEIGHTS + ADAPTER_WEIGHTS)} (nor a sharded index) in this "
                              "checkpoint directory.")


def _index_files(d: Path, index: Path) -> list[Path]:
    from gradforensics.replay.untrusted import read_json_object

    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no weight_map {{tensor: shard file}} in the index.")
    files = sorted({str(v) for v in weight_map.values()})
    bad = [f for f in files if not isinstance(f, str) or "/" in f or "\\" in f or f in ("", ".", "..")]
    if bad:
        raise CheckpointError(f"{index}: shard {bad[0]!r} is not a file name in {d}; refused.")
    missing = [f for f in files if not (d / f).is_file()]
    if missing:
        raise CheckpointError(f"{index}: shard {missing[0]} is missing from {d}.")
    return [d / f for f in files]


def _unwrap(obj: Any, file: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """``(state dict, optimizer state or None)`` of what ``torch.load`` gave for *file*."""
    import torch

    optim = None
    if isinstance(obj, Mapping):
        optim = next((obj[k] for k in _OPTIM_KEYS if isinstance(obj.get(k), Mapping)), None)
        obj = next((obj[k] for k in _MODEL_KEYS if isinstance(obj.get(k), Mapping)), obj)
    if not isinstance(obj, Mapping) or not obj:
        raise CheckpointError(f"{file}: expected a state dict (names -> tensors), or a dict with 'model'; "
                              f"found {type(obj).__name__}.")
    sd = {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not sd:
        raise CheckpointError(f"{file}: holds no tensor under a name; not a state dict.")
    return sd, optim


def load_checkpoint_file(file: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """``(state dict, optimizer state or None)`` of one weight file (safetensors or torch)."""
    from gradforensics.replay.untrusted import read_state_dict, torch_load

    if file.suffix == ".safetensors":
        return read_state_dict(file), None
    return _unwrap(torch_load(file, mmap=True), file)


def _load(ck: Checkpoint) -> tuple[dict[str, torch.Tensor], Any]:
    """``(state dict, optimizer state or None)`` of checkpoint *ck* (``optimizer.pt`` beside an HF one)."""
    from gradforensics.replay.untrusted import torch_load

    if ck.kind == "torch":
        return load_checkpoint_file(ck.path)
    if ck.kind == "dcp":
        return read_dcp(ck.path)
    if ck.kind == "olmo-core":          # train/rank*.pt (the trainer's state) and .metadata.json are never opened
        return read_dcp(ck.path / "model_and_optim")
    if ck.kind == "deepspeed":
        return read_universal(ck.path)
    if ck.kind == "hf-fsdp":
        return _load_fsdp(ck.path)
    sd: dict[str, torch.Tensor] = {}
    for f in _hf_files(ck.path):
        sd.update(load_checkpoint_file(f)[0])
    opt = ck.path / "optimizer.pt"
    return sd, torch_load(opt, mmap=True) if opt.is_file() else None


def _is_fsdp(d: Path) -> bool:
    """Whether the Trainer checkpoint *d* was written under FSDP (accelerate's file names, or per-rank files)."""
    return any((d / n).exists() for n in _FSDP_NAMES) or any(_FSDP_RANK_FILE.match(p.name) for p in d.iterdir())


def _load_fsdp(d: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """``(state dict, optimizer state or None)`` of a Trainer checkpoint written under FSDP.

    Weights: the ``pytorch_model_fsdp_0/`` DCP (``SHARDED_STATE_DICT``), else ``pytorch_model_fsdp.bin``
    (``FULL_STATE_DICT``), else the ``model.safetensors`` the Trainer writes beside a full one; optimizer:
    ``optimizer_0/`` (DCP), else ``optimizer.bin``, else ``optimizer.pt``.  Per-rank files and a second
    model (``pytorch_model_fsdp_1``) are refused in one line.
    """
    from gradforensics.importing.dcp import read_dcp_optimizer
    from gradforensics.replay.untrusted import torch_load

    names = sorted(p.name for p in d.iterdir())
    per_rank = [n for n in names if _FSDP_RANK_FILE.match(n)]
    if per_rank:
        raise ImportSourceError(f"{d}: {per_rank[0]} is one rank's FSDP shard (accelerate's LOCAL_STATE_DICT, or "
                                "SHARDED_STATE_DICT saved with use_dcp=False); per-rank files are not read: save "
                                "with SHARDED_STATE_DICT (a DCP directory) or FULL_STATE_DICT.")
    other = [n for n in names if _FSDP_OTHER_MODEL.match(n)]
    if other:
        raise ImportSourceError(f"{d}: {other[0]} is a second FSDP model of the checkpoint; only one model "
                                f"({FSDP_MODEL_DIR} or {FSDP_MODEL_FILE}) is imported.")
    for n in (FSDP_MODEL_DIR, FSDP_OPTIM_DIR):
        if (d / n).exists() and not is_dcp(d / n):
            raise CheckpointError(f"{d / n}: not a DCP directory (no .metadata); the FSDP checkpoint is incomplete.")
    if (d / FSDP_MODEL_DIR).exists():
        sd = read_dcp(d / FSDP_MODEL_DIR)[0]
    elif (d / FSDP_MODEL_FILE).is_file():
        sd = load_checkpoint_file(d / FSDP_MODEL_FILE)[0]
    else:
        sd = {}
        for f in _hf_files(d):
            sd.update(load_checkpoint_file(f)[0])
    opt: Any = None
    if (d / FSDP_OPTIM_DIR).exists():
        opt = read_dcp_optimizer(d / FSDP_OPTIM_DIR)
    elif (d / FSDP_OPTIM_FILE).is_file():
        opt = torch_load(d / FSDP_OPTIM_FILE, mmap=True)
    elif (d / "optimizer.pt").is_file():
        opt = torch_load(d / "optimizer.pt", mmap=True)
    sd, opt = _unwrapped(sd, d), _unwrapped_optim(opt, d)
    name = adapter_name(d)
    if name is not None:
        sd, opt = _without_segment(sd, name, d), _without_segment_optim(opt, name, d)
    return sd, _adapter_named(opt, sd, d)


def adapter_name(d: Path) -> str | None:
    """The PEFT adapter's name a Trainer checkpoint *d* says it holds (``None``: no ``adapter_config.json``).

    peft's ``PeftModel.save_pretrained`` (peft 0.21.2, ``peft_model.py``) writes the ``default`` adapter's
    ``adapter_config.json`` into the directory itself and any other adapter's into ``<dir>/<adapter name>/``;
    the Trainer calls it beside an FSDP ``FULL_STATE_DICT`` checkpoint (transformers 5.24 ``Trainer.save_model``
    -> ``_save`` -> ``save_pretrained`` of the unwrapped ``PeftModel``).
    """
    if (d / "adapter_config.json").is_file():
        return "default"
    subs = [p.name for p in sorted(d.iterdir()) if p.is_dir() and (p / "adapter_config.json").is_file()]
    return subs[0] if len(subs) == 1 else None


def _drop(name: str, seg: str) -> str:
    return ".".join(p for p in name.split(".") if p != seg)


def _without_segment(sd: Mapping[str, Any], seg: str, where: Path) -> dict[str, Any]:
    """*sd* with the adapter name's segment dropped from its names, as peft's ``get_peft_model_state_dict`` saves
    them (``...lora_A.default.weight`` -> ``...lora_A.weight``); two names that meet are refused."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        p = _drop(k, seg) if isinstance(k, str) else k
        if p in out:
            raise CheckpointError(f"{where}: {k} and another entry both name {p} once the adapter name {seg!r} is "
                                  "dropped; refused rather than keep one.")
        out[p] = v
    return out


def _without_segment_optim(opt: Any, seg: str, where: Path) -> Any:
    """A name-keyed optimizer state with the adapter name's segment dropped (state keys, groups' params)."""
    if not isinstance(opt, Mapping) or not isinstance(opt.get("state"), Mapping) \
            or not isinstance(opt.get("param_groups"), list):
        return opt
    groups = [{**g, "params": [_drop(p, seg) if isinstance(p, str) else p for p in g["params"]]}
              if isinstance(g, Mapping) and isinstance(g.get("params"), list) else g for g in opt["param_groups"]]
    return {**opt, "state": _without_segment(opt["state"], seg, where), "param_groups": groups}


#: a LoRA tensor's name that still carries its adapter's name (``...lora_A.default.weight``)
_LORA_NAMED = re.compile(r"\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)\.([^.]+)\.(?:weight|bias)$")


def adapter_note(ck: Checkpoint, names: Sequence[str]) -> dict[str, str]:
    """``{"adapter_note": ...}`` when an FSDP checkpoint's LoRA tensors keep their adapter's name because no
    ``adapter_config.json`` says which it is; else ``{}``."""
    found = next((m for n in names if (m := _LORA_NAMED.search(n))), None)
    if ck.kind != "hf-fsdp" or found is None:
        return {}
    return {"adapter_note": f"the LoRA tensors keep the adapter name {found.group(1)!r} in their names (FSDP's "
                            "FULL_STATE_DICT saves the parameters' own names, and the checkpoint holds no "
                            "adapter_config.json naming the adapter): a SHARDED_STATE_DICT or plain PEFT import of "
                            f"the same run names them without '.{found.group(1)}'"}


def _plain(name: str) -> str:
    """*name* without the module wrappers' segments (``_fsdp_wrapped_module.``, ``_orig_mod.`` ...)."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _unwrapped(sd: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """*sd* keyed by plain names; two names that meet once the wrappers are dropped are refused."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        p = _plain(k) if isinstance(k, str) else k
        if p in out:
            raise CheckpointError(f"{where}: {k} and another entry both name {p} once FSDP's wrapper segments are "
                                  "dropped; refused rather than keep one.")
        out[p] = v
    return out


def _unwrapped_optim(opt: Any, where: Path) -> Any:
    """An optimizer state dict keyed by parameter name with the wrappers dropped (state keys, groups' params)."""
    if not isinstance(opt, Mapping) or not isinstance(opt.get("state"), Mapping) \
            or not isinstance(opt.get("param_groups"), list):
        return opt
    groups = [{**g, "params": [_plain(p) if isinstance(p, str) else p for p in g["params"]]}
              if isinstance(g, Mapping) and isinstance(g.get("params"), list) else g for g in opt["param_groups"]]
    return {**opt, "state": _unwrapped(opt["state"], where), "param_groups": groups}


def _adapter_named(opt: Any, sd: Mapping[str, Any], where: Path) -> Any:
    """The optimizer state renamed to the weights' names where they differ by one adapter-name segment.

    A LoRA model under FSDP with ``SHARDED_STATE_DICT``: accelerate saves the weights with
    ``adapter_only=True`` through peft's ``get_peft_model_state_dict``, which drops the adapter's
    name (``...lora_A.weight``), while the optimizer state keeps the parameter's own name
    (``...lora_A.default.weight``).  One segment whose removal turns *every* unmatched state key
    into a weight's name is dropped from them; otherwise the state is left as it is (and unnamed).
    """
    if not isinstance(opt, Mapping) or not isinstance(opt.get("state"), Mapping) \
            or not isinstance(opt.get("param_groups"), list):
        return opt
    missing = [k for k in opt["state"] if isinstance(k, str) and k not in sd]
    if not missing or len(missing) != len(opt["state"]):
        return opt
    fits = [g for g in dict.fromkeys(missing[0].split(".")) if all(_drop(k, g) in sd for k in missing)]
    return _without_segment_optim(opt, fits[0], where) if len(fits) == 1 else opt


# ------------------------------------------------------------------ the trainer's log
def trainer_log(ckpts: Sequence[Checkpoint]) -> dict[int, dict[str, float]]:
    """``{step: {"loss": ..., "lr": ...}}`` from the latest ``trainer_state.json`` that has a ``log_history``
    (streamed: :func:`~gradforensics.importing.trainer_state.read_log_history`)."""
    from gradforensics.importing.trainer_state import read_log_history

    for ck in reversed(ckpts):
        state = (ck.path if ck.kind in ("hf", "hf-fsdp") else ck.path.parent) / "trainer_state.json"
        if not state.is_file():
            continue
        history = read_log_history(state)
        if history is None:
            raise CheckpointError(f"{state}: log_history is not a list of log entries.")
        return history
    return {}


def _from_run_log(logs: RunLog) -> dict[int, dict[str, float]]:
    """``{step: {"loss": ..., "lr": ...}}`` of a run log (finite values only), as :func:`trainer_log` gives."""
    out: dict[int, dict[str, float]] = {}
    for key in ("loss", "lr"):
        for s, v in zip(logs.steps.tolist(), logs.values.get(key, ()), strict=False):
            if math.isfinite(v):
                out.setdefault(int(s), {})[key] = float(v)
    return out


def _interval_log(log: Mapping[int, Mapping[str, float]], lo: int, hi: int) -> tuple[float, float]:
    """Mean logged loss over steps ``(lo, hi]``; the lr logged last at or before *hi* (NaN where none)."""
    losses = [r["loss"] for s, r in log.items() if lo < s <= hi and "loss" in r]
    lrs = [(s, r["lr"]) for s, r in log.items() if s <= hi and "lr" in r]
    loss = float(sum(losses) / len(losses)) if losses else math.nan
    lr = max(lrs)[1] if lrs else math.nan
    return loss, lr


# ------------------------------------------------------------------ selection
def select(sd: Mapping[str, torch.Tensor], tensors: Sequence[str] | None, where: Path) -> list[str]:
    """The tensors to import: matching *tensors* globs (default: every floating 2-D tensor), names checked."""
    floating = {n for n, t in sd.items() if t.is_floating_point()}
    if tensors:
        chosen = [n for n in sd if n in floating and any(fnmatch.fnmatchcase(n, g) for g in tensors)]
        unused = [g for g in tensors if not any(fnmatch.fnmatchcase(n, g) for n in floating)]
        if unused:
            raise ImportSourceError(f"--tensors: glob {unused[0]!r} matches no floating tensor of {where} "
                                    f"(e.g. {', '.join(list(sd)[:3])}).")
    else:
        chosen = [n for n in sd if n in floating and sd[n].ndim == 2]
    if not chosen:
        raise ImportSourceError(f"{where}: no 2-D floating tensor to import; pass --tensors GLOB.")
    return [check_name(n, "tensor name") for n in chosen]


def _check_same(prev: Mapping[str, torch.Tensor], cur: Mapping[str, torch.Tensor], names: Sequence[str],
                where: Path, first: Path) -> None:
    for n in names:
        if n not in cur:
            raise ImportSourceError(f"{where}: tensor {n} is missing; {first} has it (every checkpoint of a series "
                                    "must hold the imported tensors).")
        if tuple(cur[n].shape) != tuple(prev[n].shape):
            raise ImportSourceError(f"{where}: tensor {n} has shape {tuple(cur[n].shape)}; the checkpoint before "
                                    f"holds {tuple(prev[n].shape)}.")


def _update(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``b - a`` in float32 (half-precision weights are widened first, exactly)."""
    return b.float() - a.float()


# ------------------------------------------------------------------ the import
def import_checkpoints(source: Path, out: Any, *, tensors: Sequence[str] | None,
                       heads: Any, writer_options: Mapping[str, Any], logs: RunLog | None = None) -> int:
    """Import the series under *source* into the store *out*; returns the records written.

    With *logs* (the run's own, :mod:`gradforensics.runlog`), an interval's loss is the mean logged loss
    over it and its lr the last logged, where the checkpoints' own ``trainer_state.json`` has none.
    """
    from gradforensics.importing.heads import meta_model, resolve
    from gradforensics.importing.optimizer import STATS, optim_group, summarize, update_ratio
    from gradforensics.store.probes import write_probes

    ckpts = discover(source)
    log = {**_from_run_log(logs), **trainer_log(ckpts)} if logs is not None else trainer_log(ckpts)
    prev, opt = _load(ckpts[0])
    names = select(prev, tensors, ckpts[0].path)
    cfg = _config_dir(ckpts[0])
    model = meta_model(cfg) if cfg is not None else None
    specs: dict[str, HeadSpec] = resolve({n: tuple(prev[n].shape) for n in names}, heads, model)
    order = [n for n, _ in model.named_parameters()] if model is not None else None
    own = not _safetensors(ckpts[0])          # safetensors stores names sorted: not the optimizer's order
    extra = {"import": {"format": "checkpoints", "source": str(source), "kind": ckpts[0].kind,
                        "steps": [c.step for c in ckpts], **_adapter(ckpts[-1]), **adapter_note(ckpts[0], names)}}
    info = {"class": ckpts[0].kind, "n_params": int(sum(prev[n].numel() for n in names))}
    moments = [summarize(opt, prev, names, order, own)]
    ratios: dict[str, list[float]] = {n: [] for n in names}
    per_record = {"grads": 4 * sum(prev[n].numel() for n in names),
                  "weights": sum(prev[n].numel() * min(prev[n].element_size(), 4) for n in names) * len(ckpts)
                  // (len(ckpts) - 1)}
    with ImportWriter(out, heads=specs, total=len(ckpts) - 1, per_record=per_record, framework="torch",
                      model_info=info, extra=extra, **writer_options) as w:
        for i, ck in enumerate(ckpts[1:]):
            cur, opt = _load(ck)
            _check_same(prev, cur, names, ck.path, ckpts[0].path)
            lo = ckpts[i].step
            loss, lr = _interval_log(log, lo, ck.step)
            iv = Interval(step=ck.step, loss=loss, lr=lr, n_samples=ck.step - lo, time=ck.path.stat().st_mtime)
            snaps = ([{n: prev[n] for n in names}] if i == 0 else []) + [{n: cur[n] for n in names}]
            w.record(iv, {n: _update(prev[n], cur[n]) for n in names}, snaps)
            for n in names:
                ratios[n].append(update_ratio(prev[n], cur[n]))
            moments.append(summarize(opt, cur, names, order, own))
            prev = cur
        table = {n: {k: [m.get(n, {}).get(k, math.nan) for m in moments] for k in STATS}
                 for n in names if any(n in m for m in moments)}
        w.annotate(update_weight_ratio=ratios, optimizer=table)
        keys = list(opt["state"]) if isinstance(opt, Mapping) and isinstance(opt.get("state"), Mapping) else []
        if not table and keys and all(isinstance(k, str) for k in keys):
            w.annotate(optimizer_note=f"the checkpoints hold optimizer state keyed by names that are not the "
                                      f"weights' ({keys[0]!r}; the weights have e.g. {names[0]!r}), or of other "
                                      "shapes; it is left unnamed")
        elif not table and opt is not None:
            w.annotate(optimizer_note="the checkpoints hold optimizer state but it could not be named: its "
                                      "parameters are numbered, and " + ("the safetensors files store names sorted, "
                                      "not in the model's order, while tensors share shapes; put the model's "
                                      "config.json beside the checkpoints" if not own else "no order of the "
                                      "model's tensors fits the state's shapes"))
    last = optim_group(opt, prev, names, str(ckpts[-1].path), order, own)
    if last is not None:                      # the optimizer analysis reads it as a capture's
        write_probes(w.location, None, last)
    return len(ckpts) - 1


def _adapter(ck: Checkpoint) -> dict[str, Any]:
    """``{"adapter": {...}}`` of a PEFT checkpoint (its ``adapter_config.json``, read as data), else ``{}``."""
    from gradforensics.replay.untrusted import read_json_object

    if not ((ck.kind == "hf" and any((ck.path / n).is_file() for n in ADAPTER_WEIGHTS))
            or (ck.kind == "hf-fsdp" and (ck.path / "adapter_config.json").is_file())):
        return {}
    cfg = read_json_object(ck.path / "adapter_config.json") if (ck.path / "adapter_config.json").is_file() else {}
    keep = ("peft_type", "r", "lora_alpha", "target_modules", "base_model_name_or_path", "use_rslora")
    return {"adapter": {k: cfg[k] for k in keep if isinstance(cfg.get(k), (str, int, float, list))}}


def _safetensors(ck: Checkpoint) -> bool:
    """Whether *ck*'s weights are safetensors files (their names stored sorted), or otherwise not stored in
    the model's order (an FSDP checkpoint's DCP directory: its metadata is merged from the ranks' plans)."""
    if ck.kind == "torch":
        return ck.path.suffix == ".safetensors"
    if ck.kind == "hf-fsdp":
        return not (ck.path / FSDP_MODEL_FILE).is_file() or (ck.path / FSDP_MODEL_DIR).exists()
    return ck.kind == "hf" and all(f.suffix == ".safetensors" for f in _hf_files(ck.path))


def _config_dir(ck: Checkpoint) -> Path | None:
    """Where a Hugging Face ``config.json`` of the series is (for ``heads="auto"``), or None.

    Never beside an OLMo-core series: its save folder's ``config.json`` is OLMo-core's own experiment
    config (``ConfigSaverCallback``), not a Hugging Face model's.
    """
    if ck.kind == "olmo-core":
        return None
    for d in (ck.path if ck.kind in ("hf", "hf-fsdp") else ck.path.parent, ck.path.parent):
        if (d / "config.json").is_file():
            return d
    return None
