"""Shared fixtures. Each test module owns its own data; these are the small, common building blocks."""
from __future__ import annotations

import os
import tempfile

import pytest

# Airflow and MLflow must never touch the user's home during tests.
_SESSION_HOME = tempfile.mkdtemp(prefix="embshard-tests-")
os.environ.setdefault("AIRFLOW_HOME", os.path.join(_SESSION_HOME, "airflow"))
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{_SESSION_HOME}/mlflow.db")
os.environ.setdefault("EMBSHARD_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def small_tables_df():
    """40 synthetic tables (validated tables frame), bins from a 4,096-sample batch to stay fast."""
    from embshard.ingest.synthetic import generate_tables

    return generate_tables(40, seed=0, bins_batch_size=4096)


@pytest.fixture()
def small_tables_path(tmp_path, small_tables_df):
    from embshard import schemas

    path = tmp_path / "tables.parquet"
    schemas.write(small_tables_df, path, "tables")
    return path


@pytest.fixture()
def mlflow_uri(tmp_path, monkeypatch):
    """A fresh sqlite MLflow store (tracking + registry) for one test."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    import mlflow

    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)
