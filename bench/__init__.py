"""The benchmarks: each a script printing a table, with ratios against a reference measured in the same run
(``python bench/<name>.py --help``); ``--smoke`` runs one at a tiny size (tests/foundation/test_bench_smoke.py)."""
