"""Loads and stores of a standalone store over connections of the tier's own: RESP2 on a socket this module opens,
so a GET reply (a value) lands in the caller's buffer with one copy, the kernel's, and a SET is sent the moment its
value is sealed, from a buffer the tier refills for the next value (the store takes in one value while the tier
seals the next; redis-py's pipeline sends nothing before every value of the batch is packed, so each value needed a
buffer of its own and the store idled while the batch was sealed).

redis-py's reply parser copies every value twice more (into its reader, then into a bytes object: ~0.15 s of
client CPU per GB) before the cipher can read it, and its connections do not hand out their socket, so the tier's
loads do not go through them. A connection here is opened like redis-py's (the same address, database, ACL user
and password, TLS verified against the same CAs, every socket operation bounded by ``io_timeout_s``), speaks RESP2
(replies are only the simple kinds :class:`ReplyReader` reads, and no push frame arrives between them), and is
pooled while it stays in step: one that failed part way is closed, never reused half read. An error reply becomes
the redis-py exception its own parser would make of it (:func:`error_reply`), so a fault reads the same
(:func:`kvtier_runtime.remote.client.failure_kind`) whichever connection met it.
"""
from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    InvalidResponse,
    MasterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)

__all__ = ["Address", "Reply", "ReplyReader", "ValueConnections", "error_reply", "pack_commands"]

# A reply: a bulk string (a view of the caller's buffer), None for a nil, an int, a str for a status, or the
# exception of an error reply (returned, not raised).
Reply = memoryview | int | str | RedisError | None
# A command's arguments: strings are sent as UTF-8.
Arg = bytes | bytearray | memoryview | str | int

# The longest reply header line accepted ("$" and a length, "-" and an error, ":" and an integer).
MAX_LINE = 4096
# Error replies by their first word, typed as redis-py's reply parser types them: those whose type tells a fault's
# kind apart (a full store, refused credentials, a store not serving); any other is a ResponseError.
_ERROR_CODES: dict[str, Callable[[str], RedisError]] = {
    "OOM": OutOfMemoryError,
    "WRONGPASS": AuthenticationError,
    "NOAUTH": AuthenticationError,
    "NOPERM": NoPermissionError,
    "LOADING": BusyLoadingError,
    "READONLY": ReadOnlyError,
    "MASTERDOWN": MasterDownError,
    "CLUSTERDOWN": ClusterDownError,
}
_ERR_MESSAGES: dict[str, Callable[[str], RedisError]] = {
    "max number of clients reached": RedisConnectionError,
    "invalid password": AuthenticationError,
}


def error_reply(text: str) -> RedisError:
    """The exception an error reply's ``text`` stands for (its code dropped from the message, as redis-py does)."""
    code, _, rest = text.partition(" ")
    if code == "ERR" and rest in _ERR_MESSAGES:
        return _ERR_MESSAGES[rest](rest)
    make = _ERROR_CODES.get(code)
    return make(rest) if make is not None else ResponseError(text)


def _arg(value: Arg) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, int):
        return str(value).encode()
    return bytes(value)


def pack_commands(commands: Sequence[Sequence[Arg]]) -> bytes:
    """``commands`` as one RESP request (arrays of bulk strings); keys and scores only, so one bytes object."""
    out = bytearray()
    for command in commands:
        out += b"*%d\r\n" % len(command)
        for value in command:
            raw = _arg(value)
            out += b"$%d\r\n%s\r\n" % (len(raw), raw)
    return bytes(out)


