"""`kvtier replay --replicas N [--shared]`: sizing a shared (remote) tier before deploying it (issue #26).

Requests go to replicas in turn; private tiers exist once per replica, a shared last tier once for all."""
from __future__ import annotations

import json

import pytest
from kvtier_runtime.replay.cli import main
from kvtier_runtime.replay.engine import PolicySpec, ReplayError, replay
from kvtier_runtime.replay.trace import Trace


def trace(requests: list[list[int]]) -> Trace:
    n = len(requests)
    return Trace(requests=[list(r) for r in requests], timestamps_ms=[float(i) for i in range(n)],
                 input_lengths=[16 * len(r) for r in requests], output_lengths=[1] * n)


def write(tmp_path, requests) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 16 * len(r), "output_length": 1,
                                        "hash_ids": r}) + "\n" for i, r in enumerate(requests)))
    return str(path)


LRU = PolicySpec("lru")


def test_one_replica_is_the_plain_replay():
    reqs = [[1, 2, 3], [1, 2, 4], [5, 1, 2], [1, 2, 3]] * 5
    a = replay(trace(reqs), [2, 4], [LRU, LRU], with_opt=False)
    b = replay(trace(reqs), [2, 4], [LRU, LRU], with_opt=False, replicas=1)
    assert [(t.hits, t.prefix_hits, t.stored_blocks) for t in a.tiers] == \
        [(t.hits, t.prefix_hits, t.stored_blocks) for t in b.tiers]


def test_a_prefix_computed_on_one_replica_is_served_to_the_next_only_from_a_shared_tier():
    # Two replicas, requests alternate: request 0 (replica A) computes [1, 2, 3]; request 1 (replica B) asks for it.
    reqs = [[1, 2, 3], [1, 2, 3]]
    private = replay(trace(reqs), [8, 8], [LRU, LRU], with_opt=False, replicas=2)
    shared = replay(trace(reqs), [8, 8], [LRU, LRU], with_opt=False, replicas=2, shared_last=True)
    assert private.total_prefix_hits == 0
    assert shared.total_prefix_hits == 3 and shared.tiers[1].prefix_hits == 3 and shared.tiers[0].prefix_hits == 0
    # ... and the shared tier promotes into B's private tier, which serves B's next turn.
    more = replay(trace(reqs + [[9], [1, 2, 3]]), [8, 8], [LRU, LRU], with_opt=False, replicas=2,
                  shared_last=True)
    assert more.tiers[0].prefix_hits == 3


def test_private_tiers_are_per_replica_capacity():
    # Each replica holds 3 blocks privately: the round-robin repeats fit, although 2 x 3 blocks are distinct.
    reqs = [[1, 2, 3], [4, 5, 6]] * 4
    res = replay(trace(reqs), [3], [LRU], with_opt=False, replicas=2)
    assert res.total_prefix_hits == 18  # all but the first visit of each replica's 3 blocks


def test_the_cli_compares_a_shared_tier_with_the_same_bytes_private(tmp_path, capsys):
    docs = [[d * 10 + i for i in range(4)] for d in range(6)]
    reqs = [docs[i % 6] + [1000 + i] for i in range(120)]
    assert main(["--trace", write(tmp_path, reqs), "--capacity", "2", "--capacity", "40", "--replicas", "4",
                 "--shared", "--policy", "lru", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["replicas"] == 4 and d["private_alternative"]["last_tier_capacity_blocks_per_replica"] == 10
    # 40 shared blocks hold all six documents and the fresh blocks between reuses; 10 per replica do not.
    assert d["total"]["prefix_hit_ratio"] > d["private_alternative"]["prefix_hit_ratio"] + 0.2
    assert main(["--trace", write(tmp_path, reqs), "--capacity", "40", "--replicas", "4", "--shared"]) == 0
    assert "the same bytes as private last tiers of 10 blocks each" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--shared"], "--shared: needs --replicas 2 or more"),
    (["--replicas", "0"], "--replicas: '0' must be a positive integer"),
    (["--replicas", "x"], "--replicas: 'x' is not an integer"),
])
def test_bad_replica_options_are_one_line_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) if "x" in argv or "0" in argv else _no_raise():
        status = main(["--trace", write(tmp_path, [[1, 2]]), *argv])
        assert status == 2
    assert message in capsys.readouterr().err


def test_replicas_are_bounded():
    with pytest.raises(ReplayError, match="--replicas"):
        replay(trace([[1]]), [1], [LRU], replicas=10**9)


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
