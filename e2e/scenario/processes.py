"""Every process the scenario starts, and stopping all of them: in reverse order, on success, failure, Ctrl-C or
SIGTERM. Children run in their own sessions, so a terminal's Ctrl-C reaches only the scenario, which then stops
them in order (operator before the API server it talks to). A scenario killed with SIGKILL cannot stop anything:
each child is started through ``setpriv --pdeathsig KILL``, so the kernel kills it when the scenario dies (the
control plane has its own owner watchdog; the slow device's leftovers are removed by the next run)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass
class Started:
    name: str
    process: subprocess.Popen
    log_path: Path
    grace_s: float = 10.0


class Supervisor:
    """Starts processes (logs to files) and registers clean-up callbacks; ``close()`` undoes everything."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self.errors: list[str] = []
        self.started: list[Started] = []

    def start(self, name: str, cmd: Sequence[str], log_path: Path, *, env: Optional[dict[str, str]] = None,
              cwd: Optional[Path] = None, grace_s: float = 10.0) -> Started:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(with_parent_death_signal(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=cwd, start_new_session=True)
        started = Started(name, proc, log_path, grace_s)
        self.started.append(started)
        self.on_close(name, lambda: stop_process(started))
        return started

    def on_close(self, name: str, undo: Callable[[], None]) -> None:
        self._undo.append((name, undo))

    def close(self) -> None:
        # Ctrl-C during clean-up must not leave half of it undone.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if _main_thread() else None
        try:
            while self._undo:
                name, undo = self._undo.pop()
                try:
                    undo()
                except Exception as err:
                    self.errors.append(f"stopping {name}: {err}")
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)


def with_parent_death_signal(cmd: Sequence[str]) -> list[str]:
    """``cmd``, killed by the kernel when the process that started it dies (util-linux setpriv; exec keeps the
    pid, so the process group and the stop below are unchanged). Without setpriv, ``cmd`` as is."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *cmd] if setpriv else list(cmd)


def stop_process(started: Started) -> None:
    """SIGTERM the process group, wait ``grace_s``, then SIGKILL it."""
    proc = started.process
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=started.grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def wait_http_ok(started: Started, url: str, timeout: float, interval: float = 0.2) -> None:
    """Poll ``url`` until it answers 200; a process that exits first fails at once, with its log."""
    deadline = time.monotonic() + timeout
    while True:
        if started.process.poll() is not None:
            raise ScenarioError(f"{started.name} exited with {started.process.returncode}:\n"
                                f"{tail(started.log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:  # refused while starting; URLError and HTTPError are OSErrors
            pass
        if time.monotonic() > deadline:
            raise ScenarioError(f"{started.name} not ready within {timeout:g}s ({url}):\n{tail(started.log_path)}")
        time.sleep(interval)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, turned into an exception so ``finally`` blocks run."""


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM/SIGHUP raise :class:`Terminated` (a KeyboardInterrupt) in the main thread."""
    if not _main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        raise Terminated(f"signal {signum}")

    saved = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path}: no log)"
    return "\n".join(text.splitlines()[-lines:])


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.25,
               on_tick: Optional[Callable[[], None]] = None) -> object:
    """Poll ``predicate`` until truthy; ``on_tick`` runs between polls (the demo prints its table there)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ScenarioTimeout(f"timed out after {timeout:g}s waiting for {what}")
        if on_tick is not None:
            on_tick()
        time.sleep(interval)


class ScenarioError(RuntimeError):
    pass


class ScenarioTimeout(ScenarioError):
    pass
