"""End-to-end pieces that run beside the other tests (issue 23): the benchmark harness, the DAG guard runs, a real
pipeline run, a real Airflow. Each spends its time in processes of its own, so it starts once collection is done,
in one background thread of the session, while the fast tests run on the other core; the tests that use it run
last (conftest orders them as their jobs are queued) and their fixture waits for its result.

A job is registered under the name of the fixture that consumes it: it is queued only where a selected test uses
that fixture, and a fixture asking for a job that has not started yet runs it itself.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable

_jobs: dict[str, tuple[int, Callable[[], object]]] = {}
# Jobs whose own outcome rests on timings (a pipeline whose gate must promote on one measured task): run alone,
# when their tests come, after every queued job has finished (a fresh-clone run once measured such a gate 2.5%
# slower while tests ran beside it, and it did not promote).
_alone: set[str] = set()
_at_end: list[Callable[[], None]] = []
_futures: dict[str, concurrent.futures.Future] = {}
# One worker: the jobs share the second core one after the other rather than all of them crowding it.
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="embshard-tests-background")
# The session's measured world (conftest.measured_world: real kernel timings that the session's cost model, policy
# and promotion tests learn from) is measured before any job starts: a pipeline or Airflow run on the other core
# perturbs those timings (a fresh-clone run once trained a flat cost model from them and failed three tests).
GATE_FIXTURE = "measured_world"
GATE_TIMEOUT_S = 1200.0
_gate = threading.Event()
# The session's environment when the jobs were queued: a job reads this, never os.environ, which the tests running
# beside it change (monkeypatch) while it runs.
ENV: dict[str, str] = dict(os.environ)


def job(fixture: str, order: int, alone: bool = False):
    """Register fn as the job that fixture `fixture` waits for (by that name: the name is how a selected test is
    found to need it); jobs are queued by `order`; `alone`: not queued, run by its fixture with nothing beside it."""
    def register(fn: Callable[[], object]) -> Callable[[], object]:
        _jobs[fixture] = (order, fn)
        if alone:
            _alone.add(fixture)
        return fn
    return register


def at_end(fn: Callable[[], None]) -> Callable[[], None]:
    """Register fn to run when the session ends (a failure, -x or Ctrl-C can end it before a job's tests ran)."""
    _at_end.append(fn)
    return fn


def rank(fixtures: list[str]) -> int:
    """Where a test runs: 0 (first) unless it waits for a job, then after the tests of the jobs queued before."""
    return max([1 + _jobs[f][0] for f in fixtures if f in _jobs], default=0)


def start(fixtures_used: set[str]) -> None:
    """Queue the jobs that a selected test needs, behind the gate when a selected test measures the world."""
    ENV.clear()
    ENV.update(os.environ)
    if GATE_FIXTURE in fixtures_used:
        _pool.submit(_gate.wait, GATE_TIMEOUT_S)  # one worker: every job queues behind it
    else:
        _gate.set()
    for name, (_, fn) in sorted(_jobs.items(), key=lambda kv: kv[1][0]):
        if name in fixtures_used and name not in _futures and name not in _alone:
            _futures[name] = _pool.submit(fn)


def result(fixture: str):
    """The job's result (its exception re-raised); run here if it was never queued or has not started yet."""
    fut = _futures.get(fixture)
    if fixture in _alone and fut is None:
        concurrent.futures.wait(list(_futures.values()))  # nothing runs beside it
    if fut is None or fut.cancel():
        _futures[fixture] = fut = concurrent.futures.Future()
        try:
            fut.set_result(_jobs[fixture][1]())
        except BaseException as exc:  # kept, so that every test using it sees the same failure
            fut.set_exception(exc)
    return fut.result()


def open_gate() -> None:
    """The measured world is built (or failed): the jobs may start."""
    _gate.set()


def finish() -> None:
    """Drop the jobs not started yet, then run the at_end functions (a job still running ends on its own)."""
    _gate.set()  # a gate still closed would hold the worker
    _pool.shutdown(wait=False, cancel_futures=True)
    for fn in _at_end:
        fn()
