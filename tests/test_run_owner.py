"""One owner per local installation (embshard.run_owner): a run whose `embshard pipeline` was killed outright
(kill -9, the OOM killer) is failed when the next pipeline or UI starts on the folder, instead of holding the
one-run-at-a-time queue for 24 h; `embshard pipeline` refuses to start beside a live `embshard ui` (whose scheduler
took its tasks) and the UI beside a live pipeline; the pipeline's failure names the task that failed first.

The fast tests use real processes and no Airflow; the slow one kills a real `embshard pipeline` (its ingest made
to hang) and reaps its run in a real Airflow metadata database, as `embshard ui` does before its scheduler starts.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from embshard import pipeline, run_owner
from embshard.airflow_local import LocalAirflow
from embshard.errors import EmbshardError

REPO = Path(__file__).resolve().parents[1]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW", "EMBSHARD_"))}
    env.update(AIRFLOW__CORE__LOAD_EXAMPLES="False", EMBSHARD_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "components"), os.environ.get("PYTHONPATH", "")]))
    return env


@pytest.fixture()
def own_folders(monkeypatch):
    """LocalAirflow's folders under its --out (already-set variables win over --out, as the session's do)."""
    for var in pipeline.OUT_FOLDERS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture()
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    time.sleep(0.2)  # its start time is set
    yield proc
    proc.kill()
    proc.wait()


def test_an_owner_is_alive_by_pid_and_start_time(sleeper):
    ident = run_owner.identity(sleeper.pid)
    assert run_owner.alive(ident)
    assert not run_owner.alive({**ident, "started": ident["started"] - 50})  # the pid reused by another process
    sleeper.kill()
    sleeper.wait()
    assert not run_owner.alive(ident) and not run_owner.alive(None) and not run_owner.alive({"pid": "x"})


def test_a_killed_uis_leftover_components_still_count_as_a_live_ui(tmp_path, sleeper):
    """A `kill -9` of `embshard ui` leaves its components (sessions of their own) running: still a scheduler."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    home = tmp_path / "airflow"
    run_owner._write(home / run_owner.UI, {"pid": int(dead.stdout), "started": 1.0, "url": "http://127.0.0.1:1",
                                           "components": {"scheduler": run_owner.identity(sleeper.pid)}})
    assert f"scheduler {sleeper.pid}" in run_owner.live_ui(home)
    sleeper.kill()
    sleeper.wait()
    assert run_owner.live_ui(home) is None


def test_the_pipeline_refuses_beside_a_live_ui_with_one_line_and_exit_2(tmp_path):
    out = tmp_path / "x"
    run_owner.write_ui(out / "airflow", "http://127.0.0.1:8094", {})  # this test process plays the UI
    proc = subprocess.run([sys.executable, "-m", "embshard", "pipeline", "--quick", "--out", str(out)],
                          capture_output=True, text=True, env=_clean_env(), timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    assert f"embshard ui (pid {os.getpid()}, http://127.0.0.1:8094) runs on this folder" in err[0]
    assert "trigger the run from that Airflow's UI or REST API instead" in err[0] and "another --out" in err[0]
    assert not (out / "data").exists() and not list((out / "airflow" / run_owner.OWNERS).glob("*.json"))
    run_owner.remove_ui(out / "airflow")
    assert not (out / "airflow" / run_owner.UI).exists()


def test_a_second_pipeline_on_the_folder_refuses_with_one_line_and_exit_2(tmp_path):
    """dag.test() ignores max_active_runs: two pipelines on one folder ran at once, both gates read "champion
    before none" and both promoted, the second candidate never measured against the first. The second now
    refuses before it writes anything (the folder's lock: a live pipeline holds it, a killed one does not)."""
    out = tmp_path / "x"
    home = out / "airflow"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO / "components")!r})
        from embshard import pipeline, run_owner
        with pipeline._one_pipeline({str(home)!r}, {str(out)!r}):
            run_owner.record_owner({str(home)!r}, "manual__2026-01-01T00:00:00+00:00")
            print("holding", flush=True)
            time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True, env=_clean_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        proc = subprocess.run([sys.executable, "-m", "embshard", "pipeline", "--quick", "--out", str(out)],
                              capture_output=True, text=True, env=_clean_env(), timeout=300)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        err = proc.stderr.strip().splitlines()
        assert len(err) == 1, proc.stderr
        assert (f"another `embshard pipeline` is running on this folder (pid {holder.pid}, run "
                "manual__2026-01-01T00:00:00+00:00); runs go one at a time") in err[0]
        assert "wait for it to end, or give another --out" in err[0]
        assert not (out / "data").exists() and not (out / "logs").exists()
    finally:
        holder.kill()
        holder.wait()
    # a killed holder leaves the lock free (the kernel releases it): the next pipeline may start
    with (pipeline._one_pipeline(str(home), str(out)),
          pytest.raises(EmbshardError, match="another `embshard pipeline` is running"),
          pipeline._one_pipeline(str(home), str(out))):
        pass


