"""Key files (pure, no torch): the tenant key a filesystem tier MACs its blocks with and a remote tier derives its
value keys from (``mac_key_file``)."""
from __future__ import annotations

from ..config import ConfigError

__all__ = ["MIN_MAC_KEY_BYTES", "mac_key_from_bytes", "read_mac_key"]

# Fewer than 32 bytes of key material (SHA-256's strength) is refused as too weak.
MIN_MAC_KEY_BYTES = 32


def _printable_text(raw: bytes) -> bool:
    return all(0x20 <= b < 0x7F for b in raw)


def mac_key_from_bytes(raw: bytes, source: str) -> bytes:
    """The key from a key file's contents, as bytes. A key that is printable ASCII text followed by one newline
    (``echo`` or ``kubectl create secret --from-file`` of a text key) loses that newline; any other content is the
    key as it is, every byte kept: a random binary key that happens to end in 0x0a is not shortened. HMAC (and the
    remote tier's HKDF) take longer material as it is. ValueError names ``source``."""
    material = raw[:-1] if raw.endswith(b"\n") and _printable_text(raw[:-1]) else raw
    if len(material) < MIN_MAC_KEY_BYTES:
        raise ValueError(f"mac_key_file: {source} holds {len(material)} bytes, needs at least {MIN_MAC_KEY_BYTES}")
    return material


def read_mac_key(path: str | None) -> bytes | None:
    """The key in the file at ``path`` (None: no key). An unreadable file or a weak key is a ConfigError naming
    ``mac_key_file``."""
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read(4096)
    except OSError as exc:
        raise ConfigError(f"mac_key_file: {path} cannot be read ({exc.strerror or exc})") from None
    try:
        return mac_key_from_bytes(raw, path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
