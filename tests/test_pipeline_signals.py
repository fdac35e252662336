"""`kill` (SIGTERM) stops `embshard pipeline` as Ctrl-C does. Airflow's task runner swallows SIGTERM (it only
calls on_kill) and takes a stage's KeyboardInterrupt for a failed, retried try, so a run went on to promote a
champion after it was told to stop (embshard.signals, pipeline._stop_between_tasks)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def test_sigterm_stops_the_pipeline_before_it_promotes(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "AIRFLOW", "EMBSHARD_"))}
    proc = subprocess.Popen([sys.executable, "-m", "embshard", "pipeline", "--quick", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the stages' progress lines
            lines.append(line)
            if "benchmark[" in line:  # a stage done: the next is running
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + rest
    assert proc.returncode == 143, (text, err)
    assert "terminated" in err and "success" not in text, (text, err)
    # Nothing after the stopped stage ran: no cost model, no gate, no promotion.
    roots = list((out / "data").iterdir())
    assert len(roots) == 1
    assert not (roots[0] / "state" / "promotion.json").exists()
    assert not (roots[0] / "state" / "cost_model.json").exists()
    # The Airflow run is failed, not left running: `embshard ui` on the same folder resumed it and promoted.
    import sqlite3

    with sqlite3.connect(out / "airflow" / "airflow.db") as db:
        assert [s for (s,) in db.execute("select state from dag_run")] == ["failed"]
        # ... and so is the task it stopped, not left `running`; its owner record is gone (embshard.run_owner).
        assert "running" not in [s for (s,) in db.execute("select state from task_instance")]
    assert not list((out / "airflow" / "embshard-owners").glob("*.json"))


def test_a_deferred_block_finishes_before_a_sigterm_stops_the_command():
    """`champion --set` moves two aliases; a SIGTERM between them had left them naming versions of different runs.
    Inside signals.deferred() the signal waits for the end of the block, then stops the command as usual."""
    import signal as sig

    from embshard import signals

    signals.stop_on_sigterm(fresh=True)
    done = []
    try:
        with pytest.raises(KeyboardInterrupt), signals.deferred():
            os.kill(os.getpid(), sig.SIGTERM)
            done.append("first")
            done.append("second")
        assert done == ["first", "second"] and signals.exit_code() == 143
    finally:
        sig.signal(sig.SIGTERM, sig.SIG_DFL)
        sig.signal(sig.SIGINT, sig.default_int_handler)


def test_a_sigterm_while_airflows_handler_is_installed_stops_the_pipeline():
    """Airflow's task runner installs, as each task starts, a SIGTERM handler that only calls the task's on_kill()
    and goes on, and leaves it installed: a SIGTERM in the task runner's own work or between tasks (most of a run
    of many short tasks) was ignored, and the run finished and promoted. Under _stop_between_tasks on_kill stops
    the command, and embshard's handler is put back after each task. (The task below stands in for
    `airflow.sdk.execution_time.task_runner.run`, whose handler calls `ti.task.on_kill()` and nothing else; the
    end-to-end stop of a real run is the test above.)"""
    import signal as sig

    from airflow.sdk.bases.operator import BaseOperator
    from airflow.sdk.definitions import dag as dag_module

    from embshard import pipeline, signals

    signals.stop_on_sigterm(fresh=True)
    seen = []

    class Task:  # an operator as the task runner's handler uses it: its on_kill is BaseOperator's
        def on_kill(self):
            return BaseOperator.on_kill(self)

    def fake_run_task(**kwargs):
        """What the task runner does as a task starts: its own handler, calling the task's on_kill() only."""
        task = Task()
        sig.signal(sig.SIGTERM, lambda signum, frame: task.on_kill())
        seen.append("started")
        os.kill(os.getpid(), sig.SIGTERM)  # arrives while Airflow's handler is the one installed
        seen.append("went on")  # what happened before: the task, and the run, went on
        return "done"

    original, own_kill = dag_module._run_task, BaseOperator.__dict__["on_kill"]
    dag_module._run_task = fake_run_task
    try:
        with pipeline._stop_between_tasks():
            with pytest.raises(KeyboardInterrupt):
                dag_module._run_task(ti=None, task=None)
            assert seen == ["started"] and signals.exit_code() == 143
            # after a task, embshard's handler is back: a SIGTERM between tasks stops the command too
            assert sig.getsignal(sig.SIGTERM) is signals._interrupt
        # the patches live only inside the block
        assert BaseOperator.__dict__["on_kill"] is own_kill and dag_module._run_task is fake_run_task
    finally:
        dag_module._run_task = original
        sig.signal(sig.SIGTERM, sig.SIG_DFL)
        sig.signal(sig.SIGINT, sig.default_int_handler)
