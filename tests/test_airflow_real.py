"""The DAG under a real Airflow: api-server, scheduler (LocalExecutor), DAG processor and triggerer as separate
processes on 127.0.0.1 (embshard.airflow_local, what `make ui` starts), a run triggered through the REST API, every
task run by the task supervisor in its own process (not dag.test()).

It checks what dag.test() cannot: helpers that re-import the entry point die under the supervisor, every stage
must find the run's one data root and one MLflow store, the trigger form must submit with its defaults, and
progress must not reach the task logs as ERROR lines. The browser test is skipped where Debian's chromium is
absent.

Airflow starts and both runs go in the background from the session's start (tests/background.py); the tests here
run last and check what the runs left.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import background
import pytest

from embshard import stages

pytestmark = pytest.mark.slow
pytest.importorskip("airflow", reason="airflow extra")

# A tiny run: 2 devices, 6-10 tables per task, one evaluated task, one outer round.
TINY = {"num_tables": 40, "hot_large_fraction": 0.0, "num_tasks": 2, "tables_per_task": "6-10", "devices": 2,
        "memory_gb": 256, "bench_shards": 16, "bench_chunks": 2, "bench_batch_size": 256, "policy_iterations": 10,
        "policy_rounds": 1, "eval_tasks": 1, "eval_planners": ["dim_greedy", "size_lookup_greedy"]}
ENV = ("AIRFLOW_HOME", "EMBSHARD_DATA_ROOT", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "AIRFLOW__CORE__DAGS_FOLDER")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def new_airflow():
    """A LocalAirflow of the installation's own folders, not the test session's (made here, in the main thread:
    its folders are read from os.environ, which only this thread may change), inheriting the session's
    environment as it is now rather than as the tests running beside it change it."""
    from embshard.airflow_local import LocalAirflow

    out = tempfile.mkdtemp(prefix="embshard-airflow-real-")
    with pytest.MonkeyPatch.context() as mp:
        for key in ENV:
            mp.delenv(key, raising=False)
        return LocalAirflow(out, free_port(), base_env=dict(os.environ))


_AIRFLOW = new_airflow()


@background.at_end
def _stop_airflow() -> None:
    """A session that ended before this module's tests ran (-x, Ctrl-C) leaves no Airflow behind."""
    if _AIRFLOW.procs:
        _AIRFLOW.stop()


@background.job("runs", order=4)
def _airflow_runs() -> dict:
    """Start Airflow, run the tiny DAG through a scheduler killed mid-run, then the bad conf (one real run serves
    both the end-to-end and the crash checks: each costs minutes). A failure after start() is kept for the tests
    (and Airflow left running for the fixture to stop)."""
    af, lines = _AIRFLOW, []
    af.start()
    res: dict = {"progress": lines}
    try:
        res["run_id"] = af.trigger(dict(TINY))
        res["api"] = kill_scheduler_while_a_task_runs(af, res["run_id"])
        res["state"] = af.wait_run(res["run_id"], timeout_s=1200, progress=lines.append)
        res["bad_run_id"] = af.trigger({"nosuch": 1, "tables_per_task": "60-20", "source": "spec"})
        res["bad_state"] = af.wait_run(res["bad_run_id"], timeout_s=300, progress=lines.append)
    except Exception as exc:
        res["error"] = exc
    return res


@pytest.fixture(scope="module")
def runs():
    res = background.result("runs")
    print("\n".join(res["progress"]))
    return res


@pytest.fixture(scope="module")
def airflow(runs):
    from embshard.airflow_local import session_members

    af = _AIRFLOW
    try:
        yield af
    finally:
        sessions = af.sessions()  # restarted components' old sessions included
        af.stop()
        # Stopped by session: no component, nor anything it forked (task processes in groups of their own
        # included), still runs after stop().
        for sid in sessions:
            assert session_members(sid) == [], f"session {sid} outlived stop()"
        assert not listening(af.port)


