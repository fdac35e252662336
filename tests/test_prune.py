"""`embshard prune`: what a local installation keeps and deletes as scheduled runs pile up."""
from __future__ import annotations

import json
import os

import pytest

from embshard import registry, run_owner
from embshard.cli import main as cli

RUNS = ["manual__2026-11-01T08:00:00+00:00", "scheduled__2026-11-08T00:00:00+00:00",
        "manual__2026-11-10T09:30:00.5+00:00", "scheduled__2026-11-15T00:00:00+00:00"]


@pytest.fixture()
def installation(tmp_path, monkeypatch):
    """Four runs (folders, Airflow logs, pipeline logs) and registry versions: embshard-cost 1-4, embshard-policy
    1-2 (policy 1 trained against cost 1 and champion; policy 2 against cost 3)."""
    from embshard.costmodel.ensemble import CostEnsemble
    from embshard.costmodel.model import CostModel, CostModelConfig
    from embshard.costmodel.pyfunc import CostModelPyfunc
    from embshard.features import FeatureScaler, feature_matrix
    from embshard.ingest.synthetic import generate_tables
    from embshard.run_layout import run_root

    root = tmp_path / "inst"
    for k, run in enumerate(RUNS):
        folder = run_root(str(root / "data"), run)
        os.makedirs(os.path.join(folder, "export"))
        with open(os.path.join(folder, "tables.parquet"), "wb") as f:
            f.write(b"x" * 1000 * (k + 1))
        logs = root / "airflow" / "logs" / "dag_id=embshard_pipeline" / f"run_id={run}" / "task_id=ingest"
        logs.mkdir(parents=True)
        (logs / "attempt=1.log").write_text("log\n")
        os.makedirs(root / "logs", exist_ok=True)
        (root / "logs" / f"pipeline-202611{k + 1:02d}-000000.log").write_text("pipeline\n")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = registry.connect(str(root))
    import mlflow

    mlflow.set_tracking_uri(uri)
    feats = feature_matrix(generate_tables(6, seed=1, bins_batch_size=256))
    arts = CostEnsemble([CostModel.create(CostModelConfig(), FeatureScaler.fit(feats))]).save(str(tmp_path / "m"))
    registry.use(str(root))
    for _ in range(4):
        registry.log_and_register(CostModelPyfunc(), arts, registry.COST_MODEL, {})
    for cost in (1, 3):
        registry.log_and_register(CostModelPyfunc(), arts, registry.POLICY_MODEL, {
            "cost_model_uri": f"models:/{registry.COST_MODEL}/{cost}", "cost_model_version": str(cost)})
    registry.set_alias(registry.POLICY_MODEL, registry.CHAMPION, 1)
    registry.set_alias(registry.COST_MODEL, registry.CHAMPION, 1)
    # the store the newest run's stages used, as ingest records it
    state = os.path.join(run_root(str(root / "data"), RUNS[-1]), "state")
    os.makedirs(state)
    with open(os.path.join(state, "run.json"), "w") as f:
        json.dump({"params": {}, "mlflow_tracking_uri": uri}, f)
    yield root
    mlflow.set_tracking_uri(None)


def _versions(name):
    import mlflow

    return sorted(int(mv.version) for mv in mlflow.MlflowClient().search_model_versions(f"name='{name}'"))


def _model_folders(root):
    return sorted(os.listdir(root / "mlartifacts" / "models"))


def test_a_dry_run_lists_and_deletes_nothing_then_yes_deletes_what_it_listed(installation, capsys, monkeypatch,
                                                                              tmp_path):
    root = installation
    before = _model_folders(root)
    # a store set in the shell for other work is not the installation's: the one its runs recorded is pruned
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/other.db")
    assert cli(["prune", "--out", str(root), "--keep-runs", "2", "--keep-versions", "1"]) == 0
    listed = capsys.readouterr().out
    # the two oldest runs by their time (not by name: 'manual' sorts before 'scheduled'), the oldest pipeline logs
    assert "run manual__2026-11-01T08-00-00-00-00" in listed and "run scheduled__2026-11-08T00-00-00-00-00" in listed
    assert "manual__2026-11-10" not in listed.split("kept:")[0] and "pipeline-20261101-000000.log" in listed
    # versions: policy 2 is the newest, 1 the champion: both kept, and with them cost 3 (policy 2's) and cost 1
    # (champion; policy 1's); cost 4 is the newest: only cost 2 goes
    assert f"{registry.COST_MODEL} 2 " in listed and f"{registry.POLICY_MODEL} 1 " not in listed
    assert "would delete" in listed and len(os.listdir(root / "data")) == 4 and _model_folders(root) == before
    assert _versions(registry.COST_MODEL) == [1, 2, 3, 4]

    assert cli(["prune", "--out", str(root), "--keep-runs", "2", "--keep-versions", "1", "--yes"]) == 0
    assert "deleted:" in capsys.readouterr().out
    assert sorted(os.listdir(root / "data")) == ["manual__2026-11-10T09-30-00.5-00-00",
                                                 "scheduled__2026-11-15T00-00-00-00-00"]
    logs = sorted(os.listdir(root / "airflow" / "logs" / "dag_id=embshard_pipeline"))
    assert logs == ["run_id=manual__2026-11-10T09:30:00.5+00:00", "run_id=scheduled__2026-11-15T00:00:00+00:00"]
    assert sorted(os.listdir(root / "logs")) == ["pipeline-20261103-000000.log", "pipeline-20261104-000000.log"]
    assert _versions(registry.COST_MODEL) == [1, 3, 4] and _versions(registry.POLICY_MODEL) == [1, 2]
    assert len(_model_folders(root)) == len(before) - 1
    # what training jobs load still loads
    assert registry.load_python_model(registry.POLICY_CHAMPION_URI) is not None
    assert registry.load_python_model(f"models:/{registry.COST_MODEL}/3") is not None
    # run again: nothing left to delete
    assert cli(["prune", "--out", str(root), "--keep-runs", "2", "--keep-versions", "1", "--yes"]) == 0
    assert "nothing" in capsys.readouterr().out


