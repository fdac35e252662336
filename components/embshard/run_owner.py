"""Who owns the runs of a local installation (one `--out`): `embshard pipeline` records itself as the owner of the
dag.test() run it starts and `embshard ui` records its processes, so that each refuses to start beside the other,
and both fail, as they start, the dag.test() runs whose owner is gone.

dag.test() runs every task inside the `embshard pipeline` process, with no scheduler and no heartbeat: after
`kill -9` or the OOM killer its run stayed `running`, a task `running`, for good, and as runs go one at a time
(max_active_runs=1) a later `embshard ui` on the folder queued every new run behind it until the 24 h
dagrun_timeout (Ctrl-C and SIGTERM are handled in the process: pipeline._fail_interrupted_run). Only runs that
dag.test() made (triggered_by TEST) are ever failed here: a scheduler's runs are its own, and it adopts or times
out their orphaned tasks itself. A pid can be reused: an owner is alive while a process with its pid and its
start time runs.

A scheduler on the same database as `embshard pipeline` took the dag.test() run's tasks too (the run failed with
its real failure unnamed, max_active_runs bypassed): the pipeline refuses to start while one runs.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

OWNERS = "embshard-owners"  # under AIRFLOW_HOME: one <run id>.json per run an `embshard pipeline` runs
UI = "embshard-ui.json"  # under AIRFLOW_HOME: the `embshard ui` running there and its components
DAG_TEST = "TEST"  # DagRun.triggered_by of the runs dag.test() makes (DagRunTriggeredByType.TEST)


def identity(pid: int | None = None) -> dict:
    """A process as {pid, started}: its start time tells it apart from a later process given the same pid."""
    import psutil

    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "started": psutil.Process(pid).create_time()}


def alive(ident: dict | None) -> bool:
    """Whether the process `ident` (identity()) still runs: same pid, same start time, not a zombie."""
    import psutil

    if not ident or not isinstance(ident.get("pid"), int):
        return False
    try:
        proc = psutil.Process(ident["pid"])
        return (abs(proc.create_time() - float(ident.get("started", -1))) < 1.0
                and proc.status() != psutil.STATUS_ZOMBIE)
    except (psutil.Error, TypeError, ValueError):
        return False


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # gone meanwhile, or cut short by a kill while written
        return None
    return data if isinstance(data, dict) else None


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a record


def _owner_path(home: str | os.PathLike, run_id: str) -> Path:
    return Path(home) / OWNERS / (re.sub(r"[^A-Za-z0-9_.-]", "_", run_id) + ".json")


def record_owner(home: str | os.PathLike, run_id: str) -> Path:
    """Record this process as the owner of `run_id` (before dag.test() creates the run); forget() it at the end."""
    path = _owner_path(home, run_id)
    _write(path, {"run_id": run_id, **identity(), "command": " ".join(sys.argv[:4])})
    return path


def forget(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def owners(home: str | os.PathLike) -> dict[str, dict]:
    """run id -> owner record, for every record under `home` (live or not)."""
    found: dict[str, dict] = {}
    for path in sorted((Path(home) / OWNERS).glob("*.json")):
        data = _read(path)
        if data and isinstance(data.get("run_id"), str):
            found[data["run_id"]] = {**data, "path": str(path)}
    return found


def live_pipelines(home: str | os.PathLike) -> list[dict]:
    """The owner records of `embshard pipeline` processes that still run."""
    return [o for o in owners(home).values() if alive(o)]


# --- embshard ui ------------------------------------------------------------------------------------------------
def write_ui(home: str | os.PathLike, url: str, components: dict[str, int]) -> None:
    """Record this process as the `embshard ui` of `home`, with its components (name -> pid)."""
    comps = {}
    for name, pid in components.items():
        with contextlib.suppress(Exception):  # one that already exited is not worth recording
            comps[name] = identity(pid)
    _write(Path(home) / UI, {**identity(), "url": url, "components": comps})


def remove_ui(home: str | os.PathLike) -> None:
    """Remove the UI record of `home` when it is this process's."""
    path = Path(home) / UI
    data = _read(path)
    if data is not None and data.get("pid") == os.getpid():
        forget(path)


def live_ui(home: str | os.PathLike) -> str | None:
    """What of an `embshard ui` still runs on `home` (its own process, or components a killed UI left), in words;
    None when nothing does."""
    data = _read(Path(home) / UI)
    if data is None:
        return None
    url = data.get("url", "?")
    if alive(data):
        return f"embshard ui (pid {data.get('pid')}, {url}) runs on this folder"
    comps = {name: c for name, c in (data.get("components") or {}).items() if isinstance(c, dict) and alive(c)}
    if comps:
        pids = ", ".join(f"{name} {c['pid']}" for name, c in comps.items())
        return f"airflow components an embshard ui ({url}) left when it died still run on this folder ({pids})"
    return None


