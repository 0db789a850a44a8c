"""A loopback TCP proxy that a test can take down and bring back: a database that goes away.

``down()`` closes the listener and every open connection, as a killed or
restarted database server does to its clients (connections in use fail, new ones
are refused); ``up()`` listens again on the same port.  One thread accepts, two
threads pump each connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``upstream`` (``(host, port)``) while it is up."""

    def __init__(self, port: int, upstream: tuple[str, int]) -> None:
        self.port, self.upstream = port, upstream
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, args=(listener,), daemon=True, name="tcp-proxy")
        self._acceptor.start()

    def down(self) -> None:
        """Refuse new connections and close the open ones, as the kernel does for a killed server."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:  # wakes both pumps of each connection, which close it
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    @contextlib.contextmanager
    def gone(self) -> Iterator[None]:
        """Down for the block, up again after it."""
        self.down()
        try:
            yield
        finally:
            self.up()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    server.close()
                    return
                self._conns.update((client, server))
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True, name="tcp-proxy-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            src.close()


@contextlib.contextmanager
def tcp_proxy(port: int, upstream: tuple[str, int]) -> Iterator[TcpProxy]:
    """A :class:`TcpProxy`, up for the block."""
    proxy = TcpProxy(port, upstream)
    proxy.up()
    try:
        yield proxy
    finally:
        proxy.down()
