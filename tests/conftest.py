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
os.environ.setdefault("EMBSHARD_CACHE_DIR", os.path.join(_SESSION_HOME, "cache"))  # spec bins: not ~/.cache


@pytest.fixture(autouse=True)
def _no_stray_registry_uri(monkeypatch):
    """mlflow.set_registry_uri() also exports MLFLOW_REGISTRY_URI (for subprocesses) and never unsets it, so one
    test's registry would become the next one's default (a client, a spawned Airflow): each test starts without."""
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)


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


@pytest.fixture(scope="session")
def measured_world(tmp_path_factory):
    """A tiny, real end-to-end data set: 40 synthetic tables, train/test tasks, and real FBGEMM measurements of
    random shards plus the baselines' device shards (small batch and memory budget to stay fast). Measured before
    the background jobs start (tests/background.py), which wait for it."""
    import background

    try:
        return _measure_world(tmp_path_factory)
    finally:
        background.open_gate()


def _measure_world(tmp_path_factory):
    import pandas as pd

    from embshard import schemas
    from embshard.bench.runner import MeasureSettings
    from embshard.bench.sampler import placement_shards, random_shards
    from embshard.ingest.synthetic import generate_tables
    from embshard.jobs import bench, tasks
    from embshard.planners.baselines import GREEDY_BASELINES, make_baseline
    from embshard.tableset import TableSet

    root = tmp_path_factory.mktemp("world")
    df = generate_tables(40, seed=3, bins_batch_size=2048)
    tables = str(root / "tables.parquet")
    schemas.write(df, tables, "tables")
    tasks_path = tasks.run(tables, str(root), num_tasks=4, tables_per_task="6-10", devices=2, memory_gb=256, seed=0)
    task_df = schemas.read(tasks_path, "tasks")
    train = task_df[task_df["split"] == "train"]
    pool = sorted({t for ids in train["table_ids"] for t in ids})
    ts = TableSet.read(tables)
    frames = [random_shards(pool, 24, min_tables=1, max_tables=6, seed=0, num_devices=2),
              random_shards(pool, len(pool), min_tables=1, max_tables=1, seed=1, num_devices=2)]
    plans = [make_baseline(b).plan(ts.select(list(t.table_ids)), 2, int(t.memory_bytes_per_device),
                                   t.task_id).to_frame()
             for t in train.itertuples() for b in GREEDY_BASELINES[:2]]
    frames.append(placement_shards(pd.concat(plans, ignore_index=True), 2))
    shards = pd.concat(frames, ignore_index=True).drop_duplicates("sample_id")
    shards_path = str(root / "shards.parquet")
    schemas.write(shards, shards_path, "shards")
    bench_kw = {"batch_size": 256, "iterations": 10, "warmup": 2, "max_shard_gb": 0.05}
    bench.run(tables, shards_path, str(root), MeasureSettings(**bench_kw), progress=False)
    return {"root": str(root), "tables": tables, "tasks": tasks_path, "costs": str(root / "costs"),
            "bench_kw": bench_kw, "settings": MeasureSettings(**bench_kw)}


@pytest.fixture(scope="session")
def cost_model_uri(measured_world):
    """A cost model trained on the measured world and registered (session MLflow store) as embshard-cost."""
    from embshard.jobs.train_cost import run

    res = run(measured_world["costs"], measured_world["tables"], os.path.join(measured_world["root"], "cm"),
              seed=0, max_epochs=150, patience=30)
    return res["model_uri"]


# --- end-to-end jobs beside the tests (tests/background.py) ------------------------------------------------------
def pytest_collection_modifyitems(session, config, items):
    """Tests that wait for a background job run last, in the order the jobs are queued (a stable sort: the rest
    keep their order)."""
    import background

    # Among the first, the tests that measure the world go first: the background jobs wait for that measurement.
    items.sort(key=lambda item: (background.rank(list(getattr(item, "fixturenames", ()))),
                                 background.GATE_FIXTURE not in getattr(item, "fixturenames", ())))


def pytest_collection_finish(session):
    import background

    if session.config.option.collectonly:
        return
    background.start({f for item in session.items for f in getattr(item, "fixturenames", ())})


def pytest_sessionfinish(session, exitstatus):
    import background

    background.finish()
