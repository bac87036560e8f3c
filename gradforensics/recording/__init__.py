"""Capture: the recording API that writes per-batch gradients, activation statistics and weights to a store.

* :class:`~gradforensics.recording.recorder.ArrayRecorder` - framework-agnostic, arrays in;
* :class:`~gradforensics.recording.torch.TorchRecorder` - a PyTorch model's ``.grad`` and hooks
  (torch is imported only when one is made);
* :func:`Recorder` (``gf.Recorder``) - picks one of the two;
* heads (:mod:`~gradforensics.recording.heads`, :mod:`~gradforensics.recording.autoheads`),
  sketches (:mod:`~gradforensics.recording.sketch`), activation statistics
  (:mod:`~gradforensics.recording.actstats`).

Replaying a checkpoint per data source (``gradforensics capture``) is :mod:`gradforensics.replay`;
its library call is ``gf.capture(checkpoint, data, out, ...)``
(:func:`gradforensics.replay.pipeline.capture`).  No package is named like a
public function (this one is ``recording``, not ``capture``), so importing a
package never rebinds a name of ``gradforensics``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, overload

from gradforensics.recording.recorder import ArrayRecorder
from gradforensics.recording.sketch import Sketcher
from gradforensics.recording.torch import TorchRecorder

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ArrayRecorder", "Recorder", "Sketcher", "TorchRecorder"]


@overload
def Recorder(path: str | os.PathLike[str], *, model: None = None, **kwargs: Any) -> ArrayRecorder: ...
@overload
def Recorder(path: str | os.PathLike[str], *, model: nn.Module, **kwargs: Any) -> TorchRecorder: ...
def Recorder(path: str | os.PathLike[str], *, model: nn.Module | None = None, **kwargs: Any) -> ArrayRecorder:
    """Open a store for recording: ``gf.Recorder(path, model=model, ...)`` or ``gf.Recorder(path, sources=...)``.

    With ``model=`` (a ``torch.nn.Module``) this is a
    :class:`~gradforensics.recording.torch.TorchRecorder`, which reads the model's
    ``.grad`` and hooks its modules; without it an
    :class:`~gradforensics.recording.recorder.ArrayRecorder`, which records the
    arrays handed to ``record()``.  *kwargs* are those of the chosen class.
    """
    if model is None:
        return ArrayRecorder(path, **kwargs)
    return TorchRecorder(path, model=model, **kwargs)
