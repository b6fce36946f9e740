"""One bounded HTTP GET: a total deadline (connect, TLS, request, every read together) and a size cap.

A policy names the Prometheus the operator queries, so its answers are untrusted input: a server that drips one
byte at a time must not hold a query longer than ``deadline_s`` (a per-read timeout would let it do so forever),
and one that answers 200 MB must not grow the operator past its memory limit. requests/urllib3 bound neither
(their timeout is per socket operation, and header parsing happens before any caller code runs), so this speaks
HTTP/1.1 itself over a socket whose timeout is reset to the time left before every operation; CPython applies a
socket timeout as a deadline for the whole call, TLS reads included. Errors carry only local words (the status
line, sanitised), never the body: the answer of an arbitrary URL must not be reflected into status or Events.
"""
from __future__ import annotations

import re
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Mapping, Optional
from urllib.parse import urlencode, urlsplit

MAX_HEADER_BYTES = 64 * 1024
_PRINTABLE = re.compile(r"[^A-Za-z0-9 ._/()-]")


class HTTPFailure(Exception):
    """A request that produced no usable answer. ``kind``: timeout, connect, tls, too_large or protocol."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Response:
    status: int
    reason: str  # sanitised, at most 40 characters
    body: bytes

    @property
    def status_line(self) -> str:
        return f"HTTP {self.status}"  # never the reason phrase: it is the server's text, not to be reflected


def sanitise(text: str, limit: int = 40) -> str:
    """Only letters, digits and a little punctuation, at most ``limit`` characters: safe in a condition."""
    return _PRINTABLE.sub("", text)[:limit].strip()


class _Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise HTTPFailure("timeout", f"timed out after {self.seconds:g}s")
        return left


def _recv(sock: socket.socket, deadline: _Deadline) -> bytes:
    sock.settimeout(deadline.left())
    try:
        return sock.recv(65536)
    except (socket.timeout, TimeoutError):
        raise HTTPFailure("timeout", f"timed out after {deadline.seconds:g}s") from None


def _dechunk(data: bytes | bytearray, max_bytes: int) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            raise HTTPFailure("protocol", "truncated chunked body")
        size_text = data[pos:end].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HTTPFailure("protocol", "bad chunk size") from None
        if size == 0:
            return bytes(out)
        start = end + 2
        if start + size > len(data):
            raise HTTPFailure("protocol", "truncated chunked body")
        out += data[start:start + size]
        if len(out) > max_bytes:
            raise HTTPFailure("too_large", f"answer larger than {max_bytes} bytes")
        pos = start + size + 2


def get(url: str, *, params: Optional[Mapping[str, str]] = None, headers: Optional[Mapping[str, str]] = None,
        deadline_s: float, max_bytes: int, ca_file: Optional[str] = None, insecure: bool = False) -> Response:
    """GET ``url`` (+ ``params``); the whole exchange ends within ``deadline_s`` and reads at most ``max_bytes``
    of body. Raises :class:`HTTPFailure`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HTTPFailure("protocol", "not an http(s) URL with a host")
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + ("?" + urlencode(params) if params else "")
    deadline = _Deadline(deadline_s)
    try:
        sock = socket.create_connection((host, port), timeout=deadline.left())
    except (socket.timeout, TimeoutError):
        raise HTTPFailure("timeout", f"timed out after {deadline_s:g}s") from None
    except OSError as err:
        raise HTTPFailure("connect", sanitise((err.strerror or type(err).__name__).lower(), 60)) from None
    try:
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=ca_file)
            if insecure:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            sock.settimeout(deadline.left())
            try:
                sock = context.wrap_socket(sock, server_hostname=host)
            except (socket.timeout, TimeoutError):
                raise HTTPFailure("timeout", f"timed out after {deadline_s:g}s") from None
            except ssl.SSLError as err:
                raise HTTPFailure("tls", sanitise(err.reason or type(err).__name__, 60)) from None
        host_header = f"[{host}]" if ":" in host else host
        if parts.port:
            host_header += f":{parts.port}"
        lines = [f"GET {target} HTTP/1.1", f"Host: {host_header}", "Accept: application/json",
                 "Accept-Encoding: identity", "Connection: close", "User-Agent: kvtier-operator"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        sock.settimeout(deadline.left())
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        return _read_response(sock, deadline, max_bytes)
    except (socket.timeout, TimeoutError):
        raise HTTPFailure("timeout", f"timed out after {deadline_s:g}s") from None
    except ssl.SSLError as err:
        raise HTTPFailure("tls", sanitise(err.reason or type(err).__name__, 60)) from None
    except OSError as err:
        raise HTTPFailure("connect", sanitise((err.strerror or type(err).__name__).lower(), 60)) from None
    finally:
        sock.close()


def _read_response(sock: socket.socket, deadline: _Deadline, max_bytes: int) -> Response:
    buf = bytearray()
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_HEADER_BYTES:
            raise HTTPFailure("too_large", f"headers larger than {MAX_HEADER_BYTES} bytes")
        chunk = _recv(sock, deadline)
        if not chunk:
            raise HTTPFailure("protocol", "connection closed before the headers ended")
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    match = re.match(r"^HTTP/1\.[01] ([0-9]{3})(?: (.*))?$", status_line)
    if not match:
        raise HTTPFailure("protocol", "not an HTTP/1.x answer")
    status, reason = int(match.group(1)), sanitise(match.group(2) or "")
    fields: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    chunked = "chunked" in fields.get("transfer-encoding", "").lower()
    length: Optional[int] = None
    if not chunked and fields.get("content-length", "").isdigit():
        length = int(fields["content-length"])
        if length > max_bytes:
            raise HTTPFailure("too_large", f"answer larger than {max_bytes} bytes")
    # Chunk framing adds a few bytes per chunk; the cap on the raw stream leaves room for it.
    raw_cap = max_bytes + max_bytes // 8 + 1024 if chunked else max_bytes
    body = bytearray(rest)
    while length is None or len(body) < length:
        if len(body) > raw_cap:
            raise HTTPFailure("too_large", f"answer larger than {max_bytes} bytes")
        if chunked and body.endswith(b"0\r\n\r\n") and _complete(body):
            break
        chunk = _recv(sock, deadline)
        if not chunk:
            break
        body += chunk
    if len(body) > raw_cap:
        raise HTTPFailure("too_large", f"answer larger than {max_bytes} bytes")
    data = _dechunk(bytes(body), max_bytes) if chunked else bytes(body[:length] if length is not None else body)
    if length is not None and len(data) < length:
        raise HTTPFailure("protocol", "connection closed before the body ended")
    return Response(status, reason, data)


def _complete(body: bytes | bytearray) -> bool:
    try:
        _dechunk(body, len(body))
    except HTTPFailure:
        return False
    return True
