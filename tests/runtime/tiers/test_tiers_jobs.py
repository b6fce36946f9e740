"""The job queue each tier owns (kvtier_runtime.tiers.jobs.JobQueue), on its own: it knows its tier only by the
callbacks it is given, settles keys into results handed out once, expires late jobs, and closes its pools."""
from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from kvtier_runtime.tiers.jobs import JobQueue, JobResult


class _Errors:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def error(self, kind: str, n: int = 1) -> None:
        self.counts[kind] += n


def _queue(io_timeout_s: float = 5.0, **callbacks):
    errors, failures, completed = _Errors(), [], []
    q = JobQueue(name="unit", medium="test", io_timeout_s=io_timeout_s, errors=errors,
                 on_io_failure=lambda: failures.append(1), on_complete=completed.append, **callbacks)
    return q, errors, failures, completed


def test_a_job_finishes_once_every_key_and_the_submitter_settled():
    q, errors, failures, completed = _queue()
    job = q.new_job("store", [b"a", b"b"])
    q.settle(job, 0, True)
    q.settle(job, 1, False)
    assert q.get_finished() == [] and completed == [], "open until the submitter's own count is released"
    q.settle(job, None, True)
    (result,) = completed
    assert result == JobResult(job.job_id, "store", (b"a", b"b"), (True, False), {})
    assert q.get_finished() == [result] and q.get_finished() == [], "each result is handed out once"
    assert not failures and not errors.counts


def test_settle_locked_hands_the_result_to_on_complete_only_through_completed():
    q, _, _, completed = _queue()
    job = q.new_job("load", [b"k"])
    q.settle(job, None, True)
    with q.lock:
        result = q.settle_locked(job, 0, True)
    assert result is not None and completed == []
    q.completed(result)
    assert completed == [result]


def test_a_late_job_expires_with_its_keys_failed_as_timeout_and_counts_towards_the_tier():
    q, errors, failures, completed = _queue(io_timeout_s=0.05)
    job = q.new_job("load", [b"a", b"b"])
    q.settle(job, 0, True)
    q.settle(job, None, True)
    time.sleep(0.06)
    (result,) = q.get_finished()
    assert result.ok == (True, False) and result.errors == {1: "timeout"}
    assert errors.counts == {"timeout": 1} and failures == [1] and completed == [result]
    q.settle(job, 1, True)  # a task that finishes after the expiry changes nothing
    assert q.get_finished() == []


def test_a_job_may_be_given_its_own_deadline():
    q, *_ = _queue(io_timeout_s=0.05)
    job = q.new_job("store", [b"a"], timeout_s=30.0)
    q.settle(job, None, True)
    time.sleep(0.06)
    assert q.get_finished() == [], "not due yet: its deadline is its own"


def test_a_task_that_raises_fails_its_key_as_other_and_settles_it():
    q, errors, _, _ = _queue()
    job = q.new_job("store", [b"a"])

    def task(job, i):
        raise RuntimeError("boom")

    q.settled(task, job, 0)
    q.settle(job, None, True)
    (result,) = q.get_finished()
    assert result.ok == (False,) and result.errors == {0: "other"} and errors.counts == {"other": 1}


def test_run_each_settles_every_item_on_at_most_the_workers_given():
    # One pool task per worker drains the job's items (a task per small block cost as much as its I/O): every
    # item runs once, a raising one fails its key as "other", and no more than ``workers`` run at once.
    q, errors, _, _ = _queue()
    read_pool, _ = q.start_pools(8, 1)
    keys = [bytes([i]) for i in range(40)]
    job = q.new_job("load", keys)
    lock, running, peak, seen = threading.Lock(), [0], [0], []

    def task(job, i, key):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            seen.append(key)
        time.sleep(0.002)
        with lock:
            running[0] -= 1
        if i == 7:
            raise RuntimeError("boom")
        return i % 5 != 0

    q.run_each(read_pool, 3, task, job, [(i, k) for i, k in enumerate(keys)])
    q.settle(job, None, True)
    q.drain(timeout=10)
    (result,) = q.get_finished()
    assert sorted(seen) == keys and peak[0] <= 3
    assert result.ok == tuple(i % 5 != 0 and i != 7 for i in range(40)) and result.errors == {7: "other"}
    assert errors.counts == {"other": 1}
    q.run_each(read_pool, 3, task, job, [])  # nothing to run: no task is submitted
    q.close()


def test_close_drains_shuts_the_pools_and_refuses_new_work_by_name():
    q, *_ = _queue()
    read_pool, write_pool = q.start_pools(1, 1)
    job = q.new_job("store", [b"a"])
    started = threading.Event()

    def task(job, i):
        started.set()
        time.sleep(0.05)
        return True

    write_pool.submit(q.settled, task, job, 0)
    q.settle(job, None, True)
    started.wait(5)
    q.close()
    assert q.closed and [r.ok for r in q.get_finished()] == [(True,)]
    with pytest.raises(RuntimeError, match=r"^unit: the test tier is closed$"):
        q.check_open()
    with pytest.raises(RuntimeError):
        read_pool.submit(lambda: None)
    q.close()  # a second close is a no-op


def test_close_releases_what_the_tier_handed_it_once_after_the_pools_stopped_in_order():
    q, *_ = _queue()
    _, write_pool = q.start_pools(1, 1)
    released = []

    def release(what):
        with pytest.raises(RuntimeError):  # the pools are shut down first: nothing may start after a release
            write_pool.submit(lambda: None)
        released.append(what)

    q.at_close(lambda: release("probe thread"))
    q.at_close(lambda: release("connections"))
    assert released == []
    q.close()
    q.close()
    assert released == ["probe thread", "connections"]


def test_drain_raises_when_jobs_outlive_its_timeout():
    q, *_ = _queue(io_timeout_s=30.0)
    job = q.new_job("load", [b"a"])
    q.settle(job, None, True)
    with pytest.raises(TimeoutError, match="1 jobs still running after 0.05s"):
        q.drain(timeout=0.05)
