"""The envelope a tier behind the host tier seals a stored value in, as far as every medium's format shares it (pure:
no I/O, no torch). Each medium keeps its own layout and primitive -- the filesystem tier's block header with a CRC
and an optional HMAC-SHA256 (:mod:`kvtier_runtime.fs.format`), the remote tier's AES-256-GCM value
(:mod:`kvtier_runtime.remote.format`) -- and reads it through the checks here, in the same order and with the same
outcomes:

1. **magic** -- bytes without the medium's magic are ``foreign`` (someone else's file or value); with it but shorter
   than the head, ``truncated`` (:func:`open_head`);
2. **version** -- a version this build does not read is ``version``, never decoded (:func:`open_head`);
3. **length** -- shorter than the head says is ``truncated``, longer is ``corrupt`` (:func:`check_length`);
4. **integrity and key binding** -- a value is bound to the store key it was written under: the key is in what the
   MAC covers (the filesystem header holds it) or in the AEAD's associated data (:func:`bound_data`); a value that
   does not verify under the tenant key is ``forged``, a damaged one ``corrupt`` (:func:`verify_mac`).

Writers share the bounded fields: the key (1..max bytes, :func:`check_key`) and fixed-width ASCII names
(:func:`name_field`, read back by :func:`read_name`). Every refusal is an :class:`EnvelopeError` whose ``kind``
names the rule, the key a tier counts the refusal by.
"""
from __future__ import annotations

import hmac
import struct

__all__ = [
    "KINDS", "EnvelopeError", "bound_data", "check_key", "check_length", "name_field", "open_head", "read_name",
    "verify_mac",
]

# Why a stored value is refused: foreign (not this medium's magic, or not a regular file), version (a format this
# build does not read), truncated (shorter than its header says), corrupt (a checksum or field out of range),
# forged (the keyed MAC or AEAD tag does not verify), mismatch (valid, but not the key, shape or dtype asked for),
# key (sealed under a tenant key the reader does not hold: the other side of a key rotation, or a removed key).
KINDS = frozenset({"foreign", "version", "truncated", "corrupt", "forged", "mismatch", "key"})


class EnvelopeError(Exception):
    """A stored value is not a valid value of its medium's format for what was asked; ``kind`` (one of
    :data:`KINDS`) says why, ``detail`` how."""

    def __init__(self, kind: str, detail: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind: {kind!r} is not one of {sorted(KINDS)}")
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def check_key(key: bytes, max_bytes: int) -> None:
    """A store key a value may be written under: 1..``max_bytes`` bytes (ValueError naming ``key`` otherwise)."""
    if not 0 < len(key) <= max_bytes:
        raise ValueError(f"key: {len(key)} bytes, must be 1..{max_bytes}")


def name_field(field: str, value: str, width: int) -> bytes:
    """``value`` as the bytes of a fixed-width name field (the struct pads it with NULs): 1..``width`` ASCII
    characters, else ValueError naming ``field``."""
    try:
        raw = value.encode("ascii")
    except UnicodeEncodeError:
        raw = b""
    if not raw or len(raw) > width:
        raise ValueError(f"{field}: {value!r} must be 1..{width} ASCII characters")
    return raw


def read_name(raw: bytes, what: str) -> str:
    """A name field read back (NUL padding dropped); ``corrupt`` naming ``what`` when it is not ASCII."""
    try:
        return raw.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise EnvelopeError("corrupt", f"{what} is not ASCII") from None


def open_head(buf: bytes | bytearray | memoryview, *, magic: bytes, head_bytes: int, readable: tuple[int, ...],
              what: str, version_note: str = "") -> int:
    """The format version of the value in ``buf``, after the checks every reader makes first: its magic
    (``foreign``), a head of ``head_bytes`` (``truncated``) and a version in ``readable`` (``version``). The
    version is the little-endian u16 right after the magic, as in every kvtier format. ``what`` names the value in
    the details ("block", "kvtier value")."""
    mv = memoryview(buf)
    has_magic = bytes(mv[: len(magic)]) == magic
    if len(mv) < head_bytes:
        if not has_magic:
            raise EnvelopeError("foreign", f"{len(mv)} bytes, no {what} magic")
        raise EnvelopeError("truncated", f"header is {len(mv)} bytes, needs {head_bytes}")
    if not has_magic:
        raise EnvelopeError("foreign", f"no {what} magic")
    version: int = struct.unpack_from("<H", mv, len(magic))[0]
    if version not in readable:
        raise EnvelopeError("version", f"format version {version}, this build reads {readable}{version_note}")
    return version


def check_length(actual: int, expected: int, what: str) -> None:
    """``truncated`` when a value of ``actual`` bytes is shorter than the ``expected`` its header says, ``corrupt``
    when longer (``what`` names it: "file", "value")."""
    if actual < expected:
        raise EnvelopeError("truncated", f"{what} is {actual} bytes, header says {expected}")
    if actual > expected:
        raise EnvelopeError("corrupt", f"{what} is {actual} bytes, header says {expected}")


def bound_data(head: bytes | bytearray | memoryview, key: bytes) -> bytes:
    """What binds a sealed value to its store key, for a cipher's associated data: the value's head, then the key it
    is stored under. Moving the value to another key changes this, so its tag no longer verifies."""
    return bytes(head) + bytes(key)


def verify_mac(want: bytes, stored: bytes | memoryview) -> None:
    """``forged`` unless the stored MAC is the one computed (compared in constant time)."""
    if not hmac.compare_digest(want, bytes(stored)):
        raise EnvelopeError("forged", "keyed MAC does not verify")
