"""Names of block files: derived only from the hex of a key, so no input can reach outside the tier's root.

Layout under ``root_dir``::

    kvtier-blocks-v1/<h0h1>/<h2h3>/<name>.kvb      a block
    kvtier-blocks-v1/<h0h1>/<h2h3>/<name>.kvb.tmp.<pid>.<n>   a block being written

``<name>`` is the key's hex when the key is short enough for a file name, else ``h`` + the SHA-256 hex of the key
(the full key is in the header, so a collision is detected as a mismatch, never served). The fan-out keeps
directories small (65,536 leaf directories). Everything here is a pure function of the key bytes.
"""
from __future__ import annotations

import hashlib
import re

NAMESPACE = "kvtier-blocks-v1"
SUFFIX = ".kvb"
TMP_MARK = ".tmp."
# 200 hex characters + suffix stays well under the 255-byte file name limit of common filesystems.
MAX_HEX_KEY_BYTES = 100

_BLOCK_RE = re.compile(r"^(?:[0-9a-f]{2,200}|h[0-9a-f]{64})\.kvb$")
_FANOUT_RE = re.compile(r"^[0-9a-f]{2}$")


def block_name(key: bytes) -> str:
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise ValueError(f"key: {key!r} must be non-empty bytes")
    if len(key) <= MAX_HEX_KEY_BYTES:
        return bytes(key).hex() + SUFFIX
    return "h" + hashlib.sha256(key).hexdigest() + SUFFIX


def block_relpath(key: bytes) -> str:
    """``<h0h1>/<h2h3>/<name>`` relative to the namespace directory."""
    name = block_name(key)
    stem = name[1:] if name.startswith("h") else name
    if len(stem) < 4 + len(SUFFIX):  # 1-byte keys: pad the fan-out so every block sits two levels down
        stem = stem[:-len(SUFFIX)].ljust(4, "0") + SUFFIX
    return f"{stem[0:2]}/{stem[2:4]}/{name}"


def is_block_name(name: str) -> bool:
    return bool(_BLOCK_RE.match(name)) and (name.startswith("h") or (len(name) - len(SUFFIX)) % 2 == 0)


def is_tmp_name(name: str) -> bool:
    return TMP_MARK in name and is_block_name(name.split(TMP_MARK, 1)[0])


def is_fanout_name(name: str) -> bool:
    return bool(_FANOUT_RE.match(name))
