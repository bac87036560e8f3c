"""Replay: per-source gradients of a fixed (problem) checkpoint, behind ``gradforensics capture``.

Built on the recording API (:mod:`gradforensics.capture`), never the other way:

* :mod:`~gradforensics.replay.run` - :func:`replay`: batches from every source
  through the model as it is (no optimizer step), one record per batch;
* :mod:`~gradforensics.replay.checkpoint` - load a Hugging Face directory or a
  state-dict file, strictly offline;
* :mod:`~gradforensics.replay.data` - text files to packed, seeded batches;
* :mod:`~gradforensics.replay.losses` - the objectives (causal LM, masked LM, contrastive).
"""

from gradforensics.replay.run import replay  # torch is imported only when replay() runs

__all__ = ["replay"]
