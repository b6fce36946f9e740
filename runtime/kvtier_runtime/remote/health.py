"""The remote tier's connection and health: whether the store may be asked now, the one reconnect that decides when a
store marked down is back, and what a store-level fault does (``down``, or three ``timeout``s in a row, mark it down
for a backoff; ``full`` pauses stores only). Lookups never wait for any of it: a store that is down or still
connecting answers a miss at once.

``auth`` (a wrong password, or an ACL refusal: a key outside the user's pattern, a command it may not send) is this
tier's fault, not the store's: the tier backs off the same way (state ``refused``: its lookups miss as ``auth``, its
stores are refused), but the store is reported up (it answers) and its connections are kept; the refusal is
``kvtier_runtime_remote_refused{tier}``. A store shared by many tenants' tiers is then not reported down by every
dashboard because one tenant's user is misconfigured."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..config import ConfigError
from ..tiers.backoff import Backoff
from .client import RemoteStore, failure_kind
from .tier_metrics import RemoteMetrics

__all__ = ["DOWN_KINDS", "TIMEOUTS_TO_DOWN", "StoreHealth"]

log = logging.getLogger("kvtier_runtime.remote")

# Faults that stop this tier at once: "down" (the store is unusable) and "auth" (the store refuses this tier's user);
# "timeout" needs TIMEOUTS_TO_DOWN in a row.
DOWN_KINDS = frozenset({"down", "auth"})
TIMEOUTS_TO_DOWN = 3


class StoreHealth:
    """``state``: "connecting" (at start and while a reconnect runs), "up", "down" or "refused" (the store refuses
    this tier's user; both until ``backoff`` ends; then the next question starts one reconnect on ``spawn``, the
    tier's probe thread, unless ``closed()``)."""

    def __init__(self, *, name: str, store: RemoteStore, metrics: RemoteMetrics, backoff: Backoff,
                 clock: Callable[[], float], spawn: Callable[[Callable[[], None]], object],
                 closed: Callable[[], bool]) -> None:
        self.name = name
        self.backoff = backoff
        self.state = "connecting"
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._spawn = spawn
        self._closed = closed
        self._lock = threading.Lock()
        self._timeouts = 0
        self._stores_paused_until = 0.0  # after "full": a full store is not sent more bytes for a while

    @property
    def up(self) -> bool:
        return self.state == "up"

    @property
    def store_answers(self) -> bool:
        """Whether the store itself is up (it answers, though it may refuse this tier)."""
        return self.state in ("up", "refused")

    @property
    def miss_reason(self) -> str:
        """Why a key fails while the tier may not ask the store: ``auth`` while refused, else ``down``."""
        return "auth" if self.state == "refused" else "down"

    def connect(self) -> None:
        """Start the first connection (on the probe thread)."""
        self._spawn(self.reconnect)

    def available(self) -> bool:
        """Whether the store may be asked now; when a down store's backoff ran out, start one reconnect."""
        if self.state == "up":
            return True
        if self.state in ("down", "refused") and not self.backoff.active and not self._closed():
            with self._lock:
                if self.state not in ("down", "refused"):
                    return False
                self.state = "connecting"
            try:
                self._spawn(self.reconnect)
            except RuntimeError:  # the probe thread is shut down: the tier is closing
                pass
        return False

    def store_refusal(self, up: bool) -> str:
        """Why a store is refused now ("down", "auth" while the store refuses this tier, "full" for a while after the
        store said it is full), or ""."""
        if not up:
            return self.miss_reason
        return "full" if self._clock() < self._stores_paused_until else ""

    def reconnect(self) -> None:
        self._store.reset()
        try:
            self._store.connect().ping()
        except ConfigError as exc:
            log.error("kvtier remote tier %s: %s; every lookup is a miss", self.name, exc)
            self.fault("auth", force=True)
            return
        except Exception as exc:
            kind = failure_kind(exc)
            if self.backoff.failures == 0:
                self._warn_unusable(exc, kind)
            self.fault(kind, force=True)
            return
        self.ok()
        log.info("kvtier remote tier %s: connected (%s mode)", self.name,
                 "cluster" if self._store.cluster else "standalone")

    def _warn_unusable(self, exc: Exception, kind: str) -> None:
        tls = self._store.describe_tls_failure(exc)
        if tls is not None:
            log.warning("kvtier remote tier %s: %s; lookups miss, retrying", self.name, tls)
        else:
            log.warning("kvtier remote tier %s: the store is unusable (%s: %s); lookups miss, retrying",
                        self.name, kind, exc)

    def ok(self) -> None:
        """A round trip succeeded: the store is up (and its fault counts reset)."""
        if self.state != "up" or self.backoff.failures or self._timeouts:
            with self._lock:
                refused = self.state == "refused"
                self.state = "up"
                self.backoff.success()
                self._timeouts = 0
            self._metrics.up(True)
            if refused:
                self._metrics.refused(False)

    def fault(self, kind: str, force: bool = False) -> None:
        """A store-level fault: ``down``/``auth`` (or forced) mark the store down at once; timeouts after
        TIMEOUTS_TO_DOWN in a row; ``full`` pauses stores only; any other kind is a fault of one key."""
        now = self._clock()
        if kind == "full":
            self._stores_paused_until = now + self.backoff.base_s
            return
        with self._lock:
            if kind == "timeout" and not force:
                self._timeouts += 1
                if self._timeouts < TIMEOUTS_TO_DOWN:
                    return
            if kind not in DOWN_KINDS and kind != "timeout" and not force:
                return
            delay = self.backoff.failure(now) or 0.0
            was_up = self.state == "up"
            self.state = "refused" if kind == "auth" else "down"
        if kind == "auth":
            # This tier's fault: the store answered (with a refusal), its connections are fine.
            self._metrics.up(True)
            self._metrics.refused(True)
            if was_up:
                log.warning("kvtier remote tier %s: the store refuses this tier's user (auth: a wrong password, or "
                            "an ACL that does not allow the scope's keys or the tier's commands: docs/remote.md); "
                            "lookups miss for %.1f s, then one reconnect", self.name, delay)
            return
        self._metrics.up(False)
        if was_up:
            log.warning("kvtier remote tier %s: store %s (%s); lookups miss for %.1f s, then one reconnect",
                        self.name, "down" if kind != "timeout" else "too slow", kind, delay)
        if kind != "timeout":
            self._store.reset()
