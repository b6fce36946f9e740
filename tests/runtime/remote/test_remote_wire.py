"""The error replies the tier's own load connections read (:mod:`kvtier_runtime.remote.wire`) become the fault
kinds redis-py's parser would have made of them: a full store, refused credentials and a store not serving are
told apart from a key's own error, whichever connection met them."""
from __future__ import annotations

import pytest
from kvtier_runtime.remote.client import failure_kind
from kvtier_runtime.remote.wire import error_reply, pack_commands


@pytest.mark.parametrize(("text", "kind"), [
    ("OOM command not allowed when used memory > 'maxmemory'.", "full"),
    ("NOAUTH Authentication required.", "auth"),
    ("WRONGPASS invalid username-password pair or user is disabled.", "auth"),
    ("NOPERM User team-a has no permissions to access the 'kvtier:team-b:x' key", "auth"),
    ("ERR invalid password", "auth"),
    ("LOADING Redis is loading the dataset in memory", "down"),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", "down"),
    ("CLUSTERDOWN The cluster is down", "down"),
    ("ERR max number of clients reached", "down"),
    ("WRONGTYPE Operation against a key holding the wrong kind of value", "other"),
    ("ERR unknown command 'FOO'", "other"),
    ("READONLY You can't write against a read only replica.", "other"),
])
def test_an_error_reply_reads_as_the_fault_kind_redis_py_gives_it(text: str, kind: str) -> None:
    assert failure_kind(error_reply(text)) == kind


def test_an_error_reply_keeps_its_message_without_the_code_as_redis_py_does() -> None:
    assert str(error_reply("OOM command not allowed")) == "command not allowed"
    assert str(error_reply("WRONGTYPE Operation against a key")) == "WRONGTYPE Operation against a key"


def test_commands_pack_as_resp_arrays_of_bulk_strings() -> None:
    assert pack_commands([("GET", b"k\r\n"), ("ZADD", b"i", "XX", "1.5", b"ab")]) == (
        b"*2\r\n$3\r\nGET\r\n$3\r\nk\r\n\r\n*5\r\n$4\r\nZADD\r\n$1\r\ni\r\n$2\r\nXX\r\n$3\r\n1.5\r\n$2\r\nab\r\n")
