"""Finding the kvtier checkout: the scenario needs its ``e2e/`` folder (control plane build, synthetic engine)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

REPO_ENV = "KVTIER_REPO"
MARKERS = ("e2e/controlplane/run", "e2e/scenario/__main__.py", "e2e/synthetic_engine/engine.py")


class RepoNotFound(RuntimeError):
    pass


def is_checkout(path: Path) -> bool:
    return all((path / m).is_file() for m in MARKERS)


def find_repo(explicit: Optional[str] = None, cwd: Optional[Path] = None) -> Path:
    """``--repo``, then ``$KVTIER_REPO``, then the checkout this scenario lives in (run as
    ``PYTHONPATH=e2e``), then the current directory and its parents."""
    candidates: list[tuple[str, Path]] = []
    if explicit:
        candidates.append(("--repo", Path(explicit)))
    elif os.environ.get(REPO_ENV):
        candidates.append((f"${REPO_ENV}", Path(os.environ[REPO_ENV])))
    else:
        candidates.append(("the checkout this scenario lives in", Path(__file__).resolve().parents[2]))
        here = (cwd or Path.cwd()).resolve()
        candidates += [("the current directory", p) for p in (here, *here.parents)]
    for _, path in candidates:
        if is_checkout(path):
            return path.resolve()
    source, first = candidates[0]
    if explicit or os.environ.get(REPO_ENV):
        raise RepoNotFound(f"{source} {first}: not a kvtier checkout (needs {' and '.join(MARKERS)})")
    raise RepoNotFound("cannot find the kvtier checkout (its e2e/ folder runs the local control plane and the "
                       "synthetic engine); run from the checkout, or pass --repo PATH or set KVTIER_REPO")