def test_the_ui_refuses_beside_a_live_pipeline_and_a_live_ui(tmp_path, own_folders):
    af = LocalAirflow(str(tmp_path / "x"), 18099)
    path = run_owner.record_owner(af.home, "manual__2026-01-01T00:00:00+00:00")  # this process plays the pipeline
    with pytest.raises(EmbshardError, match=r"embshard pipeline \(pid \d+\) is running run manual__2026"):
        af.start()
    run_owner.forget(path)
    run_owner.write_ui(af.home, "http://127.0.0.1:8080", {})
    with pytest.raises(EmbshardError, match="embshard ui .* runs on this folder"):
        af.start()
    assert not af.procs  # nothing started
    run_owner.remove_ui(af.home)


def _ti(task_id, state, end, map_index=-1):
    return SimpleNamespace(task_id=task_id, state=state, end_date=end, map_index=map_index)


def test_the_failure_summary_names_the_task_that_failed_first():
    """A task that failed in another process (no reason recorded here) is named; upstream_failed ones follow."""
    from datetime import datetime

    tis = [_ti("check_params", "success", datetime(2026, 1, 1, 0, 0)),
           _ti("train_cost_model", "upstream_failed", None),
           _ti("benchmark", "failed", datetime(2026, 1, 1, 0, 5), 1),
           _ti("benchmark", "failed", datetime(2026, 1, 1, 0, 3), 0),
           _ti("export_placements", None, None)]
    text = pipeline.failure_summary(tis, [])
    assert text.startswith("benchmark[0] failed first (its log says why); 4 tasks not successful: "), text
    assert "train_cost_model upstream_failed" in text and "export_placements not run" in text
    assert pipeline.failure_summary(tis, [("benchmark[1]", "x"), ("benchmark[0]", "disk full")]).startswith(
        "benchmark[0] failed first: disk full;")


def test_a_failed_runs_summary_says_when_its_gate_had_already_moved_an_alias(tmp_path):
    """A run killed during export_placements had promoted its candidate: the red run now says so (a training job
    loading @champion already gets the new version)."""
    import json

    (tmp_path / "state").mkdir()
    assert pipeline._moved_before_failing(str(tmp_path)) == ""
    (tmp_path / "state" / "promotion.json").write_text(json.dumps({"candidate_version": "8", "verdict": "promoted",
                                                                   "promoted": True}))
    text = pipeline._moved_before_failing(str(tmp_path))
    assert "its gate had already promoted version 8 to champion" in text and "embshard champion --set" in text
    (tmp_path / "state" / "promotion.json").write_text(json.dumps({"candidate_version": "9", "verdict": "undecided",
                                                                   "promoted": False}))
    assert "version 9 the challenger" in pipeline._moved_before_failing(str(tmp_path))


