"""A Hugging Face Trainer's ``trainer_state.json`` read for its ``log_history``, with bounded memory.

The file is data from outside: at most :data:`~gradforensics.replay.untrusted.MAX_JSON_BYTES`
are read, and before anything is parsed the JSON objects and arrays it can hold are counted
(every ``{`` and ``[`` byte: an upper bound); past :data:`MAX_CONTAINERS` the file is refused
in one line.  ``log_history`` is then walked one entry at a time and only each entry's
``step``, ``loss`` and ``learning_rate`` are kept: a 95 MB file of ``{},`` entries would
otherwise build 32 million dicts (2.45 GB) to yield nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gradforensics.errors import CheckpointError

__all__ = ["MAX_CONTAINERS", "read_log_history"]

#: the most JSON objects and arrays a trainer_state.json may hold (a log entry is one object)
MAX_CONTAINERS = 2_000_000

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


def read_log_history(file: Path) -> dict[int, dict[str, float]] | None:
    """``{step: {"loss": ..., "lr": ...}}`` of *file*'s ``log_history`` (None when it has none).

    Raises
    ------
    CheckpointError
        The file is not a regular file, too large, holds more than :data:`MAX_CONTAINERS`
        objects and arrays, is not a JSON object, or its ``log_history`` is not a list.
    """
    from gradforensics.replay.untrusted import MAX_JSON_BYTES, one_line, open_regular

    try:
        with open_regular(file) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > MAX_JSON_BYTES:
                raise CheckpointError(f"{file}: {size} B, too large for a JSON file (at most {MAX_JSON_BYTES} B "
                                      "are read).")
            raw = fh.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot be read ({one_line(exc)}).") from exc
    containers = raw.count(b"{") + raw.count(b"[")
    if containers > MAX_CONTAINERS:
        raise CheckpointError(f"{file}: up to {containers:,} JSON objects and arrays in {size:,} B; a trainer state "
                              f"holds one per log entry and at most {MAX_CONTAINERS:,} are read.")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not UTF-8 text (byte {exc.start}).") from exc
    del raw
    try:
        return _history(text, file)
    except CheckpointError:
        raise
    except ValueError as exc:                      # json.JSONDecodeError: says line and column
        raise CheckpointError(f"{file}: not valid JSON ({one_line(exc)[:160]}).") from exc
    except RecursionError as exc:
        raise CheckpointError(f"{file}: JSON nested too deeply to read.") from exc


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _expect(text: str, i: int, chars: str, what: str) -> int:
    i = _skip_ws(text, i)
    if i >= len(text) or text[i] not in chars:
        got = repr(text[i]) if i < len(text) else "the end"
        raise json.JSONDecodeError(f"expected {what}, got {got}", text, i)
    return i


def _history(text: str, file: Path) -> dict[int, dict[str, float]] | None:
    """The top-level object walked key by key; ``log_history``'s entries one at a time."""
    i = _expect(text, 0, "{[\"0123456789-tfn", "a JSON object")
    if text[i] != "{":
        from gradforensics.replay.untrusted import json_kind

        raise CheckpointError(f"{file}: holds {json_kind(_DECODER.raw_decode(text, i)[0])}, not a JSON object "
                              "{...}.")
    history: dict[int, dict[str, float]] | None = None
    i = _expect(text, i + 1, '"}', "a key or }")
    while text[i] != "}":
        key, i = _DECODER.raw_decode(text, i)
        i = _expect(text, i, ":", "':'") + 1
        i = _skip_ws(text, i)
        if key == "log_history":
            if i >= len(text) or text[i] != "[":
                raise CheckpointError(f"{file}: log_history is not a list of log entries.")
            history, i = _entries(text, i)
        else:
            _, i = _DECODER.raw_decode(text, i)      # a value of bounded size: the containers were counted
        i = _expect(text, i, ",}", "',' or '}'")
        if text[i] == ",":
            i = _expect(text, i + 1, '"', "a key")
    end = _skip_ws(text, i + 1)
    if end < len(text):
        raise json.JSONDecodeError("extra data after the object", text, end)
    return history


def _entries(text: str, i: int) -> tuple[dict[int, dict[str, float]], int]:
    """The log rows of the array starting at ``text[i] == "["``; the index after it."""
    out: dict[int, dict[str, float]] = {}
    i = _expect(text, i + 1, "]{[\"0123456789-tfn", "a log entry or ]")
    while text[i] != "]":
        entry, i = _DECODER.raw_decode(text, i)
        _keep(entry, out)
        i = _expect(text, i, ",]", "',' or ']'")
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            if i >= len(text) or text[i] == "]":
                raise json.JSONDecodeError("expected a log entry after ','", text, i)
    return out, i + 1


def _keep(entry: Any, out: dict[int, dict[str, float]]) -> None:
    step = entry.get("step") if isinstance(entry, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return
    for key, want in (("loss", "loss"), ("learning_rate", "lr"), ("grad_norm", "grad_norm")):
        v = entry.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.setdefault(step, {})[want] = float(v)