def test_components_listen_on_localhost_only(airflow):
    import psutil

    ports = {c.laddr for p in airflow.procs.values()
             for proc in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
             for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert ports, "the api-server listens somewhere"
    assert {a.ip for a in ports} == {"127.0.0.1"}, ports


def kill_scheduler_while_a_task_runs(airflow, run_id: str):
    """`make ui` supervises its components: the scheduler killed (-9) while a task runs is restarted (a line in
    its log) and the api-server stays up; the caller checks that the run still succeeds. Returns the api-server
    process seen before the kill."""
    import os
    import signal

    deadline = time.monotonic() + 600
    while "running" not in airflow.task_states(run_id).values():
        assert time.monotonic() < deadline, f"no task started: {airflow.task_states(run_id)}"
        time.sleep(1)
    killed = airflow.procs["scheduler"]
    api = airflow.procs["api-server"]
    os.kill(killed.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while airflow.procs["scheduler"] is killed:
        assert time.monotonic() < deadline, "the scheduler was not restarted"
        time.sleep(0.5)
    assert "airflow scheduler exited with code -9; restarting it" in (airflow.log_dir / "scheduler.log").read_text()
    return api


def test_triggered_run_succeeds_end_to_end(airflow, runs):
    import mlflow

    if "error" in runs and "state" not in runs:
        raise runs["error"]
    run_id = runs["run_id"]
    # The same run survives a crashed scheduler (one run serves both checks: each real run costs minutes).
    api, state = runs["api"], runs["state"]
    assert airflow.procs["api-server"] is api and api.poll() is None  # the UI never went down
    assert airflow.failed is None
    logs = Path(airflow.log_dir) / "dag_id=embshard_pipeline" / f"run_id={run_id}"
    if state != "success":
        tails = "\n".join(f"--- {p}\n" + p.read_text()[-3000:] for p in sorted(logs.rglob("*.log")))
        pytest.fail(f"run {run_id} ended {state}: {airflow.task_states(run_id)}\n{tails}")

    # One data root for every stage of the run.
    root = Path(stages.run_root(airflow.env["EMBSHARD_DATA_ROOT"], run_id))
    for rel in ("tables.parquet", "tasks.parquet", "costs", "evaluation/evaluation.parquet",
                "evaluation/decision.json"):
        assert (root / rel).exists(), rel
    assert len(list((root / "costs").glob("part-*.parquet"))) == TINY["bench_chunks"]

    # One MLflow store, every run tagged with the Airflow task that made it, versions described and typed.
    # The registry too: a test before this one may have left this process's registry URI on its own store.
    mlflow.set_tracking_uri(airflow.env["MLFLOW_TRACKING_URI"])
    mlflow.set_registry_uri(airflow.env["MLFLOW_TRACKING_URI"])
    try:
        runs = mlflow.search_runs(experiment_names=["embshard"], filter_string=f"tags.`airflow.run_id` = '{run_id}'")
        assert set(runs["tags.airflow.task_id"]) >= {"train_cost_model", "train_policy", "evaluate_and_promote"}
        assert set(runs["tags.airflow.dag_id"]) == {"embshard_pipeline"}
        assert set(runs["tags.embshard.run_root"]) == {str(root)}
        client = mlflow.MlflowClient()
        for name in ("embshard-cost", "embshard-policy"):
            (mv,) = client.search_model_versions(f"name='{name}'")
            assert run_id in mv.description and mv.tags["airflow.run_id"] == run_id
            info = mlflow.models.get_model_info(f"models:/{name}/{mv.version}")
            assert info.signature is not None and info.signature.inputs is not None
    finally:
        mlflow.set_tracking_uri(None)
        mlflow.set_registry_uri(None)

    # The decision is the task's return value (XCom) and a readable block in its log.
    decision = airflow._request("GET", f"/api/v2/dags/embshard_pipeline/dagRuns/{run_id}/taskInstances/"
                                       "evaluate_and_promote/xcomEntries/return_value")["value"]
    if isinstance(decision, str):
        decision = json.loads(decision)
    assert "candidate_median_ratio_best_baseline" in decision and decision["aa_floor"]["planner"] == "dim_greedy"
    log = (logs / "task_id=evaluate_and_promote" / "attempt=1.log").read_text()
    assert "learned planner vs the best baseline" in log and "the ruler's A/A floor" in log
    export = airflow.task_states(run_id)["export_placements"]
    if decision["promoted"]:
        # The first champion: export writes its placements into the run's root.
        assert "decision: PROMOTED to champion" in log and export == "success"
        assert (root / "export" / "placements.parquet").exists()
    else:
        # The tiny policy can lose to the heuristics (beyond the ruler's noise, or in the median within it): then
        # nothing is champion, and export skips with the reason rather than exporting a refused candidate or
        # failing the run.
        reason = decision["reason"]
        assert (decision["verdict"] == "measurably_slower" and reason.startswith("measurably slower")) or \
            (decision["verdict"] == "undecided" and reason.startswith("no champion yet")), (decision["verdict"], reason)
        assert export == "skipped" and not (root / "export" / "placements.parquet").exists()
        export_log = (logs / "task_id=export_placements" / "attempt=1.log").read_text()
        assert "no embshard-policy@champion in the registry yet" in export_log

    # Progress bars and library INFO lines are not errors.
    for path in logs.rglob("*.log"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            assert entry.get("level") not in ("error", "critical"), f"{path}: {entry.get('event')}"


def test_bad_conf_over_rest_fails_in_check_params(airflow, runs):
    """A conf that Airflow's own schema lets through (an unknown key, a backwards range, a spec source without
    its file) fails in the run's first task, in seconds, naming every field and its fix; nothing else runs."""
    if "error" in runs and "bad_state" not in runs:
        raise runs["error"]
    run_id, state = runs["bad_run_id"], runs["bad_state"]
    states = airflow.task_states(run_id)
    assert state == "failed" and states["check_params"] == "failed", states
    assert states["ingest"] == "upstream_failed"
    assert not Path(stages.run_root(airflow.env["EMBSHARD_DATA_ROOT"], run_id)).exists()
    log = (Path(airflow.log_dir) / "dag_id=embshard_pipeline" / f"run_id={run_id}" / "task_id=check_params"
           / "attempt=1.log").read_text()
    for words in ("nosuch: unknown parameter", "tables_per_task: the range 60-20 runs backwards",
                  "input: source spec needs an input file"):
        assert words in log, log[-2000:]


def test_trigger_form_submits_with_defaults(airflow):
    """Headless Chromium opens the trigger form of the DAG: with the defaults, the Trigger button is enabled."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="dev extra: playwright")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(f"{airflow.url}/auth/login/")
            page.get_by_label("Username").fill("admin")
            page.get_by_label("Password").fill(airflow.password())
            page.get_by_role("button", name="Sign in").click()
            # Wait for the login to finish (its redirect sets the session); under load, going on at once raced it
            # and landed back on the login page.
            page.wait_for_url(lambda url: "login" not in url, timeout=60_000)
            page.goto(f"{airflow.url}/dags/embshard_pipeline")
            page.get_by_role("button", name="Trigger").first.click(timeout=60_000)
            dialog = page.get_by_role("dialog")
            dialog.wait_for(timeout=30_000)
            time.sleep(2)  # the form validates its fields after it renders
            button = dialog.get_by_role("button", name="Trigger")
            assert button.is_enabled()
        finally:
            browser.close()
