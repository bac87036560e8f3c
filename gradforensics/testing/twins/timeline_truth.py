"""The timeline against the twin zoo's truth: one arm trained, its timeline beside the onsets its family
measured in plain torch (``onset/<signal>/<where>`` and ``spike`` in the truth).

:func:`timeline_of` trains one arm (:func:`gradforensics.testing.twins.train`), runs the timeline
analysis on its store and returns the truth and the ``flags.json`` timeline; :func:`rows` pairs each
measured onset with the timeline's (the table of ``docs/timeline.md``, printed by
``python -m gradforensics.testing.twins.timeline_truth``).  ``tests/test_twins_timeline*.py`` assert it.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

__all__ = ["ARMS", "SIGNAL_OF", "rows", "timeline_of"]

#: The arms the timeline is validated on: (family, arm, sick?).
ARMS: tuple[tuple[str, str, bool], ...] = (
    ("late-rows", "late", True), ("late-rows", "steady", False),
    ("logits", "high-lr", True), ("logits", "low-lr", False),
    ("nanogpt", "high-lr", True), ("nanogpt", "low-lr", False), ("nanogpt", "qk-ln", False),
    ("mixture", "broken", True), ("mixture", "clean", False),
)

#: truth key's signal -> the timeline's signal name
SIGNAL_OF = {"stale_share": "stale_share", "update_ratio": "update_ratio", "max_logit": "attn_max_logit",
             "logz": "logz"}


def timeline_of(family: str, arm: str, work: Path, seed: int = 0) -> tuple[dict[str, float], dict[str, Any]]:
    """Train *family*/*arm* at *seed* under *work*; its truth and its flags.json ``timeline``."""
    import gradforensics as gf
    from gradforensics.testing.twins import train

    store = Path(work) / f"{family}-{arm}-{seed}.zarr"
    truth = train(family, arm, store, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        findings = gf.analyze(store, progress=False, only=["timeline"], options={"engine": {"persist": False}})
    return truth, findings.flags_json()["timeline"]


def _where(family: str, key: str, timeline: dict[str, Any]) -> dict[str, Any] | None:
    """The timeline's departure matching truth key ``onset/<signal>/<where>``."""
    _, signal, where = key.split("/", 2)
    name = SIGNAL_OF.get(signal, signal)
    for e in timeline["departures"]:
        if e["signal"] != name:
            continue
        if name == "attn_max_logit":            # <layer>.<head> of transformer.h.<layer>.attn
            layer, head = where.split(".")
            if e["tensor"] == f"transformer.h.{layer}.attn" and e["head"] == int(head):
                return e
        elif e["tensor"] == where:
            return e
    return None


def rows(family: str, arm: str, truth: dict[str, float], timeline: dict[str, Any]) -> list[dict[str, Any]]:
    """Each measured onset (and the spike) beside the timeline's: ``signal``, ``measured``, ``timeline``
    (record or None) and ``lead`` (the timeline's lead before the first spike, steps, or None)."""
    first = timeline["spikes"][0] if timeline["spikes"] else None
    out = [{"family": family, "arm": arm, "signal": "loss spike",
            "measured": None if math.isnan(truth.get("spike", math.nan)) else int(truth["spike"]),
            "timeline": None if first is None else first["record"], "lead": None}]
    for key in sorted(k for k in truth if k.startswith("onset/")):
        e = _where(family, key, timeline)
        lead = None
        if first is not None and e is not None:
            lead = next((s["lead_steps"] for s in first["signals"] if s["signal"] == e["signal"]
                         and s["tensor"] == e["tensor"] and s["head"] == e["head"]), None)
        out.append({"family": family, "arm": arm, "signal": key[len("onset/"):],
                    "measured": None if math.isnan(truth[key]) else int(truth[key]),
                    "timeline": None if e is None else e["record"], "lead": lead})
    return out


def _cell(v: Any) -> str:
    return "—" if v is None else str(v)


def main(argv: list[str]) -> int:  # pragma: no cover - the docs' table
    import tempfile

    print("| family / arm | signal | measured onset (torch) | timeline onset | lead before the spike |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for family, arm, _ in ARMS:
            truth, tl = timeline_of(family, arm, Path(tmp))
            for r in rows(family, arm, truth, tl):
                print(f"| {family} / {arm} | {r['signal']} | {_cell(r['measured'])} | {_cell(r['timeline'])} | "
                      f"{_cell(r['lead'])} |")
            print(f"| {family} / {arm} | (all departures) | | {len(tl['departures'])}: "
                  + ", ".join(f"{e['label']} @{e['record']}" for e in tl["departures"][:6]) + " | |", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
