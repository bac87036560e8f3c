"""Data sources for ``gradforensics capture``: text files -> packed, seeded batches.

A source is a name and a file:

* ``.txt`` - one document per line (blank lines skipped);
* ``.jsonl`` - one JSON object per line, the document in its ``text`` field
  (or ``text_field``).

Documents are tokenised with the checkpoint's own tokenizer (no special
tokens), joined into one token stream with the tokenizer's end-of-sequence
(else separator) token between documents, and cut into rows of ``seq_len``
tokens, each wrapped in the special tokens the tokenizer adds to a single
sequence (``[CLS] ... [SEP]`` for BERT, ``<s> ...`` for LLaMA).  A source's
last, shorter row is padded (``attention_mask`` 0).  Reading stops once
``OVERSAMPLE`` times the rows the capture needs are in hand, so a huge file
costs a bounded read (the draw is then from the opening part of the file).

Batches are drawn without replacement from a permutation seeded by
``(seed, crc32(source name))`` - the same batches whatever the order or the
number of the other sources; if a source has fewer rows than the capture
needs, further permutations follow (rows repeat, with a warning).  The
interleaving across sources is :func:`gradforensics.replay.run.interleave`.
"""

from __future__ import annotations

import itertools
import json
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gradforensics.errors import CaptureWarning, DataError, DataFileNotFoundError, SpecError

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_LINE_BYTES",
    "MAX_ROWS",
    "OVERSAMPLE",
    "SUFFIXES",
    "Packing",
    "Source",
    "check_file",
    "documents",
    "draw",
    "load_batches",
    "pack",
    "parse_sources",
    "precheck",
    "source_rows",
]


SUFFIXES = (".txt", ".jsonl")
OVERSAMPLE = 4
#: A line (one document) longer than this is refused: read in pieces of at most this size, never whole.
MAX_LINE_BYTES = 16 << 20
#: More rows than this in one source's batches (batches x batch size) is not a replay.
MAX_ROWS = 100_000_000
_TOKENIZE_CHUNK = 256


@dataclass(frozen=True)
class Source:
    """One ``--data NAME=PATH``."""

    name: str
    path: Path

    def where(self) -> str:
        return f"source {self.name!r} ({self.path})"


def parse_sources(specs: Sequence[str]) -> list[Source]:
    """``["zh=zh.jsonl", "en=en.txt"]`` -> sources, checking names and files."""
    out: dict[str, Source] = {}
    if not specs:
        raise SpecError("give at least one data source: --data NAME=FILE (.txt or .jsonl).")
    for spec in specs:
        name, eq, path = spec.partition("=")
        name = name.strip()
        if not eq or not name or not path:
            raise SpecError(f"--data {spec!r}: expected NAME=FILE, e.g. --data zh=zh.jsonl.")
        if name in out:
            raise SpecError(f"--data: source {name!r} given twice ({out[name].path} and {path}); "
                            "give each source one file under its own name.")
        src = Source(name, Path(path))
        check_file(src)
        out[name] = src
    return list(out.values())


def check_file(src: Source) -> None:
    """The file exists, is a file and has a known suffix."""
    if not src.path.exists():
        raise DataFileNotFoundError(f"{src.where()}: data file not found.")
    if not src.path.is_file():
        raise DataError(f"{src.where()}: not a file; expected a .txt or .jsonl file.")
    if src.path.suffix.lower() not in SUFFIXES:
        raise DataError(f"{src.where()}: unknown suffix {src.path.suffix!r}; expected .txt (one document a line) "
                        "or .jsonl (a JSON object a line).")


def _lines(src: Source) -> Iterator[tuple[int, str]]:
    with src.path.open("rb") as f:
        for n, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise DataError(f"{src.where()}: line {n} is longer than {MAX_LINE_BYTES >> 20} MiB; one line is "
                                "one document: split it.")
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{src.where()}: line {n} is not UTF-8 (byte {exc.start}: {exc.reason}); "
                                "convert the file to UTF-8.") from exc
            line = line.rstrip("\r\n")
            if line.strip():
                yield n, line


def documents(src: Source, text_field: str = "text") -> Iterator[str]:
    """The documents of *src*, validated line by line."""
    jsonl = src.path.suffix.lower() == ".jsonl"
    for n, line in _lines(src):
        if not jsonl:
            yield line
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{src.where()}: line {n} is not JSON ({exc.msg}).") from exc
        except RecursionError as exc:
            raise DataError(f"{src.where()}: line {n} nests JSON too deep to be a document.") from exc
        if not isinstance(obj, dict) or text_field not in obj:
            keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{src.where()}: line {n} has no {text_field!r} field (it has: {keys or 'nothing'}); "
                            "name the field with --text-field.")
        text = obj[text_field]
        if not isinstance(text, str):
            raise DataError(f"{src.where()}: line {n}: field {text_field!r} is {type(text).__name__}, not a string.")
        if text.strip():
            yield text


def _empty(src: Source, text_field: str) -> DataError:
    what = "line" if src.path.suffix.lower() == ".txt" else f"{text_field!r} text"
    return DataError(f"{src.where()}: the file is empty (no non-blank {what}).")