def test_prune_refuses_while_a_pipeline_runs_on_the_folder_and_deletes_nothing(installation, capsys):
    root = installation
    owner = run_owner.record_owner(root / "airflow", RUNS[-1])  # this process: alive
    try:
        assert cli(["prune", "--out", str(root), "--keep-runs", "0", "--yes"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "embshard pipeline" in err and "field 'out'" in err and "fix:" in err
        assert len(os.listdir(root / "data")) == 4 and _versions(registry.COST_MODEL) == [1, 2, 3, 4]
    finally:
        run_owner.forget(owner)


def test_prune_needs_an_installation_and_a_count_of_zero_or_more(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/elsewhere.db")  # never pruned from here
    (tmp_path / "empty").mkdir()
    for argv, words in ((["--out", str(tmp_path / "empty")], ["not an embshard installation"]),
                        (["--out", str(tmp_path / "gone")], ["no such folder"]),
                        (["--out", str(tmp_path / "empty"), "--keep-runs", "-1"], ["field 'keep-runs'"])):
        assert cli(["prune", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and all(w in err for w in words), err
    # a plain Airflow home (~/airflow: other DAGs' logs) is not an installation
    (tmp_path / "home" / "airflow" / "logs" / "dag_id=my_etl" / "run_id=scheduled__2020-01-01T00:00:00+00:00").mkdir(
        parents=True)
    assert cli(["prune", "--out", str(tmp_path / "home"), "--keep-runs", "0", "--yes"]) == 2
    assert "not an embshard installation" in capsys.readouterr().err
    assert (tmp_path / "home" / "airflow" / "logs" / "dag_id=my_etl").is_dir()
    # runs but no registry: the runs alone, and it says there is no store
    (tmp_path / "runs_only" / "data" / "manual__2026-11-01T08-00-00-00-00" / "state").mkdir(parents=True)
    (tmp_path / "runs_only" / "data" / "manual__2026-11-01T08-00-00-00-00" / "state" / "run.json").write_text("{}")
    assert cli(["prune", "--out", str(tmp_path / "runs_only"), "--keep-runs", "0", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "registry: (none" in out and os.listdir(tmp_path / "runs_only" / "data") == []
    assert "deleted:" in out and "\x1b[" not in out  # plain text, no colour codes


def test_prune_leaves_alone_what_is_not_the_folders_own_and_what_kept_versions_need(installation, tmp_path, capsys,
                                                                                    monkeypatch):
    """Found by a reviewer trying to make prune delete the wrong things: a link out of the folder, folders of
    data/ that are not runs, a store the runs recorded elsewhere (a copied installation), a logged model a kept
    version was registered from too, glob characters in the folder's name."""
    import shutil

    import mlflow

    # A copy under a name with glob characters: prune works on the copy's own store, never the original's.
    copy = tmp_path / "inst[1]"
    shutil.copytree(installation, copy, symlinks=True)
    outside = tmp_path / "outside"
    (outside / "run").mkdir(parents=True)
    (outside / "run" / "big").write_bytes(b"x" * 4096)
    os.symlink(outside / "run", copy / "data" / "manual__2020-01-01T00-00-00-00-00")
    (copy / "data" / "plans-for-job").mkdir()  # not a run: never counted, never deleted
    # cost 4 (newest) re-registered as cost 5 from cost 2's logged model: deleting 2 must not take 5's files
    client = mlflow.MlflowClient()
    source = client.get_model_version(registry.COST_MODEL, "2").source
    original = sorted(os.listdir(installation / "data")), _versions(registry.COST_MODEL)
    mlflow.set_tracking_uri(f"sqlite:///{copy}/mlflow.db")
    mlflow.set_registry_uri(f"sqlite:///{copy}/mlflow.db")
    mlflow.register_model(source, registry.COST_MODEL)
    mlflow.set_tracking_uri(None)
    mlflow.set_registry_uri(None)
    assert cli(["prune", "--out", str(copy), "--keep-runs", "1", "--keep-versions", "1", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "left alone: data/plans-for-job (not runs)" in out
    assert "(a link, or outside the folder)" in out and "run manual__2020-01-01" not in out.split("total")[0]
    assert f"left alone: the MLflow store sqlite:///{installation}/mlflow.db" in out
    assert f"registry: sqlite:///{copy}/mlflow.db" in out
    assert (outside / "run" / "big").exists() and os.path.islink(copy / "data" / "manual__2020-01-01T00-00-00-00-00")
    assert (copy / "data" / "plans-for-job").is_dir()
    assert "scheduled__2026-11-15T00-00-00-00-00" in os.listdir(copy / "data")
    # the original installation is untouched
    mlflow.set_tracking_uri(f"sqlite:///{installation}/mlflow.db")
    mlflow.set_registry_uri(f"sqlite:///{installation}/mlflow.db")
    assert (sorted(os.listdir(installation / "data")), _versions(registry.COST_MODEL)) == original
    # the copy: cost 5 (newest) kept and loadable although cost 2 (its logged model's first version) went
    mlflow.set_tracking_uri(f"sqlite:///{copy}/mlflow.db")
    mlflow.set_registry_uri(f"sqlite:///{copy}/mlflow.db")
    assert 2 not in _versions(registry.COST_MODEL) and 5 in _versions(registry.COST_MODEL)
    assert registry.load_python_model(f"models:/{registry.COST_MODEL}/5") is not None


def test_versions_a_kept_run_registered_stay_and_other_dags_logs_are_not_prunes(installation, capsys):
    """A kept run's stages, run again, reload the versions it registered (state/*.json names them); an Airflow
    home may hold other DAGs' logs, which are not prune's."""
    import mlflow

    other = installation / "airflow" / "logs" / "dag_id=my_etl" / "run_id=scheduled__2020-01-01T00:00:00+00:00"
    other.mkdir(parents=True)
    mlflow.MlflowClient().set_model_version_tag(registry.COST_MODEL, "2", "airflow.run_id", RUNS[-1])
    assert cli(["prune", "--out", str(installation), "--keep-runs", "1", "--keep-versions", "1", "--yes"]) == 0
    capsys.readouterr()
    assert _versions(registry.COST_MODEL) == [1, 2, 3, 4] and other.is_dir()


def test_prune_under_a_wrapper_runs_and_finds_nothing_of_its_own(installation):
    """cron and scripts run it under `timeout`, `uv run`, a shell: its own parents are not other processes."""
    import subprocess
    import sys

    proc = subprocess.run(["timeout", "120", sys.executable, "-m", "embshard", "prune", "--out", str(installation),
                           "--keep-runs", "3"], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "AIRFLOW_HOME"})
    assert proc.returncode == 0, proc.stderr
    assert "would delete" in proc.stdout and "run manual__2026-11-01T08-00-00-00-00" in proc.stdout


def test_prune_refuses_while_any_embshard_process_works_inside_the_folder(installation, capsys, monkeypatch,
                                                                          tmp_path):
    """A pipeline whose Airflow home is elsewhere records itself there, not in the folder: its process, given a
    path inside the folder, is found all the same."""
    import subprocess
    import sys

    fake = tmp_path / "bin" / "embshard"  # an `embshard stage` run by hand on a run of the folder, as ps shows it
    fake.parent.mkdir()
    fake.write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(fake), "stage", "benchmark", "--root",
                             str(installation / "data" / "x")])
    try:
        assert cli(["prune", "--out", str(installation), "--keep-runs", "0", "--yes"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"pid {proc.pid}" in err and "works on this folder" in err
        assert len(os.listdir(installation / "data")) == 4
        # and a pipeline recorded under AIRFLOW_HOME elsewhere, whose run is this folder's
        proc.kill()
        proc.wait()
        home = tmp_path / "ah"
        monkeypatch.setenv("AIRFLOW_HOME", str(home))
        unrelated = run_owner.record_owner(home, "manual__2030-01-01T00:00:00+00:00")  # another folder's run
        assert cli(["prune", "--out", str(installation), "--keep-runs", "4"]) == 0
        capsys.readouterr()
        run_owner.forget(unrelated)
        owner = run_owner.record_owner(home, RUNS[-1])
        try:
            assert cli(["prune", "--out", str(installation), "--keep-runs", "0", "--yes"]) == 2
            assert "embshard pipeline" in capsys.readouterr().err
        finally:
            run_owner.forget(owner)
    finally:
        proc.kill()