# --- a real pipeline killed outright ----------------------------------------------------------------------------
HANGING = textwrap.dedent("""
    import sys, time
    from embshard import pipeline, stages
    def hang(root, params):
        from embshard import registry
        registry.use()
        registry.start_run(run_name="hung")  # left RUNNING by the kill below
        from embshard.run_context import progress
        progress("hung: its MLflow run is open")
        time.sleep(300)  # a long stage, killed below
    stages.STAGES["ingest"] = hang
    pipeline.run(sys.argv[1], {})
""")

# A run the UI's scheduler would run (triggered over REST), left running: reap() must not touch it.
SCHEDULERS_RUN = textwrap.dedent("""
    import sys
    from embshard import pipeline
    from airflow.models.dagrun import DagRun, get_or_create_dagrun
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils import timezone
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType
    dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(pipeline.load_dag()))
    now = timezone.utcnow()
    with create_session() as session:
        run = get_or_create_dagrun(dag=dag, run_id=DagRun.generate_run_id(run_type=DagRunType.MANUAL,
                                   logical_date=None, run_after=now), logical_date=None, data_interval=None,
                                   run_after=now, start_date=now, conf={}, triggered_by=DagRunTriggeredByType.REST_API,
                                   triggering_user_name="admin", session=session)
        run.set_state(DagRunState.RUNNING)
        session.merge(run)
    print(run.run_id)
""")


@pytest.mark.slow
def test_a_run_whose_pipeline_was_killed_is_failed_when_the_ui_starts(tmp_path, own_folders):
    out = tmp_path / "x"
    home = out / "airflow"
    lines: list[str] = []
    af = LocalAirflow(str(out), 18098, notify=lines.append)
    proc = subprocess.Popen([sys.executable, "-c", HANGING, str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_clean_env(), cwd=str(REPO))
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the stages' progress lines
            if "hung: its MLflow run is open" in line:
                break
        owners = run_owner.owners(home)
        assert len(owners) == 1 and run_owner.alive(next(iter(owners.values())))
        run_id = next(iter(owners))
        with pytest.raises(EmbshardError, match=f"embshard pipeline \\(pid {proc.pid}\\) is running run"):
            af.start()  # a UI does not start beside the live pipeline
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    env = {**_clean_env(), **af.env}
    theirs = subprocess.run([sys.executable, "-c", SCHEDULERS_RUN], env=env, capture_output=True, text=True,
                            cwd=str(REPO), timeout=300)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    rest_run = theirs.stdout.strip().splitlines()[-1]
    with sqlite3.connect(f"file:{home / 'airflow.db'}?mode=ro", uri=True) as db:
        before = dict(db.execute("select run_id, state from dag_run"))
    assert before == {run_id: "running", rest_run: "running"}

    af._reap(env)  # what `embshard ui` does before its scheduler starts

    assert len(lines) == 2, lines
    assert f"marked run {run_id} failed, with its tasks under way (ingest)" in lines[0]
    assert "marked its 1 MLflow run(s) left running KILLED" in lines[1]
    assert f"its owner, embshard pipeline pid {proc.pid}" in lines[0] and "is gone" in lines[0]
    assert lines[0] in (home / "logs" / "scheduler.log").read_text()
    with sqlite3.connect(f"file:{home / 'airflow.db'}?mode=ro", uri=True) as db:
        runs = dict(db.execute("select run_id, state from dag_run"))
        tasks = dict(db.execute("select task_id, state from task_instance where run_id = ? and state is not null",
                                (run_id,)))
    assert runs == {run_id: "failed", rest_run: "running"}  # the scheduler's run untouched
    assert tasks == {"check_params": "success", "ingest": "failed"}
    assert run_owner.owners(home) == {}  # the dead owner's record is gone
    import mlflow

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    hung = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(r.info.run_name, r.info.status, r.data.tags["airflow.task_id"]) for r in hung] == [
        ("hung", "KILLED", "ingest")]
    assert "embshard pipeline that ran it is gone" in hung[0].data.tags["embshard.end_reason"]
    lines.clear()
    af._reap(env)
    assert lines == []  # once
