"""A store with a planted order of events: what the timeline must find, and when.

:func:`planted_timeline_store` records (numpy, no model) ``n_records`` records of three tensors'
gradients, activations of one module and the loss, every series stationary noise except:

* from record ``grad_onset`` on, the gradient of ``layer.1.weight`` is ``grad_factor`` times
  larger (a step up of its norm);
* from record ``kurt_onset`` on, a share of the activations of ``mlp.act`` are outliers (the
  module's excess kurtosis rises: an outlier feature);
* at record ``spike``, the loss jumps to ``spike_loss`` (one record), then returns.

So the truth is: the gradient norm of ``layer.1.weight`` departs at ``grad_onset``, the kurtosis of
``mlp.act`` at ``kurt_onset``, the loss spikes at ``spike``; leads ``spike - grad_onset`` and
``spike - kurt_onset`` steps (one step a record).  Every other series is noise: none departs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PLANTED", "planted_timeline_store"]

#: The planted events of the default store.
PLANTED: dict[str, int] = {"n_records": 96, "kurt_onset": 40, "grad_onset": 50, "spike": 60}


def planted_timeline_store(path: Path, seed: int = 0, *, n_records: int = PLANTED["n_records"],
                           kurt_onset: int = PLANTED["kurt_onset"], grad_onset: int = PLANTED["grad_onset"],
                           spike: int = PLANTED["spike"], grad_factor: float = 4.0, spike_loss: float = 8.0,
                           fmt: str = "zarr") -> Path:
    """Record the planted events at *path* (module docstring); returns *path*."""
    import gradforensics as gf

    rng = np.random.default_rng([seed, 44])
    path = Path(path)
    kw: dict[str, Any] = {"sources": ["text"], "mode": "training", "overwrite": True, "background": False}
    with gf.Recorder(path, **kw) as rec:
        for i in range(n_records):
            grads = {f"layer.{j}.weight": rng.standard_normal((16, 8)).astype(np.float32) for j in range(3)}
            if i >= grad_onset:
                grads["layer.1.weight"] *= np.float32(grad_factor)
            act = rng.standard_normal((64, 12)).astype(np.float32)
            if i >= kurt_onset:
                act[:, 0] *= np.float32(12.0)                    # one outlier feature: kurtosis rises
            loss = 2.0 + 0.05 * float(rng.standard_normal())
            if i == spike:
                loss = spike_loss
            rec.record(step=i, loss=loss, source="text", n_samples=64, lr=1e-3, grads=grads,
                       activations={"mlp.act": act})
    return path
