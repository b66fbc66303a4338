"""A TCP proxy on 127.0.0.1 in front of the test S3 server: counts what clients download and
turns chosen requests into transient failures (a 503 SlowDown answer, or a reset connection),
answers them as a server that ignores the Range header would (200 and the whole object), cuts
the connection in the middle of an answer's body, or freezes the server from a chosen request
on (nothing is answered any more)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

# kind -> (status line, S3 error code, message) of the answer that replaces the real one
_ANSWERS = {
    "slowdown": ("503 Slow Down", "SlowDown", "Please reduce your request rate."),
    "internal": ("500 Internal Server Error", "InternalError", "We encountered an internal error."),
    "notimplemented": ("501 Not Implemented", "NotImplemented", "A header is not implemented."),
}


@dataclass
class Fault:
    """Fail the next ``times`` requests whose method is ``method`` and whose target contains
    ``contains``: ``"slowdown"`` answers 503 SlowDown, ``"internal"`` 500 InternalError,
    ``"reset"`` resets the connection, ``"whole"`` answers 200 OK with ``body`` (the whole
    object, as a server that ignores Range sends it), ``"cut"`` answers a ranged GET with the
    headers of the whole range and half its body, then closes the connection (as a connection
    killed mid-transfer), ``"freeze"`` stalls it and every later request and
    answer (a frozen server: connections stay open, nothing comes back)."""

    method: str
    contains: str
    kind: str
    times: int = 1
    hits: int = 0
    body: bytes = b""

    def matches(self, method: str, target: str) -> bool:
        return self.hits < self.times and method == self.method and self.contains in target


class FaultProxy:
    """Forwards HTTP/1.1 connections to ``upstream_url`` one request at a time."""

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.requests: list[str] = []
        self.bytes_to_clients = 0
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = False
        self._done = threading.Event()
        self.frozen = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="s3-proxy").start()

    def inject(
        self, method: str, contains: str, kind: str, times: int = 1, body: bytes = b""
    ) -> Fault:
        if kind not in (*_ANSWERS, "reset", "whole", "cut", "freeze"):
            raise ValueError(kind)
        fault = Fault(method, contains, kind, times, body=body)
        with self._lock:
            self._faults.append(fault)
        return fault

    def reset_counters(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_to_clients = 0

    def close(self) -> None:
        self._closed = True
        self._done.set()
        self._listener.close()
        with self._lock:
            for s in list(self._sockets):
                with contextlib.suppress(OSError):
                    s.close()

    # -- plumbing -------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _track(self, *socks: socket.socket) -> None:
        with self._lock:
            self._sockets.update(socks)

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self._upstream)
        except OSError:
            client.close()
            return
        self._track(client, upstream)
        threading.Thread(target=self._pump_down, args=(upstream, client), daemon=True).start()
        reader = _Reader(client)
        try:
            while (head := reader.head()) is not None:
                method, target, headers = _parse_head(head)
                with self._lock:
                    self.requests.append(f"{method} {target}")
                    fault = next((f for f in self._faults if f.matches(method, target)), None)
                    if fault is not None:
                        fault.hits += 1
                if fault is not None and fault.kind == "freeze":
                    self.frozen.set()
                if self.frozen.is_set():
                    self._done.wait()  # read, never answered, until the proxy closes
                    return
                if fault is not None:
                    self._fail(fault, reader, client, headers)
                    return
                upstream.sendall(head)
                _forward_body(reader, upstream, headers)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.close()

    def _fail(
        self, fault: Fault, reader: _Reader, client: socket.socket, headers: dict[str, str]
    ) -> None:
        if fault.kind == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return
        if headers.get("expect", "").lower() != "100-continue":
            _forward_body(reader, None, headers)
        if fault.kind == "cut":
            first, _, last = headers.get("range", "bytes=0-0").removeprefix("bytes=").partition("-")
            n = int(last) - int(first) + 1
            head = (
                f"HTTP/1.1 206 Partial Content\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Range: bytes {first}-{last}/*\r\nContent-Length: {n}\r\n\r\n"
            )
            client.sendall(head.encode() + bytes(n // 2))
            return
        if fault.kind == "whole":
            head = (
                f"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                f"Content-Length: {len(fault.body)}\r\nConnection: close\r\n\r\n"
            )
            client.sendall(head.encode() + fault.body)
            return
        status, code, message = _ANSWERS[fault.kind]
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>"
        ).encode()
        head = (
            f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        client.sendall(head.encode() + body)

    def _pump_down(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(1 << 20):
                if self.frozen.is_set():
                    self._done.wait()
                    return
                with self._lock:  # counted before the client can have seen it
                    self.bytes_to_clients += len(data)
                client.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)


class _Reader:
    """Buffered reads from a socket: request heads and exact byte counts."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def _more(self) -> bool:
        data = self._sock.recv(1 << 20)
        self._buf += data
        return bool(data)

    def head(self) -> bytes | None:
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            if not self._more():
                return None
        out = bytes(self._buf[: end + 4])
        del self._buf[: end + 4]
        return out

    def line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            if not self._more():
                raise OSError("client closed mid-request")
        out = bytes(self._buf[: end + 2])
        del self._buf[: end + 2]
        return out

    def exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._more():
                raise OSError("client closed mid-request")
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return method, target, headers


def _forward_body(reader: _Reader, to: socket.socket | None, headers: dict[str, str]) -> None:
    """Copy one request body (Content-Length or chunked) to ``to`` (or drop it)."""

    def send(data: bytes) -> None:
        if to is not None:
            to.sendall(data)

    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = reader.line()
            send(size_line)
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                while (trailer := reader.line()) != b"\r\n":
                    send(trailer)
                send(b"\r\n")
                return
            send(reader.exactly(size + 2))
    remaining = int(headers.get("content-length", "0"))
    while remaining:
        chunk = reader.exactly(min(remaining, 1 << 20))
        send(chunk)
        remaining -= len(chunk)
