"""The operator's per-policy wake-ups (wakeups.py): nothing lost between waits, bursts coalesced, stop honoured."""
from __future__ import annotations

import asyncio
import time

from kvtier_operator.wakeups import Wakeups


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_trigger_before_the_wait_is_not_lost_and_a_burst_wakes_once():
    async def main():
        w = Wakeups()
        for _ in range(50):
            w.trigger("p")
        first = await w.wait("p", timeout=5)
        t0 = time.monotonic()
        second = await w.wait("p", timeout=0.2)
        return first, second, time.monotonic() - t0

    first, second, waited = run(main())
    assert first is True and second is False and waited >= 0.19


def test_keys_are_independent():
    async def main():
        w = Wakeups()
        w.trigger("a")
        return await w.wait("b", timeout=0.1), await w.wait("a", timeout=5)

    assert run(main()) == (False, True)


def test_trigger_later_coalesces_into_one_deferred_wakeup():
    async def main():
        w = Wakeups()
        t0 = time.monotonic()
        for _ in range(20):
            w.trigger_later("p", 0.2)
        woke = await w.wait("p", timeout=5)
        at = time.monotonic() - t0
        again = await w.wait("p", timeout=0.4)  # the 19 other calls added nothing
        return woke, at, again

    woke, at, again = run(main())
    assert woke and 0.18 <= at < 2 and again is False


def test_stop_ends_the_wait_and_forget_drops_a_pending_trigger():
    async def main():
        w = Wakeups()
        stop = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, stop.set_result, None)
        t0 = time.monotonic()
        stopped = await w.wait("p", timeout=5, stop=stop)
        elapsed = time.monotonic() - t0
        w.trigger("q")
        w.forget("q")
        return stopped, elapsed, await w.wait("q", timeout=0.05)

    stopped, elapsed, after_forget = run(main())
    assert stopped is False and elapsed < 1 and after_forget is False
