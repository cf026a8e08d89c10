"""A TCP proxy on 127.0.0.1 that can blackhole its traffic: a host cut off from the database, then healed.

`blackhole()` stops forwarding bytes in both directions and keeps every socket open (no RST, no FIN): the
client's statements hang as they would behind a dead switch, the server sees an idle connection. New
connections are accepted but not forwarded either. `heal()` forwards what was held, in order, and everything
after it, as TCP does when a partition heals. Nothing is dropped, so the protocol stays in sync.

Threads, not asyncio: two pumps per connection, each waiting on one `flowing` event before it reads.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

CHUNK = 65536
POLL = 0.1  # seconds a pump waits before looking at the stop flag again


class BlackholeProxy:
    """Forwards 127.0.0.1:<port> to `upstream`; blackhole() holds every byte, heal() lets them through."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = int(self.listener.getsockname()[1])
        self.flowing = threading.Event()
        self.flowing.set()
        self.stopped = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.connections = 0

    def start(self) -> BlackholeProxy:
        """Start accepting connections (a daemon thread)."""
        self._spawn(self._accept_loop)
        return self

    def blackhole(self) -> None:
        """Stop forwarding bytes; every socket stays open."""
        self.flowing.clear()

    def heal(self) -> None:
        """Forward again, starting with what was held."""
        self.flowing.set()

    def close(self) -> None:
        """Stop the proxy: close the listener and every connection, join the threads (bounded)."""
        self.stopped.set()
        self.flowing.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _close(sock)
        for thread in self._threads:
            thread.join(5)

    # -- internals ---------------------------------------------------------------------------------

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="chaos-proxy")  # type: ignore[arg-type]
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _wait_flowing(self) -> bool:
        while not self.flowing.wait(POLL):
            if self.stopped.is_set():
                return False
        return not self.stopped.is_set()

    def _accept_loop(self) -> None:
        while not self.stopped.is_set():
            try:
                ready, _, _ = select.select([self.listener], [], [], POLL)
                if not ready:
                    continue
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self._spawn(self._connect, client)

    def _connect(self, client: socket.socket) -> None:
        self._track(client)
        # A connection opened during the blackhole hangs too: it reaches the server only after the heal.
        if not self._wait_flowing():
            _close(client)
            return
        try:
            server = socket.create_connection(self.upstream, timeout=10)
            server.settimeout(None)
        except OSError:
            self._untrack(client)
            return
        self._track(server)
        self._spawn(self._pump, client, server)
        self._spawn(self._pump, server, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while self._wait_flowing():
                ready, _, _ = select.select([src], [], [], POLL)
                if not ready:
                    continue
                data = src.recv(CHUNK)
                if not data:
                    break
                # Read before a blackhole began: held here until the heal, never dropped.
                if not self._wait_flowing():
                    break
                dst.sendall(data)
        except (OSError, ValueError):  # ValueError: the other pump closed this socket under select()
            pass
        # One side closed (a server restart, a client exit): close the other, as a real path would carry it.
        self._untrack(src)
        self._untrack(dst)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        _close(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
