"""The value format of kvtier's remote tier (pure functions, no I/O, no torch).

One chunk is one store value, sealed with AES-256-GCM::

    0   8s   magic  b"KVTIERR1"
    8   H    format version (3)
    10  B    sealing: 1 = AES-256-GCM
    11  I    key id: which tenant key sealed it (version 3; 0 in version 2), so a reader holding the current and
             the previous key during a rotation opens each value with its own key (:mod:`.keyring`)
    15  x
    16  Q    payload length (the codec's self-describing blob; the ciphertext is as long)
    24  16s  codec name the writer was configured with (ASCII, NUL padded)
    40  12s  nonce (96 random bits per value, os.urandom)
    52  ciphertext of the payload
    ... 16-byte GCM tag

The value key is derived with HKDF-SHA256 from the tenant's key file (``mac_key_file``, at least 32 bytes), with the
scope and the model identity in HKDF's info: each (tenant, scope, model) has its own key, and the tenant's file
itself never keys a cipher. The associated data is the header (52 bytes) and the store key the value was written
under, so a value is refused (``forged``: the tag does not verify) when it was written by anyone without the key,
altered in any byte, or moved to another key (another chunk, another model, another scope). A reader of the store
without the key sees the header (format, codec, sizes) and ciphertext only.

Values of format version 1 (an HMAC or a CRC, the payload in clear) read as ``version``: a counted miss, never
decoded. Version 2 values (no key id) are read with the current key, then the previous one. The key id is a keyed
digest of the tenant's key (HMAC under it of a fixed message), so it tells a reader of the store nothing it could
use about the key. GCM's bound for random nonces (2^32 values per key) is far above what one model of one scope writes
between key rotations at any plausible rate; the key is per scope and model too.

The reader's checks (magic, version, length, then the tag), the refusal kinds (:class:`RemoteFormatError` is the
envelope's error) and the bounded key and name fields are shared with the filesystem tier's format in
:mod:`kvtier_runtime.tiers.envelope`; this module keeps the value layout and its primitives (HKDF, AES-256-GCM).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..tiers.envelope import EnvelopeError, bound_data, check_key, check_length, name_field, open_head, read_name

MAGIC = b"KVTIERR1"
FORMAT_VERSION = 3
# Version 2: the same layout, the key id field zero (written before key ids).
READABLE_VERSIONS = (2, 3)
SEALING_AES_256_GCM = 1
_HEAD = struct.Struct("<8sHBIxQ16s12s")
HEAD_BYTES = _HEAD.size  # 52
NONCE_BYTES = 12
TAG_BYTES = 16
MAX_KEY_BYTES = 512
CODEC_NAME_BYTES = 16
VALUE_KEY_BYTES = 32
# HKDF's info: this domain, then the scope and the model identity (a scope is a DNS label and an identity is hex,
# so neither holds the NUL separator and no two (scope, identity) pairs give one info).
_HKDF_DOMAIN = b"kvtier-remote-value-v2\0"


# A value refused for what it holds; ``kind`` says why (``foreign``, ``version``, ``truncated``, ``corrupt``,
# ``forged``: kvtier_runtime.tiers.envelope.KINDS).
RemoteFormatError = EnvelopeError


def value_bytes(payload_len: int) -> int:
    """Size of a whole value: header, ciphertext, tag."""
    return HEAD_BYTES + payload_len + TAG_BYTES


def derive_value_key(tenant_key: bytes, scope: str, identity: str) -> bytes:
    """The AES-256 key of one scope's values of one model: HKDF-SHA256 of the tenant's key material."""
    info = _HKDF_DOMAIN + scope.encode("ascii") + b"\0" + identity.encode("ascii")
    return HKDF(algorithm=hashes.SHA256(), length=VALUE_KEY_BYTES, salt=None, info=info).derive(tenant_key)


def _key_id(tenant_key: bytes) -> int:
    """A tenant key's id: 32 bits of HMAC-SHA256 under the key of a fixed message (a pseudo-random fingerprint that
    tells nothing of the key), never 0 (version 2's "no id"). Per tenant key, not per scope and model: a value moved
    from another model of the same tenant names a key the reader holds, so it is ``forged`` (its tag fails), and
    only a value sealed under a key the reader does not hold at all is a ``key`` miss."""
    digest = hmac.new(tenant_key, b"kvtier-remote-key-id", hashlib.sha256).digest()
    return int.from_bytes(digest[:4], "little") or 1


def key_id_of(value: bytes | bytearray | memoryview) -> int | None:
    """The key id in a value's header; None for a version 2 value (it names no key) or bytes too short or foreign
    to say (the sealer's own checks then name the refusal)."""
    mv = memoryview(value)
    if len(mv) < HEAD_BYTES or bytes(mv[:len(MAGIC)]) != MAGIC:
        return None
    version, _, key_id = struct.unpack_from("<HBI", mv, len(MAGIC))
    return key_id if version >= 3 and key_id else None


class ValueSealer(Protocol):
    """What seals and opens a tier's values: a :class:`Sealer` (one key) or a :class:`~.keyring.Keyring` (the
    current and the previous key of a rotation)."""

    def seal(self, buf: bytearray | memoryview, key: bytes, codec: str, payload: memoryview) -> int: ...

    def seal_parts(self, buf: bytearray | memoryview, key: bytes, codec: str, parts: Sequence[memoryview]) -> int: ...

    def open(self, value: bytes | bytearray | memoryview, key: bytes, out: bytearray | memoryview,
             ) -> tuple[str, memoryview]: ...


class Sealer:
    """Seals and opens the values of one scope and model (thread-safe: the AEAD context holds only the key)."""

    def __init__(self, tenant_key: bytes, scope: str, identity: str) -> None:
        self._value_key = derive_value_key(tenant_key, scope, identity)
        self._aead = AESGCM(self._value_key)
        self.key_id = _key_id(tenant_key)

    def seal(self, buf: bytearray | memoryview, key: bytes, codec: str, payload: memoryview) -> int:
        """Write the value of ``payload`` stored under ``key`` into ``buf`` (header, ciphertext, tag: no copy of the
        payload but the cipher's own output); returns its length (``buf[:n]`` is what to store). ValueError names the
        field that cannot be represented."""
        mv, nonce, total = self._head(buf, key, codec, len(payload))
        aad = bound_data(mv[:HEAD_BYTES], key)
        self._aead.encrypt_into(nonce, payload, aad, mv[HEAD_BYTES:total])
        return total

    def seal_parts(self, buf: bytearray | memoryview, key: bytes, codec: str, parts: Sequence[memoryview]) -> int:
        """:meth:`seal` of the concatenation of ``parts`` (byte buffers), without concatenating them: the same value,
        GCM encrypting each part in turn straight into ``buf``. A codec's header and a host row in place of an
        encoded copy of the row (codec ``none``: the payload is the header, then the row's bytes)."""
        views = [memoryview(p).cast("B") for p in parts]
        mv, nonce, total = self._head(buf, key, codec, sum(len(v) for v in views))
        enc = Cipher(algorithms.AES(self._value_key), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(bound_data(mv[:HEAD_BYTES], key))
        at = HEAD_BYTES
        for v in views:
            # update_into wants room for a block more than it writes; the tag's 16 bytes follow the last part.
            at += enc.update_into(v, mv[at:at + len(v) + TAG_BYTES - 1])
        enc.finalize()
        mv[at:total] = enc.tag
        return total

    def _head(self, buf: bytearray | memoryview, key: bytes, codec: str, n: int) -> tuple[memoryview, bytes, int]:
        """Check the arguments, pack the header of a ``n``-byte payload with a fresh nonce into ``buf``."""
        check_key(key, MAX_KEY_BYTES)
        name = name_field("codec", codec, CODEC_NAME_BYTES)
        mv = memoryview(buf)
        total = value_bytes(n)
        if len(mv) < total:
            raise ValueError(f"buf: {len(mv)} bytes, the value needs {total}")
        nonce = os.urandom(NONCE_BYTES)
        _HEAD.pack_into(mv, 0, MAGIC, FORMAT_VERSION, SEALING_AES_256_GCM, self.key_id, n, name, nonce)
        return mv, nonce, total

    def open(self, value: bytes | bytearray | memoryview, key: bytes, out: bytearray | memoryview,
             ) -> tuple[str, memoryview]:
        """Verify a value read from ``key`` and decrypt its payload into ``out``; returns ``(codec name, payload)``
        (a view into ``out``). ``out`` is scratch, never the caller's row: after a refusal it may hold unverified
        bytes (the cipher decrypts, then checks the tag), which nothing reads. Raises :class:`RemoteFormatError`
        (never anything else) for any bytes it is given."""
        mv = memoryview(value)
        open_head(mv, magic=MAGIC, head_bytes=HEAD_BYTES, readable=READABLE_VERSIONS, what="kvtier value",
                  version_note=" (values are encrypted since version 2)")
        _, _, sealing, _, payload_len, codec, nonce = _HEAD.unpack_from(mv, 0)
        if sealing != SEALING_AES_256_GCM:
            raise RemoteFormatError("corrupt", f"sealing kind {sealing}")
        expected = value_bytes(payload_len)
        check_length(len(mv), expected, "value")
        dst = memoryview(out)
        if len(dst) < payload_len:
            raise RemoteFormatError("corrupt", f"a payload of {payload_len} bytes, larger than this tier's "
                                               f"largest ({len(dst)})")
        aad = bound_data(mv[:HEAD_BYTES], key)
        try:
            self._aead.decrypt_into(nonce, mv[HEAD_BYTES:expected], aad, dst[:payload_len])
        except InvalidTag:
            raise RemoteFormatError("forged", "the value does not verify under this scope's key (another key "
                                              "wrote it, it was altered, or it was moved from another store key)"
                                    ) from None
        return read_name(codec, "codec name"), dst[:payload_len]
