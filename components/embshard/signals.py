"""SIGTERM stops embshard as Ctrl-C does (`kill`, `timeout`, systemd, a CI cancel, Kubernetes deleting a pod).

Python's default for SIGTERM ends the process at once: MLflow runs stay RUNNING and no `finally` runs. Airflow's
task runner replaces the handler with one that only calls the operator's on_kill() and goes on, so a pipeline
run under `dag.test()` finished every stage, and promoted a champion, after it was told to stop. Here SIGTERM
and SIGINT raise KeyboardInterrupt, which every command handles (context managers close, MLflow runs end
failed, the exit code is 128 + the signal), and record the signal (`received`): Airflow's task runner takes a
task's KeyboardInterrupt for a failed try and goes on, so the pipeline also stops between tasks when a signal
was received (pipeline._stop_between_tasks)."""
from __future__ import annotations

import contextlib
import signal

received: int | None = None  # the last signal turned into KeyboardInterrupt here (None: none yet)


def _interrupt(signum, frame):  # noqa: ARG001 (a signal handler's signature)
    interrupt(signum)


def interrupt(signum: int = signal.SIGTERM) -> None:
    """Stop the command as the handler does: record `signum`, raise KeyboardInterrupt. For a handler of another
    library that only calls back (Airflow's task runner answers SIGTERM with the task's on_kill())."""
    global received
    received = signum
    raise KeyboardInterrupt


def stop_on_sigterm(fresh: bool = False) -> None:
    """From now on SIGTERM and SIGINT raise KeyboardInterrupt and are recorded (in the main thread; elsewhere
    no handler can be installed). `fresh`: a command starts, so no signal was received yet (commands run in one
    process one after another in tests and notebooks)."""
    import threading

    global received
    if fresh:
        received = None
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGINT, _interrupt)


@contextlib.contextmanager
def deferred():
    """SIGTERM and SIGINT wait for the end of the block (then stop the command as they do elsewhere): for writes
    that must not be cut in two, e.g. a champion's two aliases (a kill between them had left `embshard-policy` and
    `embshard-cost` naming versions of different runs). SIGKILL cannot be deferred. Main thread only (elsewhere
    no handler can be installed: the block runs as it is)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: pending.append(signum))  # noqa: ARG005
              for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if pending:
            signal.raise_signal(pending[0])  # handled as it would have been without the block


def exit_code() -> int:
    """128 + the signal that stopped the process: 143 after SIGTERM, else 130 (Ctrl-C)."""
    return 128 + (received if received is not None else int(signal.SIGINT))
