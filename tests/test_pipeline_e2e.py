"""The whole DAG, end to end, twice: real `dag.test()` runs (Airflow's task runner, XComs, dynamic mapping), real
FBGEMM measurements, a real MLflow sqlite registry, on a tiny configuration.

Run 1 must produce every output, valid, and promote its policy (there is no champion yet). Run 2 works under its
own root (run 1's files are untouched) and moves `champion` exactly when its recorded decision says so.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import tempfile

import background
import numpy as np
import pytest

from embshard import schemas, stages

pytestmark = pytest.mark.slow

# Smaller than pipeline.QUICK_PARAMS: 2 devices, 6-10 tables per task, one evaluated task. The gate's baseline is
# size_greedy (bytes only, blind to lookups), which the tiny learned planner beats by about 20% here: these tests
# check the pipeline's mechanics and need run 1 to promote. Against the strong greedies the tiny planner measured
# 0.995x on this machine and once 1.025x on a loaded CI machine (no champion, no export). The gate's rules
# themselves are tested in test_promote.py.
TINY = {"num_tables": 40, "hot_large_fraction": 0.0, "num_tasks": 2, "tables_per_task": "6-10", "devices": 2,
        "memory_gb": 256, "bench_shards": 16, "bench_chunks": 2, "bench_batch_size": 256, "policy_iterations": 10,
        "eval_tasks": 1, "eval_planners": ["size_greedy"]}
POLICY, COST = "embshard-policy", "embshard-cost"
ENV_KEYS = ("AIRFLOW_HOME", "AIRFLOW__CORE__LOAD_EXAMPLES", "AIRFLOW__CORE__DAGS_FOLDER", "EMBSHARD_DATA_ROOT",
            "MLFLOW_TRACKING_URI", "EMBSHARD_RUNNER", "AIRFLOW__CORE__PARALLELISM")


def aliases() -> dict[str, dict[str, str]]:
    import mlflow

    client = mlflow.MlflowClient()
    return {name: {a: str(v) for a, v in client.get_registered_model(name).aliases.items()}
            for name in (POLICY, COST)}


def trained_against(root: str) -> str:
    """The embshard-cost version the run's policy was trained against (after the outer loop's refits)."""
    uri = stages._state(root, "policy")["cost_model_uri"]
    assert uri.startswith(f"models:/{COST}/"), uri
    return uri.rsplit("/", 1)[-1]


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run_twice(out: str) -> dict:
    """Two pipeline runs into one output folder with its own MLflow store, in this (fresh) interpreter: Airflow
    reads AIRFLOW_HOME when it is first imported, so the runs use the one the caller set, and the DB schema comes
    from initdb()."""
    import mlflow

    from embshard import pipeline

    with pytest.MonkeyPatch.context() as mp:
        # setup_environment() writes these into os.environ: record them so they are restored afterwards.
        for key in ENV_KEYS:
            mp.setenv(key, os.environ.get(key, ""))
        mp.delenv("EMBSHARD_DATA_ROOT")
        mp.delenv("MLFLOW_REGISTRY_URI", raising=False)  # restored on exit: registry.use() exports it
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{out}/mlflow.db")
        try:
            first = pipeline.run(str(out), dict(TINY))
            first["aliases"] = aliases()
            first["digests"] = {p: digest(os.path.join(first["root"], p))
                                for p in ("tables.parquet", "tasks.parquet", "state/promotion.json",
                                          "export/placements.parquet")}
            second = pipeline.run(str(out), dict(TINY))
            second["aliases"] = aliases()
            versions = {name: sorted(int(v.version) for v in mlflow.MlflowClient().search_model_versions(
                f"name='{name}'")) for name in (POLICY, COST)}
            promote_runs = mlflow.search_runs(experiment_names=["embshard"],
                                              filter_string="attributes.run_name = 'evaluate-and-promote'")
        finally:
            mlflow.set_tracking_uri(None)
            mlflow.set_registry_uri(None)
    return {"out": str(out), "first": first, "second": second, "versions": versions, "promote_runs": promote_runs}


# The two runs in a fresh interpreter beside the other tests (tests/background.py), with an Airflow home of their own.
RUNNER = """
import pickle, sys
sys.path.insert(0, sys.argv[2])
import test_pipeline_e2e
with open(sys.argv[3], "wb") as f:
    pickle.dump(test_pipeline_e2e.run_twice(sys.argv[1]), f)
