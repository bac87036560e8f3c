"""A real attention-logit-growth run, for the ``attention`` analysis' tests and docs.

A tiny causal LLaMA-style model (no QK-norm, bytes as tokens) trained with AdamW on
real text - the Python standard library's own sources, found on the machine - with
every step recorded (``attention="auto"``, the q/k projection weights' gradients
sketched).  At a high learning rate (1e-2) the q·k logits of some heads grow until
their attention is one-hot (Wortsman et al. 2023 reproduce this in small models);
ten times lower they do not.  :func:`measured_entropy` measures each head's
attention entropy independently, from the eager attention weights of held-out
batches, so a test can check which heads collapsed without trusting the capture.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["AttentionRun", "measured_entropy", "planted_attention_store", "stdlib_bytes", "train_logit_growth"]


def stdlib_bytes(n_bytes: int = 400_000) -> np.ndarray:
    """The first *n_bytes* of this Python's standard-library sources (sorted file names), as uint8 tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for f in sorted(root.glob("*.py")):
        b = f.read_bytes()
        parts.append(b)
        total += len(b)
        if total >= n_bytes:
            break
    data = b"".join(parts)[:n_bytes]
    if len(data) < 50_000:
        raise FileNotFoundError(f"{root}: too few Python sources ({len(data)} bytes) to train on.")
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64)


@dataclass
class AttentionRun:
    store: Path
    model: Any
    held_out: Any        # (B, T) token ids not trained on


def _model(seed: int, hidden: int, heads: int, layers: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=heads, max_position_embeddings=256,
                                   attn_implementation="eager")  # type: ignore[call-arg]
    return transformers.LlamaForCausalLM(cfg)


def train_logit_growth(store: Path, *, lr: float = 1e-2, steps: int = 120, seed: int = 0, batch: int = 8,
                       seq_len: int = 64, hidden: int = 64, heads: int = 4, layers: int = 2,
                       attention: bool = True) -> AttentionRun:
    """Train the tiny model on the stdlib bytes, recording every step into *store* (training mode)."""
    import torch

    import gradforensics as gf

    torch.set_num_threads(1)
    ids = stdlib_bytes()
    split = int(0.9 * ids.size)
    train, held = ids[:split], ids[split:]
    model = _model(seed, hidden, heads, layers).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(seed)
    kwargs: dict[str, Any] = {"attention": "auto"} if attention else {}
    with gf.Recorder(store, model=model, sources=["stdlib"], tensors=["*.q_proj.weight", "*.k_proj.weight"],
                     sketch=16, overwrite=True, **kwargs) as rec:
        for step in range(steps):
            starts = rng.integers(train.size - seq_len, size=batch)
            x = torch.from_numpy(np.stack([train[s:s + seq_len] for s in starts]))
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            rec.record(step=step, loss=loss, source="stdlib", n_samples=batch, lr=lr)
            opt.step()
            opt.zero_grad(set_to_none=True)
    starts = np.random.default_rng(seed + 1).integers(held.size - seq_len, size=batch)
    held_out = torch.from_numpy(np.stack([held[s:s + seq_len] for s in starts]))
    return AttentionRun(Path(store), model.eval(), held_out)


def measured_entropy(model: Any, ids: Any) -> dict[str, np.ndarray]:
    """Per layer ``model.layers.<i>.self_attn``: each head's mean normalised entropy, from eager weights.

    Independent of the capture: ``output_attentions=True`` of the eager model, causal
    queries 1.. (query 0 has one key), ``H_q / log(q + 1)`` averaged over queries and batch.
    """
    import torch

    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions
    out = {}
    for i, w in enumerate(att):
        w = w.double()[:, :, 1:]                                   # (B, H, T-1, T)
        n = torch.arange(2, w.shape[-1] + 1, dtype=torch.float64)  # keys of query 1.. (causal)
        ent = -(w * torch.log(w.clamp_min(1e-300))).sum(-1) / torch.log(n)
        out[f"model.layers.{i}.self_attn"] = ent.mean(dim=(0, 2)).numpy()
    return out


def planted_attention_store(path: Path, seed: int = 0, n_records: int = 48, heads: int = 4) -> Path:
    """A training store (arrays only) where ``layers.0.attn`` head 1's max logit grows from ~1 to ~300 and its
    entropy falls from ~0.9 to ~0.02 from record 8 on; every other head stays at logits ~3, entropy ~0.85."""
    import gradforensics as gf

    rng = np.random.default_rng(seed)
    t = np.clip((np.arange(n_records) - 8) / (n_records - 9), 0, 1)
    with gf.Recorder(path, sources=["a"], mode="training", background=False, overwrite=True) as rec:
        for i in range(n_records):
            att = {}
            for m in ("layers.0.attn", "layers.1.attn"):
                mx = 3.0 + 0.2 * rng.standard_normal(heads)
                ent = 0.85 + 0.02 * rng.standard_normal(heads)
                if m == "layers.0.attn":
                    mx[1] = 300.0 ** t[i] * (1 + 0.05 * rng.standard_normal())
                    ent[1] = 0.9 - 0.88 * t[i]
                att[m] = {"max_logit": mx, "entropy_mean": ent, "entropy_min": ent - 0.1,
                          "onehot_frac": np.clip(1 - ent, 0, 1) ** 4}
            rec.record(step=i, loss=2.0, source="a", grads={"w": rng.standard_normal((4, 4)).astype(np.float32)},
                       attention=att)
    return Path(path)
