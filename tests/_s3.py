"""A real S3-compatible HTTP server on loopback for the remote-store tests.

:func:`moto_server` starts moto's server mode (``ThreadedMotoServer``, a werkzeug
HTTP server speaking the S3 REST protocol) on a free port and points the
standard environment at it (``AWS_ENDPOINT_URL``, fake keys), so s3fs, boto3 and
any dask worker process started afterwards talk to it like to any S3 service.
:class:`FaultyProxy` is a loopback HTTP proxy in front of it that answers a
fixed share of requests with ``503 SlowDown`` instead of forwarding them - what
a throttling object store does - and can drop chosen requests (close the
connection without an answer) or stall them (read them whole, then never answer).  :class:`BlackHoleProxy` is an endpoint that
never answers: it accepts connections and drops every request, or holds it
without a byte of reply (a stalled service).
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BUCKET = "dumps"
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on a free loopback port with bucket :data:`BUCKET`; yields its endpoint URL.

    The environment (``AWS_ENDPOINT_URL`` and keys) points at it while the context lasts.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)    # one log line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in (*ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _forget_filesystems()


def _forget_filesystems() -> None:
    """Drop cached s3fs instances (they hold connections to a server that is gone)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


_ERRORS = {503: _SLOWDOWN, 500: b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
                               b"<Message>We encountered an internal error. Please try again.</Message></Error>"}


class FirstK:
    """``fail=`` of :class:`FaultyProxy`: answer the first *k* requests that *which* accepts with *status*.

    ``k=None``: every one of them.  ``failed`` counts the refusals.
    """

    def __init__(self, k: int | None, which: Callable[[str, str], bool], status: int = 503) -> None:
        self.k, self.which, self.status, self.failed = k, which, status, 0

    def __call__(self, method: str, path: str) -> int | None:
        if not self.which(method, path) or (self.k is not None and self.failed >= self.k):
            return None
        self.failed += 1
        return self.status


class FaultyProxy:
    """Forward HTTP requests to *upstream*, answering every *every*-th one with 503 SlowDown.

    ``every=0``: no 503s.  ``fail(method, path)``, called for each request, may return a status
    (503 or 500) to answer that request with instead (its S3 error XML).  A request for which ``drop(method, path)`` is true is
    read and then its connection closed without a response (counted in ``dropped``); one for which
    ``stall(method, path)`` is true is read and then held, never answered, until the proxy exits
    (counted in ``stalled``): a service that accepted the request and hangs.
    """

    def __init__(self, upstream: str, every: int = 4, drop: Callable[[str, str], bool] | None = None,
                 fail: Callable[[str, str], int | None] | None = None,
                 stall: Callable[[str, str], bool] | None = None) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.every = every
        self.drop = drop
        self.fail = fail
        self.stall = stall
        self.seen = 0
        self.refused = 0
        self.dropped = 0
        self.stalled = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.drop is not None and proxy.drop(self.command, self.path):
                    with proxy._lock:
                        proxy.dropped += 1
                    self.close_connection = True       # no status line, no byte: the connection just closes
                    return
                if proxy.stall is not None and proxy.stall(self.command, self.path):
                    with proxy._lock:
                        proxy.stalled += 1
                    proxy._closing.wait()              # held open, unanswered, until the proxy exits
                    self.close_connection = True
                    return
                with proxy._lock:
                    proxy.seen += 1
                    status = proxy.fail(self.command, self.path) if proxy.fail is not None else None
                    if status is None and proxy.every and proxy.seen % proxy.every == 0:
                        status = 503
                    proxy.refused += status is not None
                if status is not None:
                    body = _ERRORS.get(status, _SLOWDOWN)
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(body)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                head = self.command == "HEAD"      # a HEAD answer keeps the object's length
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection") and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()


class BlackHoleProxy:
    """An endpoint on loopback that accepts TCP connections and never answers a request.

    ``mode="drop"``: each request is read and its connection closed without a byte
    of response; ``mode="stall"``: the connection is held open, unanswered, until
    the proxy exits.  ``requests`` counts the requests (or connections) seen.
    """

    def __init__(self, mode: str = "drop") -> None:
        if mode not in ("drop", "stall"):
            raise ValueError(mode)
        self.mode = mode
        self.requests = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                self.requests += 1
            if self.mode == "stall":
                self._held.append(conn)       # never read, never answered, closed at exit
                continue
            threading.Thread(target=self._drop, args=(conn,), daemon=True).start()

    def _drop(self, conn: socket.socket) -> None:
        """Read the request head (so that the client has sent it), then close without answering."""
        conn.settimeout(5)
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                got = conn.recv(65536)
                if not got:
                    break
                data += got
        except OSError:
            pass
        finally:
            conn.close()

    def __enter__(self) -> BlackHoleProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        for conn in self._held:
            conn.close()
