"""Running a finished outer-loop stage again (Airflow's "Clear task"): its inputs come from the rounds it names,
not from whatever ran after it, so the re-run does what the first run did."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from embshard import outer_loop, stages
from embshard.errors import EmbshardError


@pytest.fixture()
def finished_root(tmp_path):
    """A run root after two rounds: the state points at round 2's policy and cost model."""
    root = str(tmp_path / "run")
    for r, uri in ((1, "models:/embshard-cost/1"), (2, "models:/embshard-cost/2")):
        state = {"policy_dir": os.path.join(root, "policy", f"round-{r}"), "round": r, "cost_model_uri": uri,
                 "version": str(r)}
        stages._state(root, f"policy-round-{r}", state)  # what train_policy leaves for each round
    stages._state(root, "policy", state)  # and the latest
    stages._state(root, "cost_model", {"model_uri": "models:/embshard-cost/2", "version": "2", "round": 2})
    return root


def test_a_round_run_again_reads_the_round_before_not_the_latest(finished_root, monkeypatch):
    seen = {}
    monkeypatch.setattr(outer_loop, "measure_round", lambda *a, **kw: seen.setdefault("measure", kw) and "costs")
    monkeypatch.setattr(outer_loop, "train_policy_round",
                        lambda *a, **kw: seen.setdefault("train", kw) and {"policy_dir": "x", "cost_model_uri": "u",
                                                                           "final_val_ratio": 1.0})
    params = {"policy_rounds": 2}
    stages.measure_policy_plans(finished_root, params, 2)
    assert seen["measure"]["policy_dir"] == os.path.join(finished_root, "policy", "round-1")
    assert seen["measure"]["cost_model_uri"] == "models:/embshard-cost/1"  # what round 1 was trained against
    stages.train_policy(finished_root, params, 2)
    assert seen["train"]["init_policy"] == os.path.join(finished_root, "policy", "round-1")


def test_a_round_needs_its_own_cost_model_and_the_round_before(finished_root):
    stages._state(finished_root, "cost_model", {"model_uri": "models:/embshard-cost/1", "version": "1", "round": 1})
    with pytest.raises(EmbshardError, match="cost model is round 1's, not round 2's") as err:
        stages.train_policy(finished_root, {"policy_rounds": 2}, 2)
    assert "train_cost_model --round 2" in err.value.fix and "refit_cost_model_r2" in err.value.fix
    os.remove(os.path.join(finished_root, "state", "policy-round-1.json"))
    with pytest.raises(EmbshardError, match="missing stage output") as err:
        stages.measure_policy_plans(finished_root, {"policy_rounds": 2}, 2)
    assert "train_policy round 1" in err.value.fix


def test_round_1_run_again_after_the_refit_trains_against_round_1s_cost_model(finished_root, monkeypatch):
    """Clearing train_policy (round 1) of a finished two-round run failed: 'the run's cost model is round 2's' (the
    refit overwrote the one state file). Each round's cost model has its own state now; only the last round's
    policy is the run's candidate, so a round-1 re-run does not replace what evaluation measures."""
    seen = {}
    monkeypatch.setattr(outer_loop, "fit_cost_model",
                        lambda *a, **kw: {"model_uri": f"models:/embshard-cost/{kw['round_index']}",
                                          "model_version": kw["round_index"]})
    monkeypatch.setattr(outer_loop, "train_policy_round",
                        lambda *a, **kw: seen.setdefault("train", kw) and {"policy_dir": "x", "cost_model_uri": "u",
                                                                           "final_val_ratio": 1.0})
    params = {"policy_rounds": 2}
    stages.train_cost_model(finished_root, params, 1)
    stages.train_cost_model(finished_root, params, 2)  # the refit, after it
    stages.train_policy(finished_root, params, 1)  # cleared and run again
    assert seen["train"]["cost_model_uri"] == "models:/embshard-cost/1"
    assert stages._state(finished_root, "policy")["round"] == 2  # the candidate is still round 2's


@pytest.mark.parametrize("name, round_index, says", [("ingest", 2, "has no rounds"),
                                                     ("train_policy", 0, "rounds start at 1"),
                                                     ("measure_policy_plans", 1, "rounds start at 2"),
                                                     ("train_policy", 4, "at most 3 rounds")])
