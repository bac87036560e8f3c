"""Real training runs nobody planted, recorded live with ``gf.Recorder`` (``mode="training"``, every step).

Seeded and seconds each on one CPU core; the calibration tests and ``benchmarks/calibration.py``
train them and read what the report says of them.

* **digits MLP**: a tanh MLP 64-128-128-10 on scikit-learn's digits under the squared loss on one-hot
  targets (as in Cohen et al. 2021's edge-of-stability runs) (1797 images, full batch
  every step, so there is no sampling noise and no data order), trained by gradient descent
  (``gd``), heavy-ball momentum (``momentum``) or Adam (``adam``) at stable learning rates.
  Its sick twin is gradient descent at ``eta = 0.4``, past the edge of stability
  (``lambda_max * eta ~ 2``: the gradient flips sign every step).
* **tiny transformer**: a LLaMA- or GPT-2-style model (transformers config; 2 layers, hidden 32,
  4 heads) trained with AdamW at lr 3e-3 on bytes of real text found on the machine (the Python
  standard library's sources; license texts when no sources are found).  Mini-batches of random
  windows, so batches differ every step.  Eager attention, so the recorder takes per-head
  attention statistics (``attention="auto"``: max logit, entropy, one-hot share).

:func:`train` records one run by name (:data:`RUNS`); :func:`truths` gives what plain torch
measured of it during training (lambda_max * eta of the MLP by power iteration on the full-batch
Hessian, the consecutive-gradient cosine, the loss curve) so a test reads the truth independently
of the store.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RUNS", "RunSpec", "digits", "read_files", "real_text", "train", "truths"]


@dataclass(frozen=True)
class RunSpec:
    """One real run: the model, the optimizer and its learning rate, the steps, and whether it is sick."""

    model: str                    # "mlp", "llama" or "gpt2"
    optimizer: str                # "gd", "momentum", "adam", "adamw"
    lr: float
    steps: int
    sick: bool = False
    weights_every: int = 4
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


RUNS: dict[str, RunSpec] = {
    "mlp-gd": RunSpec("mlp", "gd", 0.1, 120, note="full-batch GD, eta 0.1 (lambda_max*eta ~ 0.75)"),
    "mlp-momentum": RunSpec("mlp", "momentum", 0.02, 120, note="full-batch heavy ball, beta 0.9, eta 0.02"),
    "mlp-adam": RunSpec("mlp", "adam", 1e-3, 120, note="full-batch Adam, lr 1e-3"),
    "mlp-eos": RunSpec("mlp", "gd", 0.4, 120, sick=True, note="full-batch GD, eta 0.4: past the edge of stability"),
    "llama-adamw": RunSpec("llama", "adamw", 3e-3, 100, weights_every=10, note="tiny LLaMA, AdamW lr 3e-3"),
    "gpt2-adamw": RunSpec("gpt2", "adamw", 3e-3, 100, weights_every=10, note="tiny GPT-2, AdamW lr 3e-3"),
}

N_DIGITS = 1797


def digits() -> tuple[Any, Any]:
    """scikit-learn's digits as float32 tensors: pixels / 16 and the labels."""
    import torch
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target, dtype=torch.int64)


def real_text(max_bytes: int = 400_000) -> bytes:
    """Bytes of real text on this machine: the Python standard library's sources, else license texts."""
    files = sorted(glob.glob("/usr/lib/python3*/[a-z]*.py")) or sorted(glob.glob("/usr/share/common-licenses/*"))
    if not files:
        import inspect
        import json

        files = [inspect.getsourcefile(json) or ""]
    return read_files(files, max_bytes)


def read_files(files: list[str], max_bytes: int) -> bytes:
    """The bytes of *files* in order, unreadable ones skipped, stopping at *max_bytes* (cut there)."""
    out = bytearray()
    for f in files:
        try:
            out += Path(f).read_bytes()
        except OSError:
            continue
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


def _mlp(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10))


def mse(model: Any, x: Any, y: Any) -> Any:
    """Half the squared error to the one-hot labels, summed over classes, mean over samples."""
    import torch

    return (model(x) - torch.nn.functional.one_hot(y, 10).to(x.dtype)).pow(2).sum(1).mean() / 2


def _optimizer(params: Any, name: str, lr: float) -> Any:
    import torch

    if name == "gd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    raise ValueError(f"optimizer must be gd, momentum, adam or adamw; got {name!r}.")


