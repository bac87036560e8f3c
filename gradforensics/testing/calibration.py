"""Healthy real-model controls and their planted counterparts, for the calibration test and benchmark.

Two checkpoints, both captured through ``gradforensics capture`` (the CLI a team runs):

* **tiny LLaMA** (the tests' architecture: 2 layers, hidden 32, 4 query over 2 key/value
  heads, a byte-level BPE tokenizer trained here) *trained* on a consistent text
  language, then replayed on two sources drawn from that same language.  The planted
  counterpart trains on, and replays, two sources whose word chains contradict each
  other on a set of shared words (same context, different next word).
* **all-MiniLM-L6-v2**, the real sentence-embedding checkpoint, replayed under the
  contrastive loss on two sources of consistent English paragraphs.

``flag_counts`` sums what the calibration reports: per kind, the number of flags at
or above 0.5 and the largest severity.
"""

from __future__ import annotations

import contextlib
import io
import random
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ENGLISH",
    "WORDS",
    "Language",
    "capture_cli",
    "flag_counts",
    "languages",
    "minilm_store",
    "tiny_llama_store",
    "train_tiny_llama",
    "write_texts",
]


#: The words of the consistent language: each word has two possible continuations (p 0.7 / 0.3).
WORDS = ("the", "of", "and", "model", "gradient", "layer", "head", "loss", "batch", "source", "data", "training",
         "step", "weight", "tensor", "norm", "update", "learning", "rate", "optimizer", "river", "bridge", "train",
         "snow", "music", "violin", "bread", "flour", "court", "judge", "star", "planet")
H, KV, HIDDEN, MAX_POS = 4, 2, 32, 64


@dataclass(frozen=True)
class Language:
    """A first-order word chain: ``succ[w]`` are the two successors of word ``w`` (p 0.7 / 0.3)."""

    succ: np.ndarray
    p_first: float = 0.7

    def texts(self, n: int, seed: int) -> list[str]:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            w = int(rng.integers(len(WORDS)))
            words = [WORDS[w]]
            for _ in range(int(rng.integers(12, 30))):
                w = int(self.succ[w, 0 if rng.random() < self.p_first else 1])
                words.append(WORDS[w])
            out.append(" ".join(words))
        return out