"""


@background.job("two_runs", order=3, alone=True)
def _two_runs_job() -> dict:
    out = tempfile.mkdtemp(prefix="embshard-pipeline-e2e-")
    env = {**background.ENV, "AIRFLOW_HOME": os.path.join(out, "airflow"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    env.pop("AIRFLOW__CORE__DAGS_FOLDER", None)
    result = os.path.join(out, "result.pkl")
    proc = subprocess.run([sys.executable, "-c", RUNNER, os.path.join(out, "pipeline"),
                           os.path.dirname(os.path.abspath(__file__)), result],
                          env=env, capture_output=True, text=True, timeout=1500)
    return {"proc": proc, "result": result, "airflow_home": env["AIRFLOW_HOME"]}


@pytest.fixture(scope="module")
def two_runs():
    job = background.result("two_runs")
    proc = job["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(job["result"], "rb") as f:
        runs = pickle.load(f)
    return {**runs, "airflow_home": job["airflow_home"]}


def test_run_uses_the_tests_airflow_home_and_its_own_stores(two_runs):
    first = two_runs["first"]
    assert first["state"] == "success"
    assert first["env"]["AIRFLOW_HOME"] == two_runs["airflow_home"]
    assert first["env"]["MLFLOW_TRACKING_URI"] == f"sqlite:///{two_runs['out']}/mlflow.db"
    assert first["env"]["EMBSHARD_DATA_ROOT"] == os.path.join(two_runs["out"], "data")
    assert first["root"] == stages.run_root(os.path.join(two_runs["out"], "data"), first["run_id"])
    assert os.path.isfile(os.path.join(two_runs["out"], "mlflow.db"))


def test_first_run_writes_every_output_and_each_validates(two_runs):
    root = two_runs["first"]["root"]
    tables = schemas.read(os.path.join(root, "tables.parquet"), "tables")
    assert len(tables) == TINY["num_tables"]
    tasks = schemas.read(os.path.join(root, "tasks.parquet"), "tasks")
    assert set(tasks["split"]) == {"train", "test"}
    assert (tasks["num_devices"] == TINY["devices"]).all()
    assert tasks["table_ids"].map(len).between(6, 10).all()

    # One costs part per mapped benchmark chunk, all of them valid and positive.
    files = os.listdir(os.path.join(root, "costs"))
    parts = sorted(p for p in files if p.startswith("part-"))
    assert parts == [f"part-{i:05d}-of-{TINY['bench_chunks']:05d}.parquet" for i in range(TINY["bench_chunks"])]
    # The outer loop measures the policy's plans into folders of its own (never into the benchmark's costs).
    assert not [p for p in files if p.startswith("policy-")]
    rounds = stages.DEFAULT_PARAMS["policy_rounds"]
    for r in range(2, rounds + 1):
        measured = schemas.read(os.path.join(root, "policy", f"measured-round-{r}", "costs"), "costs")
        assert (measured["origin"] == "placement:learned").all() and len(measured) > 0
    assert stages._state(root, "policy")["round"] == rounds
    costs = schemas.read(os.path.join(root, "costs"), "costs")
    assert len(costs) >= TINY["bench_shards"] and (costs["fwd_compute_ms"] > 0).all()
    assert (costs["batch_size"] == TINY["bench_batch_size"]).all()
    # Every shard the benchmark stage chose lies inside one table pool (the cost model drops mixed ones), and the
    # pools are the ones stored with the tables, which the tasks follow too.
    pool_of = dict(zip(tables["table_id"], tables["pool"]))
    assert all(len({pool_of[t] for t in ids}) == 1 for ids in costs["table_ids"])
    assert all({pool_of[t] for t in ids} == {split} for ids, split in zip(tasks["table_ids"], tasks["split"]))

    # Evaluation: candidate + every baseline (the first twice: the A/A floor), measured on the held-out task.
    import pandas as pd

    ev = pd.read_parquet(os.path.join(root, "evaluation", "evaluation.parquet"))
    for col in ("task_id", "planner", "feasible", "measured_cost_ms", "balanced_estimate_ms", "ratio_to_best_baseline",
                "planning_time_s", "predicted_cost_ms"):
        assert col in ev.columns, col
    policy = stages._state(root, "policy")
    assert sorted(ev["planner"]) == sorted([f"learned/{policy['version']}", "size_greedy",
                                            "size_greedy#2"])
    assert ev["feasible"].all() and np.isfinite(ev["measured_cost_ms"]).all() and (ev["measured_cost_ms"] > 0).all()
    assert set(ev["task_id"]) <= set(tasks.loc[tasks["split"] == "test", "task_id"])
    schemas.read(os.path.join(root, "evaluation", "placements.parquet"), "placements")
    with open(os.path.join(root, "evaluation", "evaluation.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # Export: the champion's placements of every test task, plan.json + TorchRec plans that agree with them.
    from embshard.export.plan_json import read_plan_json
    from embshard.export.torchrec_plan import plan_from_json, plan_layout, rank_layout

    placements = schemas.read(os.path.join(root, "export", "placements.parquet"), "placements")
    test_ids = sorted(tasks.loc[tasks["split"] == "test", "task_id"])
    assert sorted(placements["task_id"].unique()) == test_ids
    # The plans record the version the champion alias named when they were made (the alias moves on).
    champion = stages._state(root, "promotion")["champion_version_after"]
    assert (placements["model_uri"] == f"models:/{POLICY}/{champion}").all()
    for task_id in test_ids:
        folder = os.path.join(root, "export", task_id)
        plan = read_plan_json(os.path.join(folder, "plan.json"))
        assert plan["num_devices"] == TINY["devices"]
        task_tables = set(tasks.set_index("task_id").loc[task_id, "table_ids"])
        rows = placements[placements["task_id"] == task_id]
        assert set(rows["table_id"]) == task_tables
        assert {(t, d) for t, shards in plan_layout(plan).items() for _, _, d in shards} == \
            set(zip(rows["table_id"], rows["device"].astype(int)))
        torchrec_plan = plan_from_json(os.path.join(folder, "torchrec_plan.json"))
        assert rank_layout(torchrec_plan) == plan_layout(plan)
        assert os.path.getsize(os.path.join(folder, "torchrec_plan.pt")) > 0

    # The small facts the stages hand each other.
    assert set(os.listdir(os.path.join(root, "state"))) == {f"{n}.json" for n in (
        "ingest", "shards", "cost_model", "policy", "promotion", "export", "code_version", "run",
        *(f"{kind}-round-{r}" for r in range(1, stages.DEFAULT_PARAMS["policy_rounds"] + 1)
          for kind in ("policy", "cost_model")))}
    assert stages._state(root, "export")["num_tasks"] == len(test_ids)
    # what a stage run again by hand on this root takes: the run's params and its store
    assert stages.recorded_run(root)["params"]["policy_rounds"] == stages.DEFAULT_PARAMS["policy_rounds"]
    assert stages.recorded_run(root)["mlflow_tracking_uri"]
    # The policy was trained against the stage's cost model, or (outer loop) a refit of it registered after it.
    assert int(trained_against(root)) >= int(stages._state(root, "cost_model")["version"])


def test_first_run_promotes_its_models(two_runs):
    first = two_runs["first"]
    promo = stages._state(first["root"], "promotion")
    policy = stages._state(first["root"], "policy")
    assert promo["promoted"] is True and promo["champion_version_before"] is None
    assert promo["candidate_version"] == promo["champion_version_after"] == policy["version"]
    # The champion policy and the cost model it was trained against carry the alias together.
    assert first["aliases"][POLICY]["champion"] == policy["version"]
    assert first["aliases"][COST]["champion"] == trained_against(first["root"])


def test_second_run_has_its_own_root_and_leaves_the_first_intact(two_runs):
    first, second = two_runs["first"], two_runs["second"]
    assert second["state"] == "success"
    assert second["run_id"] != first["run_id"] and second["root"] != first["root"]
    assert os.path.dirname(second["root"]) == os.path.dirname(first["root"])
    for rel, before in first["digests"].items():
        assert digest(os.path.join(first["root"], rel)) == before, rel
    versions = two_runs["versions"]
    assert versions[POLICY] == [1, 2]
    # Each run registers its cost model (and one refit per extra policy round), never replacing a version.
    rounds = stages.DEFAULT_PARAMS["policy_rounds"]
    assert versions[COST] == list(range(1, 2 * rounds + 1))
    assert int(stages._state(second["root"], "cost_model")["version"]) > int(trained_against(first["root"]))


def test_second_run_moves_champion_exactly_as_its_decision_says(two_runs):
    first, second = two_runs["first"], two_runs["second"]
    promo = stages._state(second["root"], "promotion")
    old, new = first["aliases"][POLICY]["champion"], stages._state(second["root"], "policy")["version"]
    old_cost, new_cost = first["aliases"][COST]["champion"], trained_against(second["root"])
    assert promo["candidate_version"] == new != old
    assert promo["champion_version_before"] == old
    # The gate decides on the interval of candidate / champion, not on its median alone.
    vs = promo["candidate_vs_champion"]
    assert vs["ci_low"] <= promo["candidate_over_champion_median"] <= vs["ci_high"]
    assert promo["promoted"] == (promo["verdict"] == "promoted")
    # Promoted when faster than the champion by the margin beyond the A/A floor (the floor had been left out here:
    # a second run at 0.969 [0.958, 0.984] against a floor of [0.899, 1.001] was rightly undecided, and this test
    # failed), or in place of a champion slower than the best baseline; never when slower than the baseline.
    from embshard import stats
    from embshard.jobs.promote import champion_regressed

    floor, base = promo["aa_floor"] or {}, promo["candidate_vs_best_baseline"]
    aa_lo, aa_hi = floor.get("ci_low", float("nan")), floor.get("ci_high", float("nan"))
    faster = stats.floor_verdict(vs["ci_low"], vs["ci_high"], aa_lo, aa_hi, at=1.0 - promo["margin"]) == "faster"
    replaces = (champion_regressed(promo["champion_vs_best_baseline"], promo["aa_floor"])
                and base["median"] <= max(1.0, aa_hi if aa_hi == aa_hi else 1.0) and vs["median"] <= 1.0)
    slower = stats.floor_verdict(base["ci_low"], base["ci_high"], aa_lo, aa_hi) == "slower"
    assert promo["promoted"] == (not slower and (faster or replaces)), promo["reason"]
    if promo["promoted"]:
        assert second["aliases"][POLICY]["champion"] == promo["champion_version_after"] == new
        assert second["aliases"][COST]["champion"] == new_cost
    elif promo["verdict"] == "undecided":
        assert second["aliases"][POLICY]["champion"] == promo["champion_version_after"] == old
        assert second["aliases"][POLICY]["challenger"] == new
        assert second["aliases"][COST] == {"champion": old_cost, "challenger": new_cost}
    else:  # not better, or measurably slower: `challenger` is for undecided candidates only
        assert promo["verdict"] in ("not_better", "measurably_slower", "infeasible")
        assert second["aliases"][POLICY] == {"champion": old} and second["aliases"][COST] == {"champion": old_cost}
    # The champion was measured beside the candidate on the same held-out task.
    import pandas as pd

    ev = pd.read_parquet(os.path.join(second["root"], "evaluation", "evaluation.parquet"))
    assert {f"learned/{old}", f"learned/{new}"} <= set(ev["planner"])


def test_each_decision_is_logged_in_mlflow(two_runs):
    runs = two_runs["promote_runs"]
    assert len(runs) == 2
    promoted = {str(r["params.candidate_version"]): r["metrics.promoted"] for _, r in runs.iterrows()}
    decisions = {stages._state(two_runs[k]["root"], "promotion")["candidate_version"]:
                 float(stages._state(two_runs[k]["root"], "promotion")["promoted"]) for k in ("first", "second")}
    assert promoted == decisions