def test_a_round_a_stage_cannot_have_is_refused(tmp_path, name, round_index, says):
    with pytest.raises(EmbshardError, match=says) as err:
        stages.run(name, str(tmp_path / "run"), {}, round_index=round_index)
    assert err.value.field == "round" and not (tmp_path / "run").exists()


def test_a_gate_stopped_midway_leaves_no_earlier_decision(finished_root, monkeypatch):
    """An earlier try's decision (perhaps about another candidate) goes before the gate measures: a try stopped
    midway (SIGTERM) leaves no decision, never a stale one that export or a person would read."""
    from embshard.jobs import promote

    stages._state(finished_root, "promotion", {"promoted": True, "candidate_version": "1"})
    os.makedirs(os.path.join(finished_root, "evaluation"))
    decision = os.path.join(finished_root, "evaluation", "decision.json")
    with open(decision, "w") as f:
        json.dump({"candidate_version": "1"}, f)
    measured = os.path.join(finished_root, "evaluation", "evaluation.parquet")  # what that decision was made on
    with open(measured, "w") as f:
        f.write("an earlier try's")

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(promote, "evaluate_and_promote", stopped)
    # inputs that cannot be read: the try fails before it erases anything (a retry on a corrupt tasks.parquet had
    # erased the record of the decision that moved the alias)
    tables, tasks = stages.path(finished_root, "tables"), stages.path(finished_root, "tasks")
    for f in (tables, tasks):
        os.makedirs(os.path.dirname(f), exist_ok=True)
        with open(f, "w") as out:
            out.write("not parquet")
    with pytest.raises(EmbshardError):
        stages.evaluate_and_promote(finished_root, {})
    assert os.path.exists(decision) and os.path.exists(measured)
    _write_tables_and_tasks(tables, tasks)
    with pytest.raises(KeyboardInterrupt):
        stages.evaluate_and_promote(finished_root, {})
    assert not os.path.exists(decision) and not os.path.exists(measured)
    assert not os.path.exists(os.path.join(finished_root, "state", "promotion.json"))


def _write_tables_and_tasks(tables_path: str, tasks_path: str) -> None:
    from embshard import schemas
    from embshard.ingest.synthetic import generate_tables
    from embshard.jobs.tasks import sample_tasks

    df = generate_tables(8, seed=3, bins_batch_size=256)
    schemas.write(df, tables_path, "tables")
    schemas.write(sample_tasks(df, 2, "3-4", [2], 64.0, 0, where="test"), tasks_path, "tasks")


def test_a_stage_running_other_code_than_the_runs_ingest_says_so(tmp_path, monkeypatch, caplog):
    """A `git pull` mid-run mixed two versions of the code in one run (a stage failed on an argument the code it
    was loaded with did not know) and nothing recorded which code made what: ingest records the run's code
    version, a later stage on other code warns, and registered models carry it (embshard.code_version)."""
    import logging

    from embshard import run_context, version

    root = str(tmp_path / "run")
    monkeypatch.setattr(version, "code_version", lambda fresh=False: "0.1.0+gaaaa")
    stages._note_code_version(root, "ingest")
    assert run_context.mlflow_tags()["embshard.code_version"] == "0.1.0+gaaaa"
    with caplog.at_level(logging.WARNING, logger="embshard.stages"):
        stages._note_code_version(root, "benchmark")  # the same code: nothing said
        monkeypatch.setattr(version, "code_version", lambda fresh=False: "0.1.0+gbbbb")
        stages._note_code_version(root, "train_policy")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "0.1.0+gbbbb" in warned[0] and "0.1.0+gaaaa" in warned[0]


def test_a_long_process_reads_the_code_version_again_for_its_stages(monkeypatch):
    """`embshard pipeline` runs every stage in one process: the version read once at its start could never tell
    that the checkout changed under the run; a stage's check reads it again."""
    from embshard import version

    monkeypatch.setenv("EMBSHARD_CODE_VERSION", "0.1.0+gaaaa")
    assert version.code_version(fresh=True) == "0.1.0+gaaaa"
    monkeypatch.setenv("EMBSHARD_CODE_VERSION", "0.1.0+gbbbb")
    assert version.code_version() == "0.1.0+gaaaa"  # read once per process (lineage tags of one stage agree)
    assert version.code_version(fresh=True) == "0.1.0+gbbbb"
    monkeypatch.delenv("EMBSHARD_CODE_VERSION")
    version.code_version(fresh=True)  # the checkout's own again, for the tests after this one


