"""Generic MLflow helpers: tracking URI resolution, log + register with tags, aliases, loading, clear errors."""
from __future__ import annotations

import os

import numpy as np
import pytest

from embshard import registry
from embshard.errors import EmbshardError, ModelNotFoundError


def test_tracking_uri_env_wins_else_sqlite_in_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////somewhere/else.db")
    assert registry.tracking_uri(tmp_path) == "sqlite:////somewhere/else.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert registry.tracking_uri(tmp_path / "run") == f"sqlite:///{tmp_path}/run/mlflow.db"
    monkeypatch.chdir(tmp_path)
    assert registry.tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"


@pytest.fixture()
def tiny_artifacts(tmp_path):
    """A real (untrained) cost model's artifacts: the package's own importable pyfunc class wraps it."""
    from embshard.costmodel.ensemble import CostEnsemble
    from embshard.costmodel.model import CostModel, CostModelConfig
    from embshard.features import FeatureScaler, feature_matrix
    from embshard.ingest.synthetic import generate_tables

    feats = feature_matrix(generate_tables(6, seed=1, bins_batch_size=256))
    model = CostEnsemble([CostModel.create(CostModelConfig(), FeatureScaler.fit(feats))])
    return model, feats, model.save(str(tmp_path / "m"))


def test_log_register_alias_and_load(mlflow_uri, tiny_artifacts, tmp_path):
    from embshard.costmodel.pyfunc import CostModelPyfunc

    model, feats, artifacts = tiny_artifacts
    registry.use(experiment="registry-test")
    v1 = registry.log_and_register(CostModelPyfunc(), artifacts, "reg-test", {"hardware": "cpu:x", "n": 3})
    v2 = registry.log_and_register(CostModelPyfunc(), artifacts, "reg-test", {"hardware": "cpu:y"})
    assert (int(v1.version), int(v2.version)) == (1, 2)
    from embshard.version import code_version

    # the tags given, and the code that made the version (lineage: which commit trained it)
    assert v1.tags == {"hardware": "cpu:x", "n": "3", "embshard.code_version": code_version()}
    # artifacts of a local sqlite store live beside the database, not in the working directory
    db_dir = mlflow_uri[len("sqlite:///"):].rsplit("/", 1)[0]
    assert os.path.isdir(os.path.join(db_dir, "mlartifacts"))

    assert registry.version_for_alias("reg-test", "champion") is None
    registry.set_alias("reg-test", "champion", v1.version)
    registry.set_alias("reg-test", "challenger", 2)
    assert int(registry.version_for_alias("reg-test", "champion").version) == 1
    assert registry.version_for_alias("reg-test", "challenger").tags["hardware"] == "cpu:y"
    registry.set_alias("reg-test", "champion", 2)  # aliases move
    assert int(registry.version_for_alias("reg-test", "champion").version) == 2
    assert registry.version_for_alias("no-such-model", "champion") is None

    loaded = registry.load_python_model("models:/reg-test@champion")
    assert isinstance(loaded, CostModelPyfunc)
    # An alias that names no version of a model that has versions is set, not trained: the fix says so
    # ("train and register 'reg-test' first" had been said with the versions there), and the error says its URI once.
    with pytest.raises(ModelNotFoundError) as err:
        registry.load_python_model("models:/reg-test@prod")
    line = str(err.value)
    assert line.count("models:/reg-test@prod") == 1 and "train and register" not in line
    assert "'reg-test' has versions 1, 2 but no alias 'prod'" in err.value.fix
    assert "set_registered_model_alias('reg-test', 'prod', VERSION)" in err.value.fix
    with pytest.raises(ModelNotFoundError) as err:  # a version that is not there: the ones that are, not "train"
        registry.load_python_model("models:/reg-test/99")
    assert "'reg-test' has versions 1, 2: use one of them" in err.value.fix
    assert "train and register" not in str(err.value)
    shards = [np.array([0, 1]), np.array([2, 3, 4, 5])]
    assert np.array_equal(loaded.model.predict_shards(feats, shards, 4), model.predict_shards(feats, shards, 4))


