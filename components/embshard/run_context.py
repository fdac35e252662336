"""What a stage knows about the orchestrator that runs it, and how it talks to it.

- Lineage: the Airflow dag id, run id, task id and run root travel as environment variables (set by the DAG's
  local tasks, and templated into the pods of the kubernetes runner), so every MLflow run and model version
  can be traced back to the Airflow task that made it (`mlflow_tags()`).
- Logs: an Airflow task logs what a stage writes to stderr as ERROR. Progress bars (tqdm) and MLflow's INFO
  lines go there by default, so inside a task they are routed to stdout (`stage_output()`); real failures still
  reach Airflow as the task's exception.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

# Environment variable -> MLflow tag.
LINEAGE = {
    "EMBSHARD_AIRFLOW_DAG_ID": "airflow.dag_id",
    "EMBSHARD_AIRFLOW_RUN_ID": "airflow.run_id",
    "EMBSHARD_AIRFLOW_TASK_ID": "airflow.task_id",
    "EMBSHARD_AIRFLOW_TRY_NUMBER": "airflow.try_number",
    "EMBSHARD_RUN_ROOT": "embshard.run_root",
}


def lineage_env(dag_id: str, run_id: str, task_id: str, run_root: str, try_number: int | str | None = None) -> dict:
    env = {"EMBSHARD_AIRFLOW_DAG_ID": dag_id, "EMBSHARD_AIRFLOW_RUN_ID": run_id,
           "EMBSHARD_AIRFLOW_TASK_ID": task_id, "EMBSHARD_RUN_ROOT": run_root}
    if try_number is not None:
        env["EMBSHARD_AIRFLOW_TRY_NUMBER"] = str(try_number)
    return env


def mlflow_tags() -> dict[str, str]:
    """The lineage tags of the current process: the Airflow ids (none outside Airflow) and the code version."""
    from .version import code_version

    return {**{tag: os.environ[var] for var, tag in LINEAGE.items() if os.environ.get(var)},
            "embshard.code_version": code_version()}


PROGRESS_FD = "EMBSHARD_PROGRESS_FD"


def progress(line: str) -> None:
    """One line for the person who started `embshard pipeline` (its terminal, while the libraries' logs go to a
    file); a no-op in any other process (a real scheduler's tasks log to Airflow instead)."""
    fd = os.environ.get(PROGRESS_FD)
    if fd:
        with contextlib.suppress(OSError):
            os.write(int(fd), (line + "\n").encode())


class _WarningsToProgress(logging.Handler):
    """embshard's WARNING records as progress lines (a no-op outside `embshard pipeline`, as progress is)."""

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            progress(f"    warning: {record.getMessage()}")


class _Lines:
    """A text stream that turns a progress bar's carriage-return redraws into log lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        for line in text.replace("\r", "\n").split("\n"):
            if line.strip():
                self.stream.write(line.rstrip() + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def _bars_to(stream) -> Iterator[None]:
    """stderr (where progress bars draw) as lines on `stream`, the bars refreshed every 15 s: a log gets lines,
    not carriage-return redraws piled on one line."""
    old = os.environ.get("TQDM_MININTERVAL")
    os.environ.setdefault("TQDM_MININTERVAL", "15")
    try:
        with contextlib.redirect_stderr(_Lines(stream)):
            yield
    finally:
        if old is None:
            os.environ.pop("TQDM_MININTERVAL", None)


@contextlib.contextmanager
def bars_as_lines() -> Iterator[None]:
    """A command whose stderr is not a terminal (a log file, a CI job): its progress bars as lines, as in a stage."""
    if sys.stderr.isatty():
        yield
        return
    with _bars_to(sys.stderr):
        yield


@contextlib.contextmanager
def stage_output(env: dict[str, str] | None = None) -> Iterator[None]:
    """Run a stage inside an Airflow task: lineage in the environment, progress and library INFO on stdout,
    progress bars as lines (_bars_to)."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    # embshard's warnings also reach the console of `embshard pipeline` (progress): a calibration made on a busy
    # machine, kept for every later run, was said only in the log file.
    to_console = _WarningsToProgress()
    logging.getLogger("embshard").addHandler(to_console)
    try:
        with _bars_to(sys.stdout):
            yield
    finally:
        logging.getLogger("embshard").removeHandler(to_console)
        sys.stdout.flush()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
