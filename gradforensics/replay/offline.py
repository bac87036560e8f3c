"""Strictly offline: while a checkpoint loads, a connection to anything but the local machine raises.

:func:`offline` sets ``HF_HUB_OFFLINE=1`` (and its kin) and guards ``socket``, so a load that
would need the network fails with one clear :class:`~gradforensics.errors.OfflineError` line
instead of a timeout or a download.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gradforensics.errors import OfflineError

__all__ = ["caused_by_offline", "offline"]

_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "", None})


@contextmanager
def offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1`` and no non-local connections, for the block."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    old_env = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    real_connect, real_gai = socket.socket.connect, socket.getaddrinfo

    def connect(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOCAL_HOSTS:
            raise OfflineError(_offline_message(address[0]))
        return real_connect(sock, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in _LOCAL_HOSTS:
            raise OfflineError(_offline_message(host))
        return real_gai(host, *args, **kwargs)

    socket.socket.connect = connect  # type: ignore[method-assign,assignment]
    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]
    try:
        yield
    finally:
        socket.socket.connect = real_connect  # type: ignore[method-assign]
        socket.getaddrinfo = real_gai  # type: ignore[assignment]
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _offline_message(host: Any) -> str:
    return (f"loading the checkpoint tried to reach {host!r}; gradforensics capture works offline only: "
            "put every file (config, weights, tokenizer) in the checkpoint directory.")


def caused_by_offline(exc: BaseException) -> OfflineError | None:
    """The :class:`OfflineError` among *exc*'s causes and contexts, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OfflineError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