def test_a_store_in_folders_yet_to_be_made_can_be_written(tmp_path):
    """MLflow makes a sqlite store's missing folders: check_store takes the nearest folder that exists."""
    registry.check_store(f"sqlite:///{tmp_path}/new/deeper/mlflow.db")
    assert not (tmp_path / "new").exists()  # the check writes nothing


def test_missing_model_is_a_clear_error(mlflow_uri):
    registry.use()
    with pytest.raises(ModelNotFoundError, match="embshard-cost"):
        registry.load_python_model("models:/embshard-cost@champion")


def test_registering_with_a_signature_logs_no_mlflow_hints(mlflow_uri, tiny_artifacts):
    """A successful run's logs carry no MLflow hints (the integer-column hint, the input-example hint with raw
    colour codes): the signature is given, and our integer columns never hold missing values."""
    import logging
    import warnings

    import pandas as pd

    from embshard.costmodel.pyfunc import CostModelPyfunc

    _, _, artifacts = tiny_artifacts
    registry.use(experiment="registry-test")
    frame = pd.DataFrame({"rows": [10, 20], "dim": [4, 8]})
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("mlflow.pyfunc").addHandler(handler)  # mlflow's loggers do not propagate to caplog
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sig = registry.signature(frame, pd.DataFrame({"cost_ms": [1.0, 2.0]}))
            registry.log_and_register(CostModelPyfunc(), artifacts, "reg-hints", {}, signature=sig)
    finally:
        logging.getLogger("mlflow.pyfunc").removeHandler(handler)
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
    # Nor MLflow's CloudPickle warning: our PythonModels are importable classes of this package.
    assert [r.getMessage()[:60] for r in records] == []


