"""``gradforensics demo``: the whole toolkit on built-in data, on a CPU, in about a minute.

1. **Train** a tiny LLaMA-style transformer (random init, 2 layers, hidden 64,
   4 query heads over 2 key/value heads) on three synthetic token sources:

   * ``zh`` and ``en``: every sequence opens with *shared pairs*, a token ``s``
     from a shared range followed by ``perm(s)``, then runs a Markov chain over
     the source's own vocabulary range.  The two sources use different
     permutations (``perm_en(s) != perm_zh(s)`` for every ``s``): the same
     context, a different continuation.  That is the planted contradiction:
     whatever the model predicts after ``s``, zh pulls one way and en the other.
     Every other prediction depends on the current token only.
   * ``code``: a near-deterministic chain over a third range, consistent with
     itself and sharing no token with the others: the healthy control.

2. **Save** the problem checkpoint with ``save_pretrained`` (``DIR/checkpoint``),
   with a word-level tokenizer whose words are the token ids (``s3``, ``zh17``,
   ``code5``, ...; :func:`make_tokenizer`), and each source's text in
   ``DIR/data/<source>.txt`` (:func:`write_data`), so that ``capture``,
   ``whatif`` and ``compare`` can be tried on the demo's own problem checkpoint.
3. **Replay** the reloaded checkpoint per source through the capture path
   (:func:`gradforensics.replay.replay`, per-head split, MLP activation
   statistics) into ``DIR/dump.zarr``.
4. **Analyze** (:func:`gradforensics.analyze`) and **report** into ``DIR``.

Everything is seeded: the same ``seed`` gives the same data, model and store.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from gradforensics.analysis.contract.model import Findings

__all__ = [
    "BOS",
    "CONSISTENT",
    "PLANTED_PAIR",
    "SOURCES",
    "DemoConfig",
    "DemoResult",
    "Source",
    "batches",
    "capture",
    "lm_loss",
    "lr_factor",
    "make_model",
    "make_sources",
    "make_tokenizer",
    "run",
    "train",
    "vocab_size",
    "words",
    "write_data",
]


SOURCES = ("zh", "en", "code")
PLANTED_PAIR = ("zh", "en")
CONSISTENT = "code"
BOS = 0                 # the id of "<s>", which opens every sequence


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the demo; the defaults run in about a minute on 2 CPU cores."""

    seed: int = 0
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    seq_len: int = 32
    batch: int = 32
    steps: int = 300
    lr: float = 3e-3
    warmup: int = 30
    n_per_source: int = 16
    positions: int = 128            # max_position_embeddings (RoPE: no weights; capture may use --seq-len <= this)
    data_docs: int = 1024           # documents (lines) per source in DIR/data/<source>.txt
    pairs: int = 6                  # zh, en: shared pairs (s, perm(s)) that open every sequence
    p_first: float = 1.0            # zh/en chains: probability of a token's first successor
    p_first_code: float = 0.7       # code: its own chain, learnt to its entropy floor within the run
    shared: int = 24                # size of the shared vocabulary range
    own: int = 48                   # size of each source's own range


# ----------------------------------------------------------------- the data
@dataclass
class Source:
    """A synthetic token source: an optional prefix of shared pairs, then a Markov chain over ``[lo, lo + n)``."""

    name: str
    lo: int
    n: int
    succ: np.ndarray                # (n, 2) successor offsets
    p_first: float                  # probability of the first successor
    perm: np.ndarray | None = None  # shared-pair continuation (offsets into the shared range)
    shared_lo: int = 1
    pairs: int = 0

    def sample(self, rng: np.random.Generator, batch: int, seq_len: int) -> np.ndarray:
        """``(batch, seq_len)`` int64 token ids: ``BOS, [s, perm(s)] x pairs, chain...``."""
        out = np.zeros((batch, seq_len), dtype=np.int64)
        perm = self.perm
        k = 2 * self.pairs if perm is not None else 0
        if perm is not None and k:
            s = rng.integers(len(perm), size=(batch, self.pairs))
            out[:, 1:k + 1:2] = self.shared_lo + s
            out[:, 2:k + 2:2] = self.shared_lo + perm[s]
        state = rng.integers(self.n, size=batch)
        first = rng.random((batch, seq_len)) < self.p_first
        for t in range(k + 1, seq_len):
            out[:, t] = self.lo + state
            state = np.where(first[:, t], self.succ[state, 0], self.succ[state, 1])
        return out


