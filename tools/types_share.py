#!/usr/bin/env python3
"""How much of the product mypy --strict holds: the share of the lines of operator/kvtier_operator and
runtime/kvtier_runtime that lie in files with no strict error (whatever the ratchet in pyproject lets off).

    python tools/types_share.py [--min SHARE]

Prints one line (the share, the files with errors and their error counts, largest first) and exits 1 when the
share is below ``--min``: `make check` runs it with the floor this round reached, so the share can only grow.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("operator/kvtier_operator", "runtime/kvtier_runtime")
# mypy's own flags for --strict, and nothing of the ratchet: every module is judged by the same rules.
STRICT = ["--strict", "--follow-imports", "silent", "--explicit-package-bases", "--cache-dir", ".mypy_cache/strict"]


def strict_errors(mypy: str) -> collections.Counter[str]:
    """Errors per file (paths relative to the repository) of ``mypy --strict`` over both packages, with the
    project's plugins and paths but none of its per-module relaxations."""
    config = ROOT / ".types_share.ini"
    config.write_text("[mypy]\nplugins = pydantic.mypy\nmypy_path = operator:runtime:.\npython_version = 3.11\n"
                      "untyped_calls_exclude = redis.cluster,kubernetes\n"
                      "[mypy-tqdm.*,tqdm,huggingface_hub,huggingface_hub.*,vllm.*,transformers.*]\n"
                      "ignore_missing_imports = True\n")
    try:
        out = subprocess.run([mypy, "--config-file", str(config), *STRICT, *PACKAGES], cwd=ROOT, capture_output=True,
                             text=True, timeout=600).stdout
    finally:
        config.unlink(missing_ok=True)
    errors: collections.Counter[str] = collections.Counter()
    for line in out.splitlines():
        m = re.match(r"^([^:]+\.py):\d+: error", line)
        if m:
            errors[m.group(1)] += 1
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min", type=float, default=0.0, help="fail below this share (0..1)")
    parser.add_argument("--mypy", default=str(Path(sys.executable).parent / "mypy"))
    args = parser.parse_args(argv)
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}
    errors = strict_errors(args.mypy)
    total = sum(lines.values())
    clean = sum(n for path, n in lines.items() if not errors.get(path))
    share = clean / total
    worst = ", ".join(f"{path} ({n})" for path, n in sorted(errors.items(), key=lambda kv: -lines.get(kv[0], 0)))
    print(f"mypy --strict: {share:.1%} of the product's {total} lines are in files with no error "
          f"({len(lines) - len(errors)} of {len(lines)} files){'; with errors: ' + worst if worst else ''}")
    if share < args.min:
        print(f"types_share: {share:.3f} is below the floor {args.min:.3f}: a change added strict errors",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
