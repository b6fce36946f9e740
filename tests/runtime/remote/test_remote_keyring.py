"""Rotating a tenant key without downtime: each value names the key that sealed it, a replica holds the current key
(seals and opens) and the previous one (opens) and reads both files again when the kubelet swaps them. Before, a
value carried no key id and a tier read its key once at start: during a rotation, replicas on the old and new keys
saw each other's values as forged, and a retired key stayed valid in running pods until they restarted."""
from __future__ import annotations

import os
import struct

import pytest
from kvtier_runtime.config import ConfigError
from kvtier_runtime.remote.format import HEAD_BYTES, MAGIC, RemoteFormatError, key_id_of
from kvtier_runtime.remote.keyring import Keyring

SCOPE, MODEL = "team-a", "0123456789abcdef0123456789abcdef"
K1, K2, K3 = b"1" * 32, b"2" * 32, b"3" * 32
STORE_KEY = b"kvtier:team-a:model:00ff"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def write(path, data: bytes | None) -> None:
    """Replace a key file the way the kubelet does: a new file renamed over (a new inode), or removed."""
    if data is None:
        if path.exists():
            path.unlink()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def ring(tmp_path, current: bytes, previous: bytes | None = None, clock=None, **kw) -> Keyring:
    write(tmp_path / "mac-key", current)
    write(tmp_path / "mac-key.previous", previous)
    return Keyring(str(tmp_path / "mac-key"), str(tmp_path / "mac-key.previous"), SCOPE, MODEL,
                   clock=clock or Clock(), **kw)


def seal(keys, payload: bytes = b"kv" * 100) -> bytes:
    buf = bytearray(HEAD_BYTES + len(payload) + 16)
    n = keys.seal(buf, STORE_KEY, "none", memoryview(payload))
    return bytes(buf[:n])


def opened(keys, value: bytes) -> bytes:
    _, payload = keys.open(value, STORE_KEY, bytearray(len(value)))
    return bytes(payload)


def test_a_rotation_keeps_old_values_readable_and_counts_them(tmp_path):
    clock = Clock()
    old = ring(tmp_path / "a", K1, clock=clock)
    value = seal(old)
    assert key_id_of(value) == old.key_ids[0]

    # Step 1: the new key current, the old one previous. The replica re-reads within recheck_s.
    keys = ring(tmp_path / "b", K1, clock=clock)
    write(tmp_path / "b" / "mac-key", K2)
    write(tmp_path / "b" / "mac-key.previous", K1)
    assert opened(keys, value) == b"kv" * 100 and keys.previous_reads == 0, "not yet re-read: K1 is current"
    clock.now += 1.0
    assert opened(keys, value) == b"kv" * 100 and keys.previous_reads == 1, "read under the previous key"
    new = seal(keys)
    assert key_id_of(new) == keys.key_ids[0] != key_id_of(value)
    # A replica that has not switched yet cannot open the new value: a "key" miss, never "forged".
    with pytest.raises(RemoteFormatError) as refused:
        opened(old, new)
    assert refused.value.kind == "key"

    # Step 2: the previous key removed: old values are refused from then on ("key"), new ones still open.
    write(tmp_path / "b" / "mac-key.previous", None)
    clock.now += 1.0
    with pytest.raises(RemoteFormatError) as refused:
        opened(keys, value)
    assert refused.value.kind == "key" and keys.key_ids[1] is None
    assert opened(keys, new) == b"kv" * 100


def test_a_value_altered_under_a_held_key_is_still_forged(tmp_path):
    keys = ring(tmp_path, K2, K1)
    value = bytearray(seal(keys))
    value[-20] ^= 0x01
    with pytest.raises(RemoteFormatError) as refused:
        opened(keys, bytes(value))
    assert refused.value.kind == "forged"
    # The key id is in the authenticated header: pointing a value at the previous key does not get it opened.
    other = bytearray(seal(keys))
    struct.pack_into("<I", other, len(MAGIC) + 3, keys.key_ids[1])
    with pytest.raises(RemoteFormatError) as refused:
        opened(keys, bytes(other))
    assert refused.value.kind == "forged"


def version_two(tenant_key: bytes, payload: bytes = b"kv" * 100) -> bytes:
    """A value as the release before key ids wrote it: version 2, key id field 0, sealed over that header."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from kvtier_runtime.remote.format import SEALING_AES_256_GCM, derive_value_key
    from kvtier_runtime.tiers.envelope import bound_data

    nonce = os.urandom(12)
    head = struct.pack("<8sHBIxQ16s12s", MAGIC, 2, SEALING_AES_256_GCM, 0, len(payload), b"none", nonce)
    aead = AESGCM(derive_value_key(tenant_key, SCOPE, MODEL))
    return head + aead.encrypt(nonce, payload, bound_data(memoryview(head), STORE_KEY))


def test_values_written_before_key_ids_open_under_the_current_or_the_previous_key(tmp_path):
    """Version 2 values (key id 0), from replicas of the release before: tried with the current key, then the
    previous one, as a rotation begun from that release needs."""
    old = version_two(K1)
    assert key_id_of(old) is None
    assert opened(ring(tmp_path / "cur", K1), old) == b"kv" * 100
    keys = ring(tmp_path / "prev", K2, K1)
    assert opened(keys, old) == b"kv" * 100 and keys.previous_reads == 1
    with pytest.raises(RemoteFormatError) as refused:
        opened(ring(tmp_path / "none", K3), old)
    assert refused.value.kind == "forged"


@pytest.mark.parametrize("field", ["mac_key_file", "previous_mac_key_file"])
def test_a_tenant_key_equal_to_a_store_credential_is_refused_naming_both_fields(tmp_path, field):
    current, previous = (K1, None) if field == "mac_key_file" else (K2, K1)
    with pytest.raises(ConfigError) as refused:
        ring(tmp_path, current, previous, credentials={"password_file": K1})
    assert str(refused.value).startswith(f"{field}: holds the same bytes as password_file: ")


def test_a_replaced_key_that_cannot_be_used_keeps_the_keys_in_use(tmp_path):
    clock = Clock()
    keys = ring(tmp_path, K1, clock=clock, credentials={"password_file": K3})
    value = seal(keys)
    write(tmp_path / "mac-key", K3)  # the store password, by mistake
    clock.now += 1.0
    assert opened(keys, value) == b"kv" * 100 and key_id_of(seal(keys)) == key_id_of(value)
    write(tmp_path / "mac-key", b"short")
    clock.now += 1.0
    assert opened(keys, value) == b"kv" * 100
    write(tmp_path / "mac-key", K2)  # fixed: the next change is taken
    clock.now += 1.0
    assert key_id_of(seal(keys)) != key_id_of(value) and keys.reloads == 1
