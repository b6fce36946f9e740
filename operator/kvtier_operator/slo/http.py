"""One bounded HTTP GET (aiohttp): a total deadline (DNS, connect, TLS, request, every read together), bounded
headers and a size cap on the body.

A policy names the Prometheus the operator queries, so its answers are untrusted input: a server that drips one
byte at a time must not hold a query longer than ``deadline_s`` (a per-read timeout would let it do so forever),
and one that answers 200 MB must not grow the operator past its memory limit. So: ``ClientTimeout(total=...)``
for the deadline, the status line and each header at most :data:`MAX_LINE_BYTES`, at most :data:`MAX_HEADERS`
headers, a declared ``Content-Length`` over the cap refused before any body is read and the body read in chunks
up to the cap (then the connection is dropped), no redirect followed (a 3xx is an answer like any other), no
decompression (``Accept-Encoding: identity``), no proxy or cookie from the environment.

The guard runs in a lane's thread (``lanes.Lanes``), never on kopf's event loop: :func:`get` is blocking and runs
its request on an event loop of its own, created and closed by the call (session and connection closed with it).
Called from a thread whose event loop is running, it refuses (it would block that loop).

Errors carry only local words (the status line, sanitised), never the body: the answer of an arbitrary URL must
not be reflected into status or Events.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import ssl
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Optional, TypeVar
from urllib.parse import urlsplit

import aiohttp
from aiohttp import http_exceptions

# The status line and each header line, and how many headers: a Prometheus answer has a handful of short ones.
MAX_LINE_BYTES = 8 * 1024
MAX_HEADERS = 64
CHUNK_BYTES = 64 * 1024
_PRINTABLE = re.compile(r"[^A-Za-z0-9 ._/()-]")
T = TypeVar("T")


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


def get(url: str, *, params: Optional[Mapping[str, str]] = None, headers: Optional[Mapping[str, str]] = None,
        deadline_s: float, max_bytes: int, ca_file: Optional[str] = None, insecure: bool = False) -> Response:
    """GET ``url`` (+ ``params``); the whole exchange ends within ``deadline_s`` and reads at most ``max_bytes``
    of body. Blocking: call it from a worker thread. Raises :class:`HTTPFailure`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HTTPFailure("protocol", "not an http(s) URL with a host")
    if deadline_s <= 0:
        raise HTTPFailure("timeout", f"timed out after {deadline_s:g}s")
    if max_bytes < 0:
        raise ValueError(f"max_bytes: {max_bytes} must be at least 0")
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("slo.http.get blocks: call it from a worker thread, not from a running event loop")
    context: Optional[ssl.SSLContext] = None
    if parts.scheme == "https":
        try:
            context = ssl.create_default_context(cafile=ca_file)
        except (OSError, ssl.SSLError) as err:
            raise HTTPFailure("tls", "the CA bundle could not be loaded: " +
                              sanitise(getattr(err, "reason", None) or type(err).__name__, 60)) from None
        if insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    return _run(_get(url, dict(params or {}), dict(headers or {}), deadline_s, max_bytes, context))


def _run(coro: Coroutine[object, object, T]) -> T:
    """``coro`` on an event loop of its own, closed before returning. Unlike ``asyncio.run``, the loop's executor
    (aiohttp resolves host names there) is not waited for: a resolver that hangs past the deadline must not hold
    the caller; its thread ends when the resolver gives up."""
    loop = asyncio.new_event_loop()
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-slo-resolve")
    loop.set_default_executor(executor)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            loop.close()


async def _get(url: str, params: dict[str, str], headers: dict[str, str], deadline_s: float, max_bytes: int,
               context: Optional[ssl.SSLContext]) -> Response:
    timed_out = HTTPFailure("timeout", f"timed out after {deadline_s:g}s")
    request_headers = {"Accept": "application/json", "Accept-Encoding": "identity", "User-Agent": "kvtier-operator"}
    request_headers.update(headers)
    connector = aiohttp.TCPConnector(force_close=True, limit=1, ssl=context if context is not None else True)
    try:
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=deadline_s), trust_env=False,
            cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, raise_for_status=False,
            max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES, max_headers=MAX_HEADERS,
            read_bufsize=CHUNK_BYTES,
        ) as session, session.get(url, params=params or None, headers=request_headers,
                               allow_redirects=False) as resp:
            status, reason = resp.status, sanitise(resp.reason or "")
            if resp.content_length is not None and resp.content_length > max_bytes:
                resp.close()  # drop the connection: the rest of the answer is not read
                raise HTTPFailure("too_large", f"answer larger than {max_bytes} bytes")
            body = bytearray()
            async for chunk in resp.content.iter_chunked(CHUNK_BYTES):
                body += chunk
                if len(body) > max_bytes:
                    resp.close()
                    raise HTTPFailure("too_large", f"answer larger than {max_bytes} bytes")
            return Response(status, reason, bytes(body))
    except HTTPFailure:
        raise
    except TimeoutError:  # aiohttp's ServerTimeoutError and ConnectionTimeoutError are ones too
        raise timed_out from None
    except aiohttp.ClientConnectorCertificateError as err:
        raise HTTPFailure("tls", sanitise(getattr(err.certificate_error, "reason", None)
                                          or type(err.certificate_error).__name__, 60)) from None
    except aiohttp.ClientConnectorSSLError as err:
        raise HTTPFailure("tls", sanitise(getattr(err.os_error, "reason", None) or type(err.os_error).__name__,
                                          60)) from None
    except aiohttp.ClientConnectorError as err:
        # The errno's words ("connection refused"), not aiohttp's message, which quotes the address.
        # (a resolver's error has a negative code and its own words: "name or service not known").
        code = err.os_error.errno
        words = os.strerror(code) if code and code > 0 else err.os_error.strerror or type(err.os_error).__name__
        raise HTTPFailure("connect", sanitise(words.lower(), 60)) from None
    except aiohttp.ClientResponseError as err:
        # The status line or the headers did not parse (aiohttp's parser said why; its words quote the server).
        if _caused_by(err, http_exceptions.LineTooLong) or "Too many headers" in _messages(err):
            raise HTTPFailure("too_large", f"headers larger than {MAX_LINE_BYTES} bytes a line or more than "
                                           f"{MAX_HEADERS} of them") from None
        raise HTTPFailure("protocol", "not an HTTP/1.x answer") from None
    except aiohttp.ServerDisconnectedError:
        raise HTTPFailure("protocol", "connection closed before the headers ended") from None
    except aiohttp.ClientPayloadError:
        raise HTTPFailure("protocol", "connection closed before the body ended") from None
    except ssl.SSLError as err:
        raise HTTPFailure("tls", sanitise(err.reason or type(err).__name__, 60)) from None
    except (aiohttp.ClientError, OSError) as err:
        raise HTTPFailure("connect", sanitise(type(err).__name__.lower(), 60)) from None


def _causes(err: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    cause: Optional[BaseException] = err
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def _caused_by(err: BaseException, kind: type[BaseException]) -> bool:
    return any(isinstance(c, kind) for c in _causes(err))


def _messages(err: BaseException) -> str:
    return " ".join(str(getattr(c, "message", "")) for c in _causes(err))
