"""SIGTERM turned into an exception while a multi-rank recorder is open (:mod:`gradforensics.store.ranks`)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from gradforensics.errors import Terminated

__all__ = ["TermGuard"]


class TermGuard:
    """SIGTERM as :class:`~gradforensics.errors.Terminated` in the main thread while a multi-rank recorder is open.

    torchrun answers a dead rank by sending SIGTERM to the others; by default they
    die where they stand, and rank 0 never commits the records they wrote.  The
    handler raises once, so the ``with`` block unwinds and the recorder closes;
    *on_signal* runs first (rank 0 bounds its wait for the other ranks).  A SIGTERM
    that arrives while the recorder closes is held (:attr:`pending`) and raised
    by the recorder once the store is committed.  Installed only from the main
    thread over the default action (a program's own SIGTERM handler is left alone);
    :meth:`restore` puts the default back.
    """

    def __init__(self, on_signal: Callable[[], None] = lambda: None) -> None:
        self.on_signal = on_signal
        self.received = False
        self.raised = False
        #: set by the recorder when it starts to close: from then on a SIGTERM is held, not raised
        self.closing = False
        self.installed = (threading.current_thread() is threading.main_thread()
                          and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        if self.installed:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True
        self.on_signal()
        if not (self.closing or self.raised):
            self.raised = True
            raise Terminated("SIGTERM")

    @property
    def pending(self) -> bool:
        """A SIGTERM arrived and was not raised (it came while the recorder closed)."""
        return self.received and not self.raised

    def restore(self) -> None:
        if self.installed and signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.installed = False
