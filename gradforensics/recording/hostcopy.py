"""Gradients from their device to the host: NumPy views of CPU tensors, asynchronous copies from CUDA.

On CUDA the gradients are copied into pinned host buffers with
``non_blocking=True`` on the current stream and a CUDA event is recorded after
the copies; ``record()`` returns without waiting, and the writer thread waits
on that event (``event.synchronize()``, never ``torch.cuda.synchronize()``)
before it reads the buffers (the record's ``settle``,
:class:`~gradforensics.recording.encoding.PendingRecord`).  :data:`N_BUFFER_SETS`
buffer sets are reused in turn (:class:`HostCopies`), so a third ``record()``
waits only if the writer has not yet taken the first one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["N_BUFFER_SETS", "HostCopies", "copy_async", "device_copies_done", "host_buffer", "is_device", "to_numpy"]


N_BUFFER_SETS = 2


class HostCopies:
    """Host copies of gradients, the device ones through a pool of reused buffer sets.

    *check* raises the writer's error, if any; *idle* says whether the writer has
    taken every record (then a buffer set dropped with a failed record is replaced).
    """

    def __init__(self, check: Callable[[], None], idle: Callable[[], bool]) -> None:
        self.pool: queue.Queue[dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._check, self._idle = check, idle

    def start(self, grads: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], list[Any],
                                                             Callable[[], None] | None, tuple[str, ...]]:
        """``(arrays, events, release, on_device)``: fresh arrays (CPU), or pinned buffers being filled (CUDA)."""
        on_device = {n: g for n, g in grads.items() if is_device(g)}
        out = {n: to_numpy(g.clone()) for n, g in grads.items() if n not in on_device}
        if not on_device:
            return out, [], None, ()
        bufs = self._acquire(on_device)
        events = copy_async(on_device, bufs)
        out.update({n: to_numpy(bufs[n]) for n in on_device})
        pool = self.pool
        assert pool is not None
        return {n: out[n] for n in grads}, events, lambda: pool.put(bufs), tuple(on_device)

    def _acquire(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        def new_set() -> dict[str, torch.Tensor]:
            return {n: host_buffer(g.shape, g.dtype) for n, g in like.items()}

        with self._lock:
            if self.pool is None:
                self.pool = queue.Queue()
                for _ in range(N_BUFFER_SETS):
                    self.pool.put(new_set())
        while True:   # backpressure: wait for the writer to hand a buffer set back
            try:
                return self.pool.get(timeout=0.1)
            except queue.Empty:
                self._check()
                if self._idle():
                    return new_set()   # the writer is idle: a set was dropped with a failed record


def _bf16_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU bfloat16 tensor as a NumPy array (ml_dtypes' bfloat16, else an exact float32 upcast)."""
    import torch

    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes ships with the torch extra
        return t.to(torch.float32).numpy()
    return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as NumPy, sharing memory where the dtype allows (bfloat16 too)."""
    import torch

    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    return _bf16_numpy(t) if t.dtype == torch.bfloat16 else t.numpy()


def device_copies_done(grads: dict[str, np.ndarray], events: list[Any], release: Callable[[], None] | None,
                        on_device: tuple[str, ...]) -> Callable[[], None]:
    """The ``settle`` of a record whose gradients are being copied into reused host buffers.

    On the writer thread: wait for this record's copies only, copy the buffers
    out (in place in *grads*), then hand the buffer set back with *release*.
    """
    def settle() -> None:
        try:
            for event in events:
                event.synchronize()       # this record's copies only, never torch.cuda.synchronize()
            for n in on_device:
                grads[n] = np.array(grads[n], copy=True)
        finally:
            if release is not None:
                release()

    return settle


def copy_async(grads: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor]) -> list[Any]:
    """Queue device-to-host copies on each device's current stream; one event per device."""
    import torch

    events = []
    for dev in {g.device for g in grads.values()}:
        stream = torch.cuda.current_stream(dev)
        with torch.cuda.stream(stream):
            for n, g in grads.items():
                if g.device == dev:
                    bufs[n].copy_(g.to_dense() if g.is_sparse else g, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        events.append(event)
    return events


def is_device(t: torch.Tensor) -> bool:
    """Whether *t* lives on an accelerator and is copied asynchronously."""
    return bool(t.is_cuda)


def host_buffer(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer for device-to-host copies: pinned where CUDA is present."""
    import torch

    return torch.empty(tuple(shape), dtype=dtype, pin_memory=torch.cuda.is_available())