# --- with Airflow's metadata database (Airflow imported with this home's config) -------------------------------
def live_scheduler(session) -> str | None:
    """A scheduler that heartbeats into this database (a UI's, or one started by hand), in words; else None."""
    from airflow.jobs.job import Job
    from airflow.utils.state import JobState

    for job in session.query(Job).filter(Job.job_type == "SchedulerJob", Job.state == JobState.RUNNING):
        if job.is_alive():
            return (f"an Airflow scheduler (job {job.id} on {job.hostname}, last heartbeat "
                    f"{job.latest_heartbeat:%H:%M:%S} UTC) runs on this folder's database")
    return None


def task_label(ti) -> str:
    """A task instance as the console names it: its id, with [N] for a mapped one (benchmark[0])."""
    return ti.task_id + (f"[{ti.map_index}]" if ti.map_index is not None and ti.map_index >= 0 else "")


def fail_run(session, run) -> list[str]:
    """Fail the DagRun `run` and its task instances that were under way (running, queued, scheduled, up for
    retry ...: never to run now); tasks not started stay unrun. Returns the failed tasks' labels."""
    from airflow.utils.state import DagRunState, State, TaskInstanceState

    failed = []
    for ti in run.get_task_instances(session=session):
        if ti.state is not None and ti.state not in State.finished:
            ti.set_state(TaskInstanceState.FAILED, session=session)
            failed.append(task_label(ti))
    run.set_state(DagRunState.FAILED)
    session.merge(run)
    session.commit()
    return failed


def reap(dag_id: str, home: str | os.PathLike, session=None) -> list[str]:
    """Fail every running dag.test() run of `dag_id` whose owner (record_owner) is gone, with its running tasks;
    one line per run, saying which and why. Runs a scheduler made are never touched; nor runs of a live owner."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState

    recorded = owners(home)
    lines = []
    with contextlib.ExitStack() as stack:
        if session is None:
            session = stack.enter_context(create_session())
        runs = session.query(DagRun).filter(DagRun.dag_id == dag_id,
                                            DagRun.state.in_([DagRunState.RUNNING, DagRunState.QUEUED])).all()
        for run in runs:
            if str(getattr(run.triggered_by, "name", run.triggered_by)).upper() != DAG_TEST:
                continue  # a scheduler's run (UI, REST, schedule, asset): the scheduler looks after it
            owner = recorded.get(run.run_id)
            if alive(owner):
                continue
            if owner is None:
                who = ("no owner was recorded (an embshard pipeline older than owner records, or another "
                       "dag.test() caller)")
            else:
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(owner.get("started", 0))))
                who = (f"its owner, embshard pipeline pid {owner.get('pid')} started {started}, is gone "
                       "(killed with SIGKILL, or by the out-of-memory killer?)")
            tasks = fail_run(session, run)
            lines.append(f"embshard: marked run {run.run_id} failed, with its tasks under way "
                         f"({', '.join(tasks) or 'none'}): it was left running and {who}; max_active_runs=1 "
                         "would have queued every new run behind it")
            ended = _end_mlflow_runs(dag_id, run.run_id)
            if ended:
                lines.append(f"embshard: marked its {len(ended)} MLflow run(s) left running KILLED "
                             f"({', '.join(ended)})")
            if owner is not None:
                forget(Path(owner["path"]))
    return lines


def _end_mlflow_runs(dag_id: str, airflow_run_id: str) -> list[str]:
    """The MLflow runs the dead run's stages left RUNNING, marked KILLED (registry.end_stale_runs), in the store and
    data root of this installation (MLFLOW_TRACKING_URI, EMBSHARD_DATA_ROOT: `embshard pipeline` and `embshard ui`
    set them); none without them."""
    uri, data_root = os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("EMBSHARD_DATA_ROOT")
    if not uri or not data_root:
        return []
    import mlflow

    from . import registry
    from .run_layout import run_root

    mlflow.set_tracking_uri(uri)
    return registry.end_stale_runs(airflow_run_id, dag_id=dag_id, run_root=run_root(data_root, airflow_run_id),
                                   reason=f"its Airflow run {airflow_run_id} was failed by embshard: the embshard "
                                   "pipeline that ran it is gone")


def main(argv: list[str] | None = None) -> int:
    """`python -m embshard.run_owner DAG_ID`: reap() in the environment of a local installation (what `embshard
    ui` runs before its scheduler starts: Airflow reads its home at import, which the UI process never does)."""
    args = sys.argv[1:] if argv is None else argv
    for line in reap(args[0], os.environ["AIRFLOW_HOME"]):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