def _transformer(arch: str, seed: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(seed)
    if arch == "llama":
        cfg = transformers.LlamaConfig(  # type: ignore[call-arg]
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
        return transformers.LlamaForCausalLM(cfg)
    gpt = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4,  # type: ignore[call-arg]
                                  n_positions=64, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(gpt)


def train(name: str, path: Path, *, seed: int = 0, steps: int | None = None,
          watch: Callable[[Any], None] | None = None, **override: Any) -> Path:
    """Train run *name* of :data:`RUNS` (fields overridable) and record it live at *path*; returns *path*.

    *watch*, if given, is called with the model once it is built, before the recorder attaches:
    the twin zoo (:mod:`gradforensics.testing.twins.hf_runs`) hangs its own forward hooks there to
    measure the run's truth independently of the store.
    """
    import dataclasses

    import torch

    import gradforensics as gf

    spec = dataclasses.replace(RUNS[name], **override)
    steps = spec.steps if steps is None else steps
    torch.set_num_threads(1)
    if spec.model == "mlp":
        _train_mlp(spec, path, seed, steps, gf, watch)
    else:
        _train_text(spec, path, seed, steps, gf, watch)
    return path


def _train_mlp(spec: RunSpec, path: Path, seed: int, steps: int, gf: Any,
               watch: Callable[[Any], None] | None = None) -> None:

    x, y = digits()
    model = _mlp(seed)
    if watch is not None:
        watch(model)
    opt = _optimizer(model.parameters(), spec.optimizer, spec.lr)
    with gf.Recorder(path, model=model, sources=["digits"], tensors=["*"], activations=["1", "3"],
                     weights_every=spec.weights_every, overwrite=True,
                     extra={"dataset_size": N_DIGITS}) as rec:
        for step in range(steps):
            loss = mse(model, x, y)
            loss.backward()
            rec.record(step=step, loss=loss.item(), source="digits", n_samples=N_DIGITS, lr=spec.lr)
            opt.step()
            opt.zero_grad(set_to_none=True)


def _train_text(spec: RunSpec, path: Path, seed: int, steps: int, gf: Any,
                watch: Callable[[Any], None] | None = None, batch: int = 8, seq: int = 32) -> None:
    import torch

    data = np.frombuffer(real_text(), dtype=np.uint8).astype(np.int64)
    model = _transformer(spec.model, seed)
    if watch is not None:
        watch(model)
    opt = _optimizer(model.parameters(), spec.optimizer, spec.lr)
    rng = np.random.default_rng([seed, 5])
    act = "*.mlp.act_fn" if spec.model == "llama" else "*.mlp.act"
    model.train()
    with gf.Recorder(path, model=model, sources=["text"], heads="auto", attention="auto", activations=[act],
                     weights_every=spec.weights_every, overwrite=True) as rec:
        for step in range(steps):
            starts = rng.integers(len(data) - seq, size=batch)
            ids = torch.from_numpy(np.stack([data[s:s + seq] for s in starts]))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            rec.record(step=step, loss=loss.item(), source="text", n_samples=batch, lr=spec.lr)
            opt.step()
            opt.zero_grad(set_to_none=True)


def truths(name: str, *, seed: int = 0, steps: int | None = None, iters: int = 30) -> dict[str, float]:
    """What plain torch measures of MLP run *name* (no store): final loss, consecutive-gradient cosine
    (median of the last half), and lambda_max * eta of the full-batch loss at the end (power iteration)."""
    import torch

    spec = RUNS[name]
    steps = spec.steps if steps is None else steps
    torch.set_num_threads(1)
    x, y = digits()
    model = _mlp(seed)
    opt = _optimizer(model.parameters(), spec.optimizer, spec.lr)
    params = list(model.parameters())
    prev = None
    cosines: list[float] = []
    losses: list[float] = []
    for _ in range(steps):
        loss = mse(model, x, y)
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in params])
        if prev is not None:
            cosines.append(float(torch.nn.functional.cosine_similarity(g, prev, dim=0)))
        prev, losses = g.clone(), [*losses, float(loss.detach())]
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss = mse(model, x, y)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    v = [torch.randn_like(p) for p in params]
    lam = 0.0
    for _ in range(iters):
        norm = math.sqrt(sum(float((u * u).sum()) for u in v))
        v = [u / norm for u in v]
        hv = torch.autograd.grad(grads, params, v, retain_graph=True)
        lam = float(sum((a * b).sum() for a, b in zip(hv, v, strict=True)))
        v = [h.detach() for h in hv]
    return {"loss_first": losses[0], "loss_last": losses[-1], "lambda_eta": lam * spec.lr,
            "cos_consecutive": float(np.median(cosines[len(cosines) // 2:]))}