class ReplyReader:
    """RESP2 replies of one connection read straight off its socket: a bulk reply lands in a caller's buffer with
    one copy (the kernel's). Reply header lines are read in small pieces, so at most a few hundred bytes of a value
    pass through the line buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = bytearray()
        self._scratch = bytearray(512)

    @property
    def leftover(self) -> int:
        return len(self._pending)

    def _recv_into(self, dst: memoryview) -> int:
        try:
            got = int(self._sock.recv_into(dst))
        except TimeoutError:  # socket.timeout: a slow store is a timeout, not a down one (failure_kind)
            raise RedisTimeoutError("Timeout reading from the store") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error reading from the store: {exc}") from None
        if got <= 0:
            raise RedisConnectionError("the store closed the connection")
        return got

    def _line(self) -> bytes:
        while True:
            at = self._pending.find(b"\r\n")
            if at >= 0:
                line = bytes(self._pending[:at])
                del self._pending[: at + 2]
                return line
            if len(self._pending) > MAX_LINE:
                raise InvalidResponse("a reply header line longer than expected")
            got = self._recv_into(memoryview(self._scratch))
            self._pending += memoryview(self._scratch)[:got]

    def _exactly(self, dst: memoryview) -> None:
        take = min(len(dst), len(self._pending))
        dst[:take] = self._pending[:take]
        del self._pending[:take]
        while take < len(dst):
            take += self._recv_into(dst[take:])

    def reply(self, buf: bytearray | None) -> Reply:
        """The next reply: a bulk string as a view of ``buf`` (or of a new buffer when it does not fit), None for a
        nil, an int, a str for a status, the redis-py exception of an error reply (returned, not raised)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"_":  # RESP3's nil, should a connection speak it after all
            return None
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            if buf is None or len(buf) < n:
                buf = bytearray(n)  # larger than any value the tier writes: read, then refused by what it holds
            value = memoryview(buf)[:n]
            self._exactly(value)
            end = bytearray(2)
            self._exactly(memoryview(end))
            if end != b"\r\n":
                raise InvalidResponse("a bulk reply without its CRLF")
            return value
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest.decode("utf-8", "replace")
        if kind == b"-":
            return error_reply(rest.decode("utf-8", "replace"))
        raise InvalidResponse(f"an unexpected reply type {kind!r}")


@dataclass(frozen=True)
class Address:
    """Where and as whom a connection logs in: what redis-py's connections to the same store are given."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    timeout_s: float
    tls: bool
    ca_file: str | None

    def tls_context(self) -> ssl.SSLContext:
        """The store's certificate and host name are always checked: against the system CA bundle and ``ca_file``
        when set, as redis-py checks them; made for each connection, so a CA rotated in its Secret is used from
        the next connection on."""
        context = ssl.create_default_context()
        context.check_hostname = True
        context.verify_mode = ssl.CERT_REQUIRED
        if self.ca_file is not None:
            context.load_verify_locations(cafile=self.ca_file)
        return context


def _connect(address: Address) -> socket.socket:
    """A socket to the store, TLS wrapped when asked; a failure is a redis-py error (TLS's kept as its cause)."""
    try:
        sock = socket.create_connection((address.host, address.port), timeout=address.timeout_s)
    except TimeoutError:
        raise RedisTimeoutError("Timeout connecting to the store") from None
    except OSError as exc:
        raise RedisConnectionError(f"Error connecting to {address.host}:{address.port}: {exc}") from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if address.tls:
            sock = address.tls_context().wrap_socket(sock, server_hostname=address.host)
    except TimeoutError:
        sock.close()
        raise RedisTimeoutError("Timeout connecting to the store") from None
    except OSError as exc:  # ssl.SSLError included
        sock.close()
        raise RedisConnectionError(f"Error connecting to {address.host}:{address.port}: {exc}") from exc
    return sock


class _Connection:
    def __init__(self, address: Address) -> None:
        self.sock = _connect(address)
        self.reader = ReplyReader(self.sock)
        hello: list[tuple[Arg, ...]] = []
        if address.password is not None:
            hello.append(("AUTH", address.username, address.password) if address.username
                         else ("AUTH", address.password))
        if address.db:
            hello.append(("SELECT", address.db))
        try:
            self.send(hello)
            for _ in hello:
                reply = self.reader.reply(None)
                if isinstance(reply, RedisError):
                    raise reply
        except BaseException:
            self.close()
            raise

    def send(self, commands: Sequence[Sequence[Arg]]) -> None:
        if not commands:
            return
        try:
            self.sock.sendall(pack_commands(commands))
        except TimeoutError:
            raise RedisTimeoutError("Timeout writing to the store") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error writing to the store: {exc}") from None

    def send_set(self, key: bytes, value: memoryview) -> None:
        """``SET key value`` with the value sent from the caller's buffer in place (no copy but the kernel's): the
        command's head and the value in one ``sendmsg`` where the socket takes a list (TLS does not: two writes).
        Returns once the kernel holds every byte, so the buffer may be reused."""
        head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value))
        parts = (head, value, b"\r\n")
        try:
            if isinstance(self.sock, ssl.SSLSocket):
                for part in parts:
                    self.sock.sendall(part)
                return
            sent = self.sock.sendmsg(parts)
            for part in parts:  # what one sendmsg left (the socket's buffer was full): the rest of each part
                if sent >= len(part):
                    sent -= len(part)
                    continue
                self.sock.sendall(memoryview(part)[sent:])
                sent = 0
        except TimeoutError:
            raise RedisTimeoutError("Timeout writing to the store") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error writing to the store: {exc}") from None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _all_read(conn: _Connection) -> None:
    """A batch's replies are all read: bytes past them mean the connection is out of step with the store."""
    if conn.reader.leftover:
        raise InvalidResponse(f"{conn.reader.leftover} bytes past the last reply")