def test_an_unanswering_tracking_server_is_asked_a_few_times_and_a_failure_is_not_remembered(monkeypatch):
    """A server restarting rides through the tries; one that stays down fails in one line naming it (without the
    password its URI carries); a failure is asked again next time (a long-lived job recovers when it is back)."""
    import socket
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    monkeypatch.setenv(registry.WAIT_ENV, "1.5")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = f"http://user:secret@127.0.0.1:{port}"
    with pytest.raises(registry.RegistryUnreachableError, match="does not answer .*Connection refused") as err:
        registry.check_server(store)
    assert "secret" not in str(err.value) and f"127.0.0.1:{port}" in str(err.value) and "\n" not in str(err.value)

    class Quiet(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    def serve_later():
        time.sleep(0.3)
        with HTTPServer(("127.0.0.1", port), Quiet) as srv:
            srv.handle_request()

    threading.Thread(target=serve_later, daemon=True).start()
    registry.check_server(store)  # down at the first try, up by a later one (any answer counts, a 404 too)
    registry.check_server(store)  # answered once: not asked again (nothing listens any more)
    monkeypatch.setenv(registry.WAIT_ENV, "soon")
    with pytest.raises(EmbshardError, match="EMBSHARD_MLFLOW_WAIT_S.*not a number"):
        registry.check_server(f"http://127.0.0.1:{port}/other")


def _open_run(client, experiment_id: str, run_id: str, task_id: str, try_number: str,
              root: str = "/data/manual__1") -> str:
    """A run as a stage's process leaves it when killed hard: RUNNING, with the task's lineage tags."""
    return client.create_run(experiment_id, tags={"airflow.dag_id": "embshard_pipeline", "airflow.run_id": run_id,
                                                  "airflow.task_id": task_id, "airflow.try_number": try_number,
                                                  "embshard.run_root": root}).info.run_id


def test_a_retry_and_a_failed_task_end_the_mlflow_runs_killed_tries_left_running(mlflow_uri, monkeypatch):
    """A killed stage cannot end its MLflow run: the task's next try ends it on start, the failure callback of the
    local runner when there is no next try; runs of other tasks and other Airflow runs stay as they are."""
    import mlflow

    from embshard import stages

    registry.use(experiment="stale")
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name("stale").experiment_id
    killed_try = _open_run(client, exp, "manual__1", "train_policy", "1")
    other_task = _open_run(client, exp, "manual__1", "train_cost_model", "1")
    # An earlier Airflow run of the DAG under the same data root, its stage SIGKILLed (Airflow's supervisor fails
    # such a task without running callbacks): runs go one at a time, so the next stage that logs ends it.
    other_run = _open_run(client, exp, "manual__0", "train_policy", "1", root="/data/manual__0")
    # Another deployment on the same MLflow server: the same run id (scheduled ids repeat), another data root.
    elsewhere = _open_run(client, exp, "manual__1", "train_policy", "1", root="/other/deployment/r")
    elsewhere_earlier = _open_run(client, exp, "manual__0", "train_policy", "1", root="/other/deployment/manual__0")
    for var, value in {"EMBSHARD_AIRFLOW_DAG_ID": "embshard_pipeline", "EMBSHARD_AIRFLOW_RUN_ID": "manual__1",
                       "EMBSHARD_AIRFLOW_TASK_ID": "train_policy", "EMBSHARD_AIRFLOW_TRY_NUMBER": "2",
                       "EMBSHARD_RUN_ROOT": "/data/manual__1"}.items():
        monkeypatch.setenv(var, value)
    with registry.start_run(run_name="retry") as retry:
        status = {r: client.get_run(r).info.status for r in (killed_try, other_task, other_run, elsewhere,
                                                              elsewhere_earlier)}
        assert status == {killed_try: "KILLED", other_task: "RUNNING", other_run: "KILLED", elsewhere: "RUNNING",
                          elsewhere_earlier: "RUNNING"}
        assert "a later Airflow run of embshard_pipeline" in \
            client.get_run(other_run).data.tags[registry.END_REASON_TAG]
        assert client.get_run(retry.info.run_id).info.status == "RUNNING"  # the retry's own run, and not ended
        assert "try 2 of its Airflow task started" in client.get_run(killed_try).data.tags[registry.END_REASON_TAG]

        # The task's last try killed too: its failure callback ends what is still open (the retry's run included).
        assert stages.end_failed_task_runs(mlflow_uri, "/data", "embshard_pipeline", "manual__1",
                                           "train_policy") == [retry.info.run_id]
    assert client.get_run(other_task).info.status == "RUNNING"
    reason = client.get_run(retry.info.run_id).data.tags[registry.END_REASON_TAG]
    assert "Airflow task train_policy of run manual__1 failed" in reason
    # Nothing open: nothing to end; a store that cannot be searched ends nothing and raises nothing.
    assert stages.end_failed_task_runs(mlflow_uri, "/data", "embshard_pipeline", "manual__1", "train_policy") == []
    assert client.get_run(elsewhere).info.status == "RUNNING"
    assert registry.end_stale_runs("manual__1", other_runs=True, reason="x") == []  # no data root: none ended
    assert set(registry.end_stale_runs("manual__1", reason="x")) == {elsewhere, other_task}  # unfiltered: all
    mlflow.set_tracking_uri("http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    assert registry.end_stale_runs("manual__1", reason="x") == []
    mlflow.set_tracking_uri("bogus://x")  # a store MLflow cannot even open: nothing ended, nothing raised
    assert registry.end_stale_runs("manual__1", reason="x") == []


def test_an_alias_read_that_fails_is_not_read_as_no_alias(mlflow_uri, monkeypatch):
    """A server that stopped answering after it was checked (MLflow's client gave up, INTERNAL_ERROR) read as 'no
    champion', and export_placements was skipped as 'no champion yet': now it is the registry not answering (75);
    a missing model or alias is still None."""
    import mlflow
    from mlflow.exceptions import MlflowException

    assert registry.version_for_alias("nosuchmodel", registry.CHAMPION) is None  # RESOURCE_DOES_NOT_EXIST

    def gives_up(self, name, alias):
        raise MlflowException("API request to http://mlflow:5000/api/2.0/mlflow/registered-models/alias failed "
                              "with exception Max retries exceeded")

    monkeypatch.setattr(mlflow.MlflowClient, "get_model_version_by_alias", gives_up)
    with pytest.raises(registry.RegistryUnreachableError, match="did not answer for embshard-policy@champion") as e:
        registry.version_for_alias(registry.POLICY_MODEL, registry.CHAMPION)
    assert e.value.exit_code == 75