def test_embshards_warnings_reach_the_pipelines_console(monkeypatch):
    """A stage's warnings (a calibration on a busy machine, kept for every later run) went to the log file only:
    they are also progress lines on the console of `embshard pipeline`; INFO stays in the log."""
    import logging

    from embshard import run_context

    read, write = os.pipe()
    monkeypatch.setenv(run_context.PROGRESS_FD, str(write))
    with run_context.stage_output({}):
        logging.getLogger("embshard.bench.comm").warning("the machine was busy while calibrating")
        logging.getLogger("embshard.bench.comm").info("calibrated")
    logging.getLogger("embshard.bench.comm").warning("after the stage: not forwarded by it")
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    assert said == "    warning: the machine was busy while calibrating\n"



def test_a_stage_run_by_hand_takes_its_runs_params_and_store(tmp_path, monkeypatch, capsys):
    """`embshard stage train_policy --root <a pipeline run's folder>` ran on the default params and registered into
    a new, empty ROOT/mlflow.db: ingest now records the run's params and store (state/run.json), which a stage run
    by hand takes (the params given go over them)."""
    import argparse

    root = str(tmp_path / "run")
    store = f"sqlite:///{tmp_path / 'pipeline-mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("EMBSHARD_RUN_ROOT", "")  # main sets both: restored after the test
    monkeypatch.delenv("EMBSHARD_RUN_ROOT")
    stages.run("ingest", root, {"num_tables": 12, "num_tasks": 2, "tables_per_task": "3-5", "eval_tasks": 7})
    facts = stages.recorded_run(root)
    assert facts["mlflow_tracking_uri"] == store and facts["params"]["eval_tasks"] == 7
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    seen = {}

    def fake_run(name, r, params, chunk=None, round_index=None):
        seen.update(params=params, store=os.environ.get("MLFLOW_TRACKING_URI"))
        return {}

    monkeypatch.setattr(stages, "run", fake_run)
    monkeypatch.setattr(stages, "report", lambda *a, **k: "")
    args = argparse.Namespace(name="evaluate_and_promote", root=root, params='{"eval_rounds": 3}', chunk=0,
                              round_index=None)
    assert stages.main(args) == 0
    assert seen["params"]["eval_tasks"] == 7 and seen["params"]["eval_rounds"] == 3 and seen["store"] == store
    assert "the run's params (with those given) and MLflow store" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(root, "mlflow.db"))  # no stray store in the root
    # MLFLOW_TRACKING_URI set to another store: that one is used, and the banner names it (it named the run's)
    other = f"sqlite:///{tmp_path / 'copy-mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    assert stages.main(args) == 0
    out = capsys.readouterr().out
    assert seen["store"] == other and f"MLflow store {other} (MLFLOW_TRACKING_URI, not the run's {store})" in out


def _make_read_only(path) -> bool:
    """Make a file unwritable even for root (chattr +i) or, not root, by its mode; False where neither works."""
    import subprocess

    if os.geteuid() != 0:
        os.chmod(path, 0o444)
        return True
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def _undo_read_only(path) -> None:
    import subprocess

    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    else:
        os.chmod(path, 0o644)


def test_a_stage_refuses_a_store_it_cannot_write_before_any_work(tmp_path, monkeypatch):
    """A read-only MLflow store was found out after training (a 200-line SQLAlchemy traceback), an http one that
    does not answer after minutes of retries; now one line, naming the store, before the stage's work (here the
    stage's inputs do not even exist: the store is what it names)."""
    import socket
    import sqlite3


    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE t (x)")
    if not _make_read_only(db):
        pytest.skip("cannot make a file read-only here (root without chattr)")
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
        with pytest.raises(EmbshardError, match="MLflow store cannot be written") as err:
            stages.run("train_cost_model", str(tmp_path / "root"), {})
        assert err.value.path == str(db) and "\n" not in str(err.value)
    finally:
        _undo_read_only(db)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("EMBSHARD_MLFLOW_WAIT_S", "0")
    with pytest.raises(EmbshardError, match="tracking server does not answer"):
        stages.run("evaluate_and_promote", str(tmp_path / "root"), {})
    # a writable store: on to the stage, which finds its inputs missing
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    with pytest.raises(EmbshardError, match="missing stage output|no such|not found|missing"):
        stages.run("train_cost_model", str(tmp_path / "root"), {})


