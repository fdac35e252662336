"""Plans are reproducible under load, and the balanced estimate a planner reports is never above a cost it
predicts (nor, in a small measured case, grossly above what it measures: it is an estimate, not a bound)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from embshard.bench.runner import MeasureSettings
from embshard.costmodel.model import CostModel, CostModelConfig
from embshard.features import FeatureScaler
from embshard.ingest.synthetic import generate_tables
from embshard.jobs.place import predicted
from embshard.planners.baselines import BASELINES, make_baseline
from embshard.planners.learned import LearnedPlanner
from embshard.policy.core import PolicyNet
from embshard.tableset import TableSet


@pytest.fixture(scope="module")
def setup():
    """64 tables, an untrained policy and a freshly initialised cost model (seeded): what matters here is the
    search itself, not the quality of the models."""
    torch.manual_seed(0)
    ts = TableSet.from_frame(generate_tables(64, seed=2, bins_batch_size=512))
    model = CostModel.create(CostModelConfig(), FeatureScaler.fit(ts.features()))
    return ts, PolicyNet(), model


def _plan(setup, **kw):
    ts, policy, model = setup
    mem = int(max(ts.size_bytes.sum() / 8 * 1.3, ts.size_bytes.max() * 1.01))
    p = LearnedPlanner(policy, model, **kw).plan(ts, 8, mem, "t")
    return p, sorted((s.table, s.device, s.col_offset, s.col_size or -1) for s in p.shards)


def test_same_inputs_same_plan_also_under_cpu_load(setup):
    first, shards = _plan(setup)
    assert not first.meta["time_cap_hit"] and first.meta["search_evaluations"] > 0
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded, shards_loaded = _plan(setup)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert shards_loaded == shards
    assert loaded.meta["search_evaluations"] == first.meta["search_evaluations"]


def test_hitting_the_time_cap_is_reported(setup):
    p, _ = _plan(setup, time_budget_s=1e-6)
    assert p.meta["time_cap_hit"] is True
    # in the plan's warnings too (a job that reads only the plan had no way to tell), the cap as it was given
    assert any("planning hit its 1e-06 s safety cap" in w for w in p.meta["warnings"]), p.meta.get("warnings")
    from embshard.placement_report import device_table

    assert "time cap" in device_table(p)


def test_no_planner_is_predicted_below_its_balanced_estimate(setup):
    ts, policy, model = setup
    rng = np.random.default_rng(0)
    for k in range(4):
        sub = ts.subset(rng.choice(len(ts), size=int(rng.integers(8, 40)), replace=False))
        devices = int(rng.choice([2, 4, 8]))
        mem = int(max(sub.size_bytes.sum() / devices * 1.5, sub.size_bytes.max() * 1.01))
        planners = [make_baseline(b) for b in BASELINES] + [LearnedPlanner(policy, model)]
        for planner in planners:
            placement = planner.plan(sub, devices, mem, f"task{k}")
            costs, estimate = predicted(placement, planner, model)
            if estimate is not None:  # withheld where the model's own predictions contradict it
                assert costs.max() >= estimate * (1 - 1e-9), (planner.name, costs.max(), estimate)


def test_on_one_device_the_balanced_estimate_is_the_plan_itself(setup):
    """One device: all tables fused is the only plan, so its estimate is that plan's cost (gap 0); the min with the
    sum of single-table costs had put it below every plan (`place` printed a +73% gap on one device)."""
    from embshard.evaluation import _estimate

    ts, policy, model = setup
    sub = ts.subset(range(12))
    placement = make_baseline("dim_greedy").plan(sub, 1, int(sub.size_bytes.sum() * 2), "one")
    costs, estimate = predicted(placement, make_baseline("dim_greedy"), model)
    assert estimate is not None and estimate == pytest.approx(float(costs.max()), rel=1e-5)
    fused, singles = np.array([3.0, 5.0, 0.0]), np.array([4.0, 4.0, 0.0])
    assert _estimate(fused, singles, 1) == 8.0 and _estimate(fused, singles, 2) == 3.5


def test_measured_costs_are_not_grossly_below_the_measured_estimate(tmp_path):
    """A small measured case: three tables on two devices, every greedy baseline measured with real kernels."""
    from embshard import schemas
    from embshard.jobs import evaluate

    df = generate_tables(3, seed=4, bins_batch_size=512)
    tables = str(tmp_path / "tables.parquet")
    schemas.write(df, tables, "tables")
    import pandas as pd

    tasks = str(tmp_path / "tasks.parquet")
    schemas.write(pd.DataFrame({"task_id": ["m0"], "split": ["test"], "num_devices": [2],
                                "memory_bytes_per_device": [int(df["size_bytes"].sum())],
                                "table_ids": [list(df["table_id"])]}), tasks, "tasks")
    res = evaluate.run(tables, tasks, str(tmp_path / "eval"), planners=["size_greedy", "dim_greedy", "round_robin"],
                       settings=MeasureSettings(batch_size=256, iterations=10, warmup=2, comm_bandwidth_gbps=10.0,
                                                comm_latency_us=20.0), progress=False)
    frame = res["frame"]
    assert frame["feasible"].all()
    # Measured numbers carry timer noise, and the estimate comes from one-shot measurements of the singles and the
    # fused shard, taken apart from the plans' rounds: on this shared 2-core VM the same estimate measured 9.0 to
    # 15.7 ms in three identical runs (batch 2048). So the check is against gross errors (a formula that
    # overshoots), not noise: the estimate must not exceed the upper end of a plan's 95% interval by more than 25%.
    assert (frame["rounds"] == 5).all()
    assert (frame["cost_ci_high"] >= frame["balanced_estimate_ms"] * 0.75).all(), \
        frame[["planner", "measured_cost_ms", "cost_ci_high", "balanced_estimate_ms"]]
