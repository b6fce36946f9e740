"""The trace generator: deterministic per seed, valid Mooncake format, and shaped like the published figures."""
from __future__ import annotations

from collections import Counter

import pytest
from kvtier_runtime.replay.synth import SHAPES, generate, write_jsonl
from kvtier_runtime.replay.trace import load_trace, trace_warnings


@pytest.mark.parametrize("shape", SHAPES)
def test_same_seed_same_trace_and_a_valid_file(tmp_path, shape) -> None:
    rows = generate(shape, 300, seed=7)
    assert rows == generate(shape, 300, seed=7)
    assert rows != generate(shape, 300, seed=8)
    path = tmp_path / f"{shape}.jsonl"
    write_jsonl(rows, path)
    trace = load_trace(path)
    assert len(trace.requests) == 300
    # ids are prefix-chained with one id per (partial) block, and requests come in timestamp order.
    assert trace_warnings(trace, 512) == []


def test_prefixes_are_chained_so_equal_ids_mean_equal_prefixes() -> None:
    parent: dict[int, int | None] = {}
    for row in generate("mixture", 600, seed=1):
        prev = None
        for h in row["hash_ids"]:
            assert parent.setdefault(h, prev) == prev, "one id, two different prefixes"
            prev = h


def reuse_shape(rows) -> tuple[float, float, float]:
    keys = [k for r in rows for k in r["hash_ids"]]
    counts, seen = Counter(keys), Counter()
    reuses = first = 0
    for k in keys:
        first += seen[k] == 1
        reuses += seen[k] >= 1
        seen[k] += 1
    return first / reuses, sum(1 for c in counts.values() if c > 1) / len(counts), reuses / len(keys)


def test_conversations_reuse_like_the_published_characterisation() -> None:
    # Mooncake's conversation trace (issue 18): 42% of reuses are first reuses, 24% of blocks are ever reused,
    # infinite-cache hit ratio 0.37.
    first_share, reused_blocks, infinite = reuse_shape(generate("conversation", 3000, seed=1))
    assert 0.35 <= first_share <= 0.50
    assert 0.18 <= reused_blocks <= 0.32
    assert 0.30 <= infinite <= 0.45


def test_shapes_differ_where_policies_care() -> None:
    doc_first, doc_reused, _ = reuse_shape(generate("document", 2000, seed=1))
    agent_first, _, agent_inf = reuse_shape(generate("agent", 2000, seed=1))
    assert doc_reused < 0.15, "one-shot documents: most blocks are never read again"
    assert agent_inf > 0.8 and agent_first < 0.2, "agents re-read long shared system prompts many times"


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="shape"):
        generate("video", 10)
    with pytest.raises(ValueError, match="requests"):
        generate("agent", 0)


def test_the_command_line_writes_a_trace_and_names_bad_options(tmp_path, capsys) -> None:
    from kvtier_runtime.replay.synth import main

    out = tmp_path / "c.jsonl"
    assert main(["--shape", "agent", "--requests", "50", "--seed", "3", "--out", str(out)]) == 0
    assert len(load_trace(out).requests) == 50
    capsys.readouterr()
    for argv, option in ((["--shape", "agent", "--requests", "0"], "--requests"),
                         (["--shape", "agent", "--out", str(tmp_path / "no" / "x.jsonl")], "--out")):
        with pytest.raises(SystemExit) as exc:
            main(argv + ([] if "--out" in argv else ["--out", str(out)]))
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert option in err and err.count("\n") == 1
