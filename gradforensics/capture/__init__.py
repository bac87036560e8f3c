"""Capture: the recording API that writes per-batch gradients, activation statistics and weights to a store.

* :class:`~gradforensics.capture.recorder.ArrayRecorder` - framework-agnostic, arrays in;
* :class:`~gradforensics.capture.torch.TorchRecorder` - a PyTorch model's ``.grad`` and hooks
  (torch is imported only when one is made);
* :func:`Recorder` (``gf.Recorder``) - picks one of the two;
* heads (:mod:`~gradforensics.capture.heads`, :mod:`~gradforensics.capture.autoheads`),
  sketches (:mod:`~gradforensics.capture.sketch`), activation statistics
  (:mod:`~gradforensics.capture.actstats`).

Replaying a checkpoint per data source (``gradforensics capture``) is :mod:`gradforensics.replay`;
its library call is ``gf.capture(checkpoint, data, out, ...)``
(:func:`gradforensics.replay.pipeline.capture`).  Importing this package binds
the name ``capture`` on ``gradforensics`` to the package, so the package is
callable and calling it is that function: ``gf.capture(...)`` works whichever
of the two the name holds.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
from typing import TYPE_CHECKING, Any, overload

from gradforensics.capture.recorder import ArrayRecorder
from gradforensics.capture.sketch import Sketcher
from gradforensics.capture.torch import TorchRecorder

if TYPE_CHECKING:
    from torch import nn

    from gradforensics.store.reader import Store

__all__ = ["ArrayRecorder", "Recorder", "Sketcher", "TorchRecorder"]


@overload
def Recorder(path: str | os.PathLike[str], *, model: None = None, **kwargs: Any) -> ArrayRecorder: ...
@overload
def Recorder(path: str | os.PathLike[str], *, model: nn.Module, **kwargs: Any) -> TorchRecorder: ...
def Recorder(path: str | os.PathLike[str], *, model: nn.Module | None = None, **kwargs: Any) -> ArrayRecorder:
    """Open a store for recording: ``gf.Recorder(path, model=model, ...)`` or ``gf.Recorder(path, sources=...)``.

    With ``model=`` (a ``torch.nn.Module``) this is a
    :class:`~gradforensics.capture.torch.TorchRecorder`, which reads the model's
    ``.grad`` and hooks its modules; without it an
    :class:`~gradforensics.capture.recorder.ArrayRecorder`, which records the
    arrays handed to ``record()``.  *kwargs* are those of the chosen class.
    """
    if model is None:
        return ArrayRecorder(path, **kwargs)
    return TorchRecorder(path, model=model, **kwargs)


class CapturePackage(types.ModuleType):
    """This package's type: a module that, called, is ``gf.capture`` (see the module docstring)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Store:
        from gradforensics.replay.pipeline import capture

        return capture(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        from gradforensics.replay.pipeline import capture

        return inspect.signature(capture)


sys.modules[__name__].__class__ = CapturePackage