def make_sources(cfg: DemoConfig) -> dict[str, Source]:
    """The three sources; zh and en share a context range with contradicting continuations."""
    rng = np.random.default_rng([cfg.seed, 1])
    shared_lo, own_lo = 1, 1 + cfg.shared
    perm_zh = rng.permutation(cfg.shared)
    perm_en = np.roll(perm_zh, cfg.shared // 3)        # perm_en[s] != perm_zh[s] for every s
    out = {}
    for i, name in enumerate(SOURCES):
        succ = rng.integers(cfg.own, size=(cfg.own, 2))
        perm = {"zh": perm_zh, "en": perm_en}.get(name)
        out[name] = Source(name, own_lo + i * cfg.own, cfg.own, succ, cfg.p_first_code if name == CONSISTENT else cfg.p_first,
                           perm, shared_lo, cfg.pairs if perm is not None else 0)
    return out


def vocab_size(cfg: DemoConfig) -> int:
    n = 1 + cfg.shared + len(SOURCES) * cfg.own
    return -(-n // 8) * 8


def batches(source: Source, cfg: DemoConfig, seed: Any) -> Any:
    """An endless, seeded stream of ``(batch, seq_len)`` LongTensors of one source."""
    import torch

    rng = np.random.default_rng(seed)
    while True:
        yield torch.from_numpy(source.sample(rng, cfg.batch, cfg.seq_len))


# ------------------------------------------------------- tokenizer and text
def words(cfg: DemoConfig) -> list[str]:
    """The word of every token id: ``<s>`` (BOS, id 0), ``s<i>`` (shared), ``<source><i>``, ``<unused<i>>``."""
    out = ["<s>", *(f"s{i}" for i in range(cfg.shared))]
    out += [f"{name}{i}" for name in SOURCES for i in range(cfg.own)]
    return out + [f"<unused{i}>" for i in range(vocab_size(cfg) - len(out))]


def make_tokenizer(cfg: DemoConfig) -> Any:
    """A word-level ``PreTrainedTokenizerFast``: whitespace-separated words -> their ids, ``<s>`` prepended."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words(cfg))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unused0>" if "<unused0>" in vocab else "<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    # model_max_length: the length it trains at, so capture's default --seq-len packs one line a row
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", model_max_length=cfg.seq_len)


def write_data(cfg: DemoConfig, out_dir: Path) -> dict[str, Path]:
    """``out_dir/<source>.txt``: ``data_docs`` fresh sequences per source, one a line, BOS left out.

    Packed by ``capture --seq-len <cfg.seq_len>`` (the tokenizer puts ``<s>`` back),
    each line is one row, exactly a sequence the demo trains on.
    """
    vocab = np.array(words(cfg))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, (name, src) in enumerate(make_sources(cfg).items()):
        rows = src.sample(np.random.default_rng([cfg.seed, 4, i]), cfg.data_docs, cfg.seq_len)[:, 1:]
        paths[name] = out_dir / f"{name}.txt"
        paths[name].write_text("".join(" ".join(vocab[r]) + "\n" for r in rows), encoding="utf-8")
    return paths


# ---------------------------------------------------------------- the model
def make_model(cfg: DemoConfig) -> torch.nn.Module:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=vocab_size(cfg), hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max(cfg.positions, cfg.seq_len), tie_word_embeddings=False, bos_token_id=0, eos_token_id=None,
        pad_token_id=None, attn_implementation="eager",  # type: ignore[call-arg]
        gradforensics_loss="causal-lm-skip-first",   # capture --loss auto replays the loss it trains with
    )
    return LlamaForCausalLM(config)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a batch (the loss the demo trains and replays).

    The first token after BOS is not scored: from BOS alone no model can tell
    the sources apart, and that ambiguity would be a (real, but unplanted)
    conflict between all three sources.  It is ``capture``'s
    ``causal-lm-skip-first`` loss (:class:`gradforensics.replay.losses.CausalLMSkipFirst`),
    which the saved checkpoint's ``config.json`` names, so ``capture`` of the demo's
    checkpoint replays this loss.
    """
    import torch

    from gradforensics.replay.losses import CausalLMSkipFirst

    return CausalLMSkipFirst(BOS)(model, {"input_ids": batch, "attention_mask": torch.ones_like(batch)})


def lr_factor(step: int, cfg: DemoConfig) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    x = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return 0.1 + 0.45 * (1 + np.cos(np.pi * min(x, 1.0)))


def train(cfg: DemoConfig, log: IO[str] | None = None) -> tuple[torch.nn.Module, list[float]]:
    """Train the model on the three sources, round-robin, one pure-source batch per step."""
    import torch

    sources = make_sources(cfg)
    model = make_model(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_factor(k, cfg))
    streams = {s: batches(src, cfg, [cfg.seed, 2, i]) for i, (s, src) in enumerate(sources.items())}
    losses: list[float] = []
    for step in range(cfg.steps):
        name = SOURCES[step % len(SOURCES)]
        loss = lm_loss(model, next(streams[name]))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if log is not None and (step + 1) % 100 == 0:
            print(f"  step {step + 1:4d}/{cfg.steps}  loss {np.mean(losses[-30:]):.3f}", file=log, flush=True)
    return model, losses


# ------------------------------------------------------------ the pipeline
@dataclass
class DemoResult:
    out_dir: Path
    checkpoint: Path
    store: Path
    paths: dict[str, Path]
    findings: Findings
    timings: dict[str, float] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)


def capture(checkpoint: Path, store: Path, cfg: DemoConfig, log: IO[str] | None = None) -> Path:
    """Reload the checkpoint and replay ``n_per_source`` fresh batches per source into *store*."""
    from transformers import LlamaForCausalLM

    from gradforensics.replay import replay

    model = LlamaForCausalLM.from_pretrained(checkpoint, attn_implementation="eager")
    model.eval()                                     # no dropout: the checkpoint as it is
    sources = make_sources(cfg)
    streams = {s: batches(src, cfg, [cfg.seed, 3, i]) for i, (s, src) in enumerate(sources.items())}
    replay(model, streams, lm_loss, store, n_per_source=cfg.n_per_source, step=cfg.steps,
           heads="auto", activations=["*.mlp.act_fn"], progress=log is not None, file=log, overwrite=True)
    return store


def run(out_dir: str | os.PathLike[str], seed: int = 0, cfg: DemoConfig | None = None,
        log: IO[str] | None = sys.stdout, threads: int | None = None) -> DemoResult:
    """Train, save, replay, analyze and report into *out_dir*; see the module docstring.

    *threads*: torch's intra-op threads for training and replay; ``None`` picks one
    for the demo's tiny model unless ``OMP_NUM_THREADS`` is set
    (:mod:`gradforensics.replay.threads`: 10-20x faster on a busy machine).
    """
    from gradforensics.replay.threads import choose_threads, torch_threads

    with torch_threads(choose_threads(0, threads)):      # the demo's model is tiny by construction
        return _run(out_dir, seed, cfg, log)


def _run(out_dir: str | os.PathLike[str], seed: int, cfg: DemoConfig | None, log: IO[str] | None) -> DemoResult:
    from transformers.utils import logging as hf_logging

    from gradforensics.analysis.engine.run import analyze
    from gradforensics.reporting import report

    hf_logging.disable_progress_bar()            # the demo prints its own progress
    cfg = cfg or DemoConfig(seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t: dict[str, float] = {}

    def say(msg: str) -> None:
        if log is not None:
            print(msg, file=log, flush=True)

    t0 = time.perf_counter()
    say(f"gradforensics demo: training a {cfg.layers}-layer LLaMA-style model on {', '.join(SOURCES)} "
        f"({cfg.steps} steps, seed {cfg.seed}); zh and en carry a planted contradiction.")
    model, losses = train(cfg, log)
    t["train_s"] = time.perf_counter() - t0
    checkpoint = out / "checkpoint"
    model.save_pretrained(checkpoint)  # type: ignore[operator]
    make_tokenizer(cfg).save_pretrained(checkpoint)
    data = write_data(cfg, out / "data")
    say(f"problem checkpoint -> {checkpoint} (with its tokenizer); its text -> {data[SOURCES[0]].parent}/")
    t1 = time.perf_counter()
    store = capture(checkpoint, out / "dump.zarr", cfg, log)
    t["capture_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    findings = analyze(store, progress=log is not None)
    t["analyze_s"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    paths = report(findings, out, store=str(store))
    t["report_s"] = time.perf_counter() - t3
    t["total_s"] = time.perf_counter() - t0
    return DemoResult(out, checkpoint, store, paths, findings, t, losses)