class ValueConnections:
    """A pool of the tier's own connections to one standalone store (thread-safe; one connection per load batch in
    flight)."""

    def __init__(self, address: Address) -> None:
        self.address = address
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._generation = 0

    def read_values(self, keys: Sequence[bytes], buf: bytearray, on_value: Callable[[Reply], None],
                    after: Sequence[Sequence[Arg]] = ()) -> list[Reply]:
        """``GET`` of every key, then the commands ``after``, in one round trip on one pooled connection. Each GET
        reply is handed to ``on_value`` as it arrives, in key order -- a value (a memoryview of ``buf``, or of a new
        buffer for a value larger than it, valid only during the call), None for a missing key, or the exception of
        an error reply -- while the store's next replies keep arriving in the socket's buffer. Returns the replies
        of ``after``. A failed connection raises a redis-py error (the connection is closed, never reused half
        read); so does whatever ``on_value`` raises."""
        with self._connection() as conn:
            conn.send([("GET", key) for key in keys] + list(after))
            for _ in keys:
                on_value(conn.reader.reply(buf))
            replies = [conn.reader.reply(None) for _ in after]
            _all_read(conn)
        return replies

    def write_values(self, values: Iterator[tuple[bytes, memoryview]],
                     after: Callable[[int], Sequence[Sequence[Arg]]]) -> tuple[list[Reply], list[Reply]]:
        """``SET`` of each ``(key, value)`` that ``values`` yields, sent as it is yielded (the value a view of the
        caller's buffer, which it may refill once the generator resumes: the kernel then holds the bytes), then the
        commands ``after(n)`` returns for the ``n`` values sent, all on one pooled connection; then every reply is
        read. The store takes in one value while the caller seals the next. Returns the SET replies in order ("OK",
        or the exception of an error reply) and the replies of ``after``. A failed connection raises a redis-py
        error (the connection is closed, never reused half read); so does whatever ``values`` raises."""
        with self._connection() as conn:
            n = 0
            for key, value in values:
                conn.send_set(key, value)
                n += 1
            tail = list(after(n))
            conn.send(tail)
            replies = [conn.reader.reply(None) for _ in range(n)]
            tail_replies = [conn.reader.reply(None) for _ in tail]
            _all_read(conn)
        return replies, tail_replies

    @contextmanager
    def _connection(self) -> Iterator[_Connection]:
        """A pooled connection for one batch: given back after it, closed (never reused half read) if it raised."""
        conn, generation = self._take()
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        self._give_back(conn, generation)

    def _take(self) -> tuple[_Connection, int]:
        with self._lock:
            generation = self._generation
            if self._idle:
                return self._idle.pop(), generation
        return _Connection(self.address), generation

    def _give_back(self, conn: _Connection, generation: int) -> None:
        with self._lock:
            if generation == self._generation:
                self._idle.append(conn)
                return
        conn.close()  # opened before a close(): the store may have changed since

    def close(self) -> None:
        """Close the idle connections; those in use are closed when their batch ends."""
        with self._lock:
            self._generation += 1
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
