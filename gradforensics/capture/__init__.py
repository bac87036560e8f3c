"""Capture: write per-batch gradients, activation statistics and weights to a store."""

from gradforensics.capture.heads import HeadSpec
from gradforensics.capture.recorder import Recorder
from gradforensics.capture.sketch import Sketcher

__all__ = ["HeadSpec", "Recorder", "Sketcher", "replay"]


def __getattr__(name: str):  # replay needs torch; import it only when asked
    if name == "replay":
        from gradforensics.capture.replay import replay

        return replay
    raise AttributeError(name)
