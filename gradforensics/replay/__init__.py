"""Replay: per-source gradients of a fixed (problem) checkpoint, behind ``gradforensics capture``.

Built on the recording API (:mod:`gradforensics.recording`), never the other way:

* :mod:`~gradforensics.replay.run` - :func:`replay`: batches from every source
  through the model as it is (no optimizer step), one record per batch;
* :mod:`~gradforensics.replay.pipeline` - :func:`~gradforensics.replay.pipeline.capture`
  (``gf.capture``): a checkpoint and data files to a store, what ``gradforensics capture`` runs;
* :mod:`~gradforensics.replay.plan` - the capture's options (:class:`BatchSpec`,
  :class:`RecordSpec`, :class:`ModelSpec`), checked once, and its size estimate;
* :mod:`~gradforensics.replay.checkpoint` - load a Hugging Face directory or a
  state-dict file, strictly offline;
* :mod:`~gradforensics.replay.data` - text files to packed, seeded batches;
* :mod:`~gradforensics.replay.losses` - the objectives (causal LM, masked LM, contrastive);
* :mod:`~gradforensics.replay.threads` - torch's intra-op threads for the verbs that run a model.

Importing the package is cheap (the command line reads :mod:`~gradforensics.replay.plan`'s
constants to build its parsers): :func:`replay` loads on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BatchSpec", "ModelSpec", "RecordSpec", "replay"]


def __getattr__(name: str) -> Any:
    if name == "replay":
        from gradforensics.replay.run import replay

        return replay
    if name in ("BatchSpec", "ModelSpec", "RecordSpec"):
        from gradforensics.replay import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'gradforensics.replay' has no attribute {name!r}")
