"""The side channel: how one instance learns another's NIXL handshake bytes, out of band.

How it works:
- The scheduler process of every instance runs one small TCP server (a daemon thread) on
  `host:port`. It serves read-only payloads by key: `"rank/<tp rank>"` is that worker's
  `Transport.local_info()` bytes, `"identity"` is a JSON description of the instance (name,
  engine id, KV layout). Payloads are set once, when the workers' handshake metadata reaches the
  scheduler, and may be replaced (a restarted worker).
- A client (a worker's transfer thread, a test, the router) opens a connection, sends one
  request frame with the key and reads one reply frame. Frames are a 4-byte big-endian length
  then the bytes; the reply's first byte says found (1) or not (0).
- Keys the server holds no payload for but whose owner answers (`on_request`: a lease
  `renew/<handle>` or `release/<handle>`) are handed to the owner, on the connection's thread;
  the reply is whatever it returns.
- The same server also takes what this instance's own workers observed (`FactSender`): a
  connection that opens with the key `"post"` sends frames until it closes, each handed to the
  server's `on_post` callback. Only clients on this host may post (loopback, or the address the
  server is bound to): a peer can read our handshake but never feed our scheduler.

Rules:
- Never blocks an engine loop: the server has its own thread, and clients run on transfer
  threads with a time-out. Failures come back as `SideChannelError`, a peer failure that the
  caller records, never as a hang.
- Payloads are bytes the server already holds; a request cannot make it do work or I/O other
  than writing that reply, so a bad client costs one short-lived thread at most.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Mapping

from kvplane.core.errors import PeerError

logger = logging.getLogger(__name__)

MAX_FRAME = 64 << 20
_LEN = struct.Struct(">I")


class SideChannelError(PeerError):
    """The peer's side channel could not be reached, or answered nonsense."""


def _send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise SideChannelError(f"connection closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise SideChannelError(f"frame of {n} bytes is larger than {MAX_FRAME}")
    return _recv_exact(sock, n)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.request.settimeout(5.0)
        try:
            key = _recv_frame(self.request).decode("utf-8", "replace")
            if key == POST_KEY:
                self._posts()
                return
            payload = self.server.owner.get(key)
            _send_frame(self.request, b"\x00" if payload is None else b"\x01" + payload)
        except (OSError, SideChannelError) as exc:
            logger.debug("side channel: dropped a client: %s", exc)


    def _posts(self) -> None:
        owner = self.server.owner
        host = self.client_address[0]
        if owner.on_post is None or host not in ("127.0.0.1", "::1", owner.host):
            logger.warning("side channel: refused posts from %s", host)
            return
        self.request.settimeout(None)
        while True:
            try:
                frame = _recv_frame(self.request)
            except (OSError, SideChannelError):
                return
            try:
                owner.on_post(frame)
            except Exception:
                logger.exception("side channel: a posted frame could not be handled")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], owner: SideChannelServer) -> None:
        self.owner = owner
        super().__init__(address, _Handler)


class SideChannelServer:
    """Serves this instance's payloads on `host:port` from a daemon thread."""

    def __init__(self, host: str, port: int,
                 on_post: Callable[[bytes], None] | None = None,
                 on_request: Callable[[str], bytes | None] | None = None) -> None:
        self.host, self.port = host, port
        self.on_post = on_post
        self.on_request = on_request  # keys with a "/" not held as payloads (renew/, release/)
        self._payloads: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def set(self, key: str, payload: bytes) -> None:
        with self._lock:
            self._payloads[key] = bytes(payload)

    def update(self, payloads: Mapping[str, bytes]) -> None:
        with self._lock:
            self._payloads.update({k: bytes(v) for k, v in payloads.items()})

    def delete(self, key: str) -> None:
        with self._lock:
            self._payloads.pop(key, None)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            payload = self._payloads.get(key)
        if payload is None and self.on_request is not None and "/" in key \
                and not key.startswith("rank/"):
            return self.on_request(key)
        return payload

    def start(self) -> None:
        """Bind and serve; raises OSError when the port is taken (a configuration error)."""
        if self._server is not None:
            return
        self._server = _Server((self.host, self.port), self)
        self.port = self._server.server_address[1]  # port 0 picks a free one
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name=f"kvplane-sidechannel-{self.port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def fetch(host: str, port: int, key: str, timeout: float = 5.0) -> bytes:
    """One payload from a peer's side channel; `SideChannelError` if absent or unreachable."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            _send_frame(sock, key.encode())
            reply = _recv_frame(sock)
    except OSError as exc:
        raise SideChannelError(f"side channel {host}:{port} unreachable: {exc}") from exc
    if not reply or reply[0] != 1:
        raise SideChannelError(f"side channel {host}:{port} has no {key!r}")
    return reply[1:]


class FactSender:
    """A worker's one-way stream of frames to its own scheduler process (`"post"`); it
    reconnects on demand. `send` returns False when the frame could not be sent (the caller
    then uses its other path)."""

    def __init__(self, host: str, port: int, timeout: float = 2.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._sock: socket.socket | None = None

    def send(self, data: bytes) -> bool:
        for _ in range(2):
            try:
                if self._sock is None:
                    sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    _send_frame(sock, POST_KEY.encode())
                    self._sock = sock
                _send_frame(self._sock, data)
                return True
            except OSError as exc:
                logger.debug("side channel post to %s:%d failed: %s", self.host, self.port, exc)
                self.close()
        return False

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


def rank_key(rank: int) -> str:
    return f"rank/{rank}"


IDENTITY_KEY = "identity"
POST_KEY = "post"