def languages(planted: bool, seed: int = 0, chain: str = "permutation") -> tuple[Language, Language]:
    """Two sources' languages: the same one (healthy), or two that disagree on half the words' successors.

    ``chain="permutation"``: the successors are two random permutations of the words, so
    the chain visits every word equally often.  ``chain="random"``: a random successor
    table, whose chain falls into a few words (a healthy language too, but a planted
    contradiction there can sit on words it never visits).
    """
    if chain not in ("permutation", "random"):
        raise ValueError(f"chain must be 'permutation' or 'random'; got {chain!r}.")
    rng = np.random.default_rng([seed, 7])
    n = len(WORDS)
    succ = (np.stack([rng.permutation(n), rng.permutation(n)], axis=1) if chain == "permutation"
            else rng.integers(n, size=(n, 2)))
    if not planted:
        return Language(succ), Language(succ)
    other = succ.copy()
    shared = rng.permutation(len(WORDS))[: len(WORDS) // 2]
    for w in shared:                                   # same context, a different, always-chosen continuation
        other[w] = (succ[w] + 1 + rng.integers(len(WORDS) - 1)) % len(WORDS)
        succ[w, 1], other[w, 1] = succ[w, 0], other[w, 0]
    return Language(succ), Language(other)


def write_texts(path: Path, texts: Iterable[str]) -> Path:
    path.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    return path


def train_tiny_llama(out: Path, langs: Sequence[Language], *, seed: int = 0, steps: int = 150, batch: int = 8,
                     seq_len: int = 32, lr: float = 3e-3) -> Path:
    """Train the tests' tiny LLaMA on *langs* (round-robin, one pure-source batch a step); save it with its tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([t for lang in langs for t in lang.texts(200, seed)], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=HIDDEN, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=KV,
                                   max_position_embeddings=MAX_POS, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    streams = []
    for i, lang in enumerate(langs):
        ids = fast("\n".join(lang.texts(4 * steps * batch // max(len(langs), 1), seed + 100 + i)))["input_ids"]
        streams.append(np.asarray(ids, dtype=np.int64))
    rng = np.random.default_rng([seed, 3])
    model.train()
    for step in range(steps):
        ids = streams[step % len(streams)]
        starts = rng.integers(len(ids) - seq_len, size=batch)
        x = torch.from_numpy(np.stack([ids[s:s + seq_len] for s in starts]))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        for g in opt.param_groups:                   # cosine decay to 10 % of the peak: a converged checkpoint
            g["lr"] = lr * (0.1 + 0.45 * (1 + np.cos(np.pi * (step + 1) / steps)))
        opt.zero_grad(set_to_none=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def capture_cli(checkpoint: Path, sources: dict[str, Path], out: Path, *args: str) -> None:
    """``gradforensics capture CHECKPOINT --data NAME=FILE ... --out OUT ARGS --quiet``; raises on a non-zero exit."""
    from gradforensics import cli

    argv = ["capture", str(checkpoint), "--out", str(out), "--quiet", "--overwrite", *args]
    for name, path in sources.items():
        argv += ["--data", f"{name}={path}"]
    err = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(err):
        warnings.simplefilter("ignore")
        rc = cli.main(argv)
    if rc != 0:
        raise RuntimeError(f"gradforensics capture exited {rc}: {err.getvalue().strip()}")


def tiny_llama_store(workdir: Path, *, planted: bool, seed: int = 0, steps: int = 150,
                     batches_per_source: int = 8, chain: str = "permutation") -> Path:
    """Train the tiny LLaMA (healthy or planted languages) and capture it on its two sources through the CLI."""
    lang_a, lang_b = languages(planted, seed, chain)
    ckpt = train_tiny_llama(workdir / "ckpt", (lang_a, lang_b), seed=seed, steps=steps)
    data = {"a": write_texts(workdir / "a.txt", lang_a.texts(200, seed + 1000)),
            "b": write_texts(workdir / "b.txt", lang_b.texts(200, seed + 2000))}
    store = workdir / "dump.zarr"
    capture_cli(ckpt, data, store, "--batches-per-source", str(batches_per_source), "--batch-size", "8",
                "--seq-len", "32", "--seed", str(seed), "--activations", "*.mlp.act_fn")
    return store


#: Consistent English paragraphs (plain descriptive prose, one topic each), two halves per paragraph.
ENGLISH = (
    "The recipe calls for two cups of flour, a pinch of salt and soft butter. Knead the dough for ten minutes, let it "
    "rise in a warm kitchen, then bake the bread until the crust is golden.",
    "Astronomers measured the light curve of a distant star and found a planet passing in front of it. The telescope "
    "recorded the dip in brightness every eleven days, which gives the orbit of the planet.",
    "The football match ended in a draw after the striker missed a penalty in the final minute. The goalkeeper dived "
    "to the left, the fans fell silent, and the referee blew the whistle for full time.",
    "Heavy rain flooded the valley and the river broke its banks near the old stone bridge. Farmers moved their "
    "cattle to higher ground while the water covered the roads and fields for days.",
    "The violinist tuned her instrument before the concert. The orchestra played a slow symphony, the cello section "
    "answered the violins, and the audience applauded the conductor at the end.",
    "The court ruled that the contract was void because one party had signed it under pressure. The judge ordered "
    "the company to return the payment, and the lawyers prepared an appeal.",
    "Engineers replaced the worn bearings of the turbine to stop the vibration in the power plant. After the repair "
    "the generator ran smoothly and the electricity output returned to normal.",
    "A new vaccine trial enrolled thousands of volunteers to test the dose against the virus. Doctors measured "
    "antibodies in blood samples and reported few side effects in the patients.",
    "The painter mixed blue and yellow pigments on the palette to find the green of spring leaves. She worked on the "
    "canvas by the window, adding light brush strokes to the landscape.",
    "The train to the mountains was delayed by snow on the tracks near the tunnel. Passengers waited at the station "
    "with hot coffee until the plough cleared the railway line.",
    "The programmer fixed a bug in the database query that made the website slow. After the patch the server "
    "answered requests quickly and the error logs stayed empty.",
    "The bees left the hive at dawn to collect nectar from the flowers in the meadow. The beekeeper checked the "
    "honeycomb frames and harvested jars of golden honey in late summer.",
    "The sailors raised the main sail as the wind turned to the west. The small boat left the harbour at noon and "
    "reached the island before the evening tide.",
    "Students in the chemistry lab heated the solution until the crystals dissolved. The teacher showed them how to "
    "filter the liquid and dry the salt on a glass plate.",
    "The museum opened a new hall for ancient coins found near the river. Visitors read the labels under the glass "
    "and learned how traders paid for grain and cloth.",
    "The gardener planted tomatoes along the south wall where the sun is warm. She watered the young plants every "
    "morning and tied the stems to wooden stakes.",
)


def minilm_store(workdir: Path, checkpoint: Path, *, seed: int = 0, tensors: Sequence[str] = ()) -> Path:
    """Replay the real all-MiniLM-L6-v2 under the contrastive loss on two consistent English sources."""
    half = len(ENGLISH) // 2
    rng = random.Random(seed)
    paras = list(ENGLISH)
    rng.shuffle(paras)
    data = {"news": write_texts(workdir / "news.txt", paras[:half]),
            "stories": write_texts(workdir / "stories.txt", paras[half:])}
    store = workdir / "minilm.zarr"
    args = ["--batches-per-source", "6", "--batch-size", "4", "--seq-len", "24", "--seed", str(seed),
            "--loss", "gradforensics.replay.losses:contrastive"]
    if tensors:
        args += ["--tensors", *tensors]
    capture_cli(checkpoint, data, store, *args)
    return store


def flag_counts(flags: Iterable[Any], threshold: float = 0.5) -> dict[str, tuple[int, float]]:
    """Per kind: (flags with severity >= *threshold*, the largest severity)."""
    out: dict[str, tuple[int, float]] = {}
    for f in flags:
        n, top = out.get(f.kind, (0, 0.0))
        out[f.kind] = (n + int(f.severity >= threshold), max(top, float(f.severity)))
    return out