def precheck(src: Source, text_field: str = "text", n_docs: int = 100) -> None:
    """Validate the opening *n_docs* documents of *src*: cheap, before the (slow) model load."""
    if sum(1 for _ in itertools.islice(documents(src, text_field), n_docs)) == 0:
        raise _empty(src, text_field)


@dataclass(frozen=True)
class Packing:
    """How a tokenizer wraps a row: ``prefix + chunk + suffix``, documents joined by ``sep``."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    sep: int | None
    pad: int

    @classmethod
    def of(cls, tokenizer: Any) -> Packing:
        plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
        full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
        prefix, suffix = tuple(full[:at]), tuple(full[at + len(plain):])
        sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        pad = next((t for t in (tokenizer.pad_token_id, sep, 0) if t is not None), 0)
        return cls(prefix, suffix, sep, int(pad))

    def chunk_len(self, seq_len: int) -> int:
        n = seq_len - len(self.prefix) - len(self.suffix)
        if n < 2:
            raise SpecError(f"--seq-len {seq_len} leaves {n} tokens a row after the tokenizer's "
                            f"{len(self.prefix) + len(self.suffix)} special tokens; use a longer --seq-len.")
        return n


def pack(token_docs: Sequence[Sequence[int]], seq_len: int, packing: Packing) -> tuple[np.ndarray, np.ndarray]:
    """Tokenised documents -> ``(input_ids, attention_mask)``, both ``(rows, seq_len)`` int64."""
    n = packing.chunk_len(seq_len)
    stream: list[int] = []
    for doc in token_docs:
        stream.extend(doc)
        if packing.sep is not None:
            stream.append(packing.sep)
    if packing.sep is not None and stream:
        stream.pop()                                  # no separator after the last document
    rows = [stream[i:i + n] for i in range(0, len(stream), n)]
    ids = np.full((len(rows), seq_len), packing.pad, dtype=np.int64)
    mask = np.zeros((len(rows), seq_len), dtype=np.int64)
    for r, chunk in enumerate(rows):
        row = [*packing.prefix, *chunk, *packing.suffix]
        ids[r, :len(row)] = row
        mask[r, :len(row)] = 1
    return ids, mask


def source_rows(src: Source, tokenizer: Any, seq_len: int, *, text_field: str = "text",
                max_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read, tokenise and pack *src*; stop after about *max_rows* rows."""
    packing = Packing.of(tokenizer)
    n = packing.chunk_len(seq_len)
    budget = None if max_rows is None else max_rows * n
    docs: list[list[int]] = []
    n_tokens = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal n_tokens
        for ids in tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]:
            docs.append(list(ids))
            n_tokens += len(ids) + 1
        batch.clear()

    for text in documents(src, text_field):
        batch.append(text)
        if len(batch) >= _TOKENIZE_CHUNK:
            flush()
            if budget is not None and n_tokens >= budget:
                break
    if batch:
        flush()
    if not docs:
        raise _empty(src, text_field)
    return pack(docs, seq_len, packing)


def draw(n_rows: int, n_batches: int, batch_size: int, seed: int, name: str) -> np.ndarray:
    """Row indices ``(n_batches, batch_size)``: seeded permutations, without replacement within one."""
    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
    need = n_batches * batch_size
    perms = [rng.permutation(n_rows) for _ in range(-(-need // n_rows))]
    return np.concatenate(perms)[:need].reshape(n_batches, batch_size)


def load_batches(sources: Sequence[Source], tokenizer: Any, *, seq_len: int, batch_size: int,
                 n_batches: int | Mapping[str, int], seed: int = 0,
                 text_field: str = "text") -> dict[str, list[dict[str, torch.Tensor]]]:
    """``{source: [batch, ...]}``, each batch ``{"input_ids", "attention_mask"}`` (B, T) int64 tensors."""
    import torch

    if batch_size < 1 or seq_len < 1:
        raise SpecError(f"--batch-size and --seq-len must be >= 1; got {batch_size} and {seq_len}.")
    out: dict[str, list[dict[str, torch.Tensor]]] = {}
    for src in sources:
        k = int(n_batches[src.name] if isinstance(n_batches, Mapping) else n_batches)
        if k * batch_size > MAX_ROWS:
            raise SpecError(f"{src.where()}: {k:,} batches of {batch_size} rows is beyond {MAX_ROWS:,} rows; "
                            "a replay needs far fewer (lower --batches-per-source / --steps).")
        ids, mask = source_rows(src, tokenizer, seq_len, text_field=text_field,
                                max_rows=OVERSAMPLE * k * batch_size)
        if len(ids) < batch_size:
            raise DataError(f"{src.where()}: only {len(ids)} rows of {seq_len} tokens, fewer than --batch-size "
                            f"{batch_size}; add text, or lower --batch-size or --seq-len.")
        if len(ids) < k * batch_size:
            warnings.warn(f"{src.where()}: {len(ids)} rows of {seq_len} tokens for {k} batches of {batch_size}; "
                          "rows repeat across batches.", CaptureWarning, stacklevel=2)
        idx = draw(len(ids), k, batch_size, seed, src.name)
        out[src.name] = [{"input_ids": torch.from_numpy(ids[i]), "attention_mask": torch.from_numpy(mask[i])}
                         for i in idx]
    return out
