"""Process checks shared by the end-to-end tests: what a scenario left running."""
from __future__ import annotations

import os
import signal
from pathlib import Path


def processes_mentioning(text: str) -> list[str]:
    """Live processes whose command line contains ``text`` (the scenario's work directory)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(f"{pid}: {cmdline[:200]}")
    return found


def like_a_terminal_job() -> None:
    """``preexec_fn`` for a child a test will Ctrl-C: SIGINT and SIGQUIT at their defaults, as in a terminal's
    foreground job. A suite started in the background by a non-interactive shell (``cmd &``, ``nohup``) inherits
    them ignored, and Python then installs no KeyboardInterrupt handler, so the signal would be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
