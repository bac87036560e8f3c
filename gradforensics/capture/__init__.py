"""Capture: write per-batch gradients, activation statistics and weights to a store."""

from gradforensics.capture.heads import HeadSpec
from gradforensics.capture.recorder import Recorder
from gradforensics.capture.replay import replay  # torch is imported only when replay() runs
from gradforensics.capture.sketch import Sketcher

__all__ = ["HeadSpec", "Recorder", "Sketcher", "replay"]