def test_a_copied_run_root_reads_its_own_files_not_the_originals(finished_root, tmp_path, monkeypatch):
    """State files record paths under the root relative to it: a root copied elsewhere (a backup restored, a run
    moved to other storage) reads its own policy and shards. Absolute paths of older state files still work."""
    import shutil

    with open(os.path.join(finished_root, "state", "policy-round-1.json"), encoding="utf-8") as f:
        assert json.load(f)["policy_dir"] == "policy/round-1"
    copy = str(tmp_path / "moved" / "run")
    shutil.copytree(finished_root, copy)
    shutil.rmtree(finished_root)
    seen = {}
    monkeypatch.setattr(outer_loop, "measure_round", lambda *a, **kw: seen.setdefault("measure", kw) and "costs")
    stages.measure_policy_plans(copy, {"policy_rounds": 2}, 2)
    assert seen["measure"]["policy_dir"] == os.path.join(copy, "policy", "round-1")

    from embshard.jobs import bench

    monkeypatch.setattr(bench, "run", lambda tables, shards, root, **kw: seen.setdefault("bench", shards) and [])
    monkeypatch.setattr(stages, "measure_settings", lambda root, p: type("S", (), {"device": "cpu"})())
    stages._state(copy, "shards", {"shards": os.path.join(copy, "shards.parquet"), "chunks": [0]})
    stages.benchmark(copy, {"bench_chunks": 1}, 0)
    assert seen["bench"] == os.path.join(copy, "shards.parquet")
    stages._state(copy, "shards", {"shards": "/elsewhere/shards.parquet", "chunks": [0]})  # an older root's state
    del seen["bench"]
    stages.benchmark(copy, {"bench_chunks": 1}, 0)
    assert seen["bench"] == "/elsewhere/shards.parquet"


def test_state_written_under_a_relative_root_before_is_read_as_it_was(tmp_path, monkeypatch):
    """A root given relative (`embshard stage ... --root runs/x/...`) had its state written with paths that name
    the root already (runs/x/.../shards.parquet): they are not joined onto it a second time."""
    from embshard.run_layout import in_root

    monkeypatch.chdir(tmp_path)
    root = "runs/x/run1"
    assert in_root(root, "runs/x/run1/shards.parquet") == "runs/x/run1/shards.parquet"
    assert in_root(root, "shards.parquet") == "runs/x/run1/shards.parquet"
    assert in_root("s3://b/run1", "policy/round-1") == "s3://b/run1/policy/round-1"
    assert in_root(root, "/abs/shards.parquet") == "/abs/shards.parquet"


def test_a_run_whose_id_maps_to_another_runs_folder_is_refused(tmp_path, monkeypatch):
    """Airflow takes 'collide-1' and 'collide:1' as two run ids; their folders are one (':' and '+' become '-').
    The second run had silently reused the first's measurements and overwritten its state, models and exports;
    its stages now refuse the folder, before ingest writes anything. The run's own stages (a cleared task run
    again) and stages run by hand still run there."""
    from embshard import run_layout

    root = run_layout.run_root(str(tmp_path), "collide-1")
    assert root == run_layout.run_root(str(tmp_path), "collide:1")
    params = {"num_tables": 40, "num_tasks": 2, "tables_per_task": "10-20", "devices": 2, "memory_gb": 64}
    monkeypatch.setenv(stages.AIRFLOW_RUN_ENV, "collide-1")
    stages.run("ingest", root, params)
    tables = os.path.join(root, "tables.parquet")
    run_json = Path(root, "state", "run.json")
    before = (os.path.getmtime(tables), run_json.read_text())
    monkeypatch.setenv(stages.AIRFLOW_RUN_ENV, "collide:1")
    for name in ("ingest", "sample_shards", "evaluate_and_promote"):
        with pytest.raises(EmbshardError, match="this run folder belongs to Airflow run 'collide-1', not to "
                                                "'collide:1'") as err:
            stages.run(name, root, params)
        assert err.value.field == "run_id" and "run id of its own" in err.value.fix
    assert (os.path.getmtime(tables), run_json.read_text()) == before
    monkeypatch.setenv(stages.AIRFLOW_RUN_ENV, "collide-1")
    stages.run("ingest", root, params)  # the run's own ingest, cleared and run again
    monkeypatch.delenv(stages.AIRFLOW_RUN_ENV)
    stages.run("ingest", root, params)  # by hand (`embshard stage ingest --root`)
