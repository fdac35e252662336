"""The policy's curriculum of task shapes (policy.curriculum) and its checkpoint choice (policy.train)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from fixed_models import analytic

from embshard import params, pools
from embshard.errors import EmbshardError
from embshard.policy import train as train_mod
from embshard.policy.core import PolicyNet, TaskContext, TrainConfig
from embshard.policy.curriculum import device_range, generate_tasks, rollouts_for, stage_of, train_pool
from embshard.tableset import TableSet

STAGES = [(10, 50), (50, 200), (200, 1000)]


@pytest.fixture(scope="module")
def pool(small_tables_df):
    return train_pool(small_tables_df)


def test_curriculum_tasks_are_within_bounds_from_the_training_pool_and_deterministic(small_tables_df, pool):
    train_ids = set(pools.members(small_tables_df, "train"))
    assert set(pool.table_ids) == train_ids and len(train_ids) < len(small_tables_df)
    stages = generate_tasks(pool, STAGES, 6, seed=3)
    assert [len(s) for s in stages] == [6, 6, 6]
    for (lo, hi), tasks in zip(STAGES, stages):
        for k, t in enumerate(tasks):
            n, d, mem = len(t.tables), t.num_devices, t.memory_bytes_per_device
            assert lo <= n <= hi
            d_lo, d_hi = device_range(n)
            assert 2 <= d_lo <= d <= d_hi <= 128
            total, share = t.tables.size_bytes.sum(), t.tables.size_bytes.sum() / d
            assert mem >= 1.05 * t.tables.size_bytes.max() - 1
            factor = mem / share
            if mem > 1.05 * t.tables.size_bytes.max():  # not raised to fit the largest table
                assert (1.1 - 1e-9 <= factor <= 1.5 + 1e-9) if k % 2 == 0 else (2.0 - 1e-9 <= factor <= 4.0 + 1e-9)
            assert total <= d * mem
            # only training-pool tables (copies are named <id>#<k>), each id once
            assert {tid.split("#")[0] for tid in t.tables.table_ids} <= train_ids
            assert len(set(t.tables.table_ids)) == n
    big = stages[2]
    assert max(len(t.tables) for t in big) > len(pool)  # larger than the pool: tables repeat
    again = generate_tasks(pool, STAGES, 6, seed=3)
    other = generate_tasks(pool, STAGES, 6, seed=4)
    key = [[(list(t.tables.table_ids), t.num_devices, t.memory_bytes_per_device) for t in s] for s in stages]
    assert key == [[(list(t.tables.table_ids), t.num_devices, t.memory_bytes_per_device) for t in s] for s in again]
    assert key != [[(list(t.tables.table_ids), t.num_devices, t.memory_bytes_per_device) for t in s] for s in other]


def test_curriculum_schedule_work_cap_and_param_checks():
    assert [stage_of(i, 30, 3) for i in (0, 9, 10, 19, 20, 29)] == [0, 0, 1, 1, 2, 2]
    assert rollouts_for(1000, 64, 16, 32000) == 4            # large task: at least 4 (the group baseline)
    assert rollouts_for(20, 4, 16, 32000) == 16              # small task: the configured count
    assert rollouts_for(1000, 64, 2, 32000) == 2             # never above the configured count
    assert params.curriculum_stages("off") == []
    assert params.curriculum_stages(params.DEFAULT_CURRICULUM) == STAGES
    for bad in ("50-10", "10-50,5-20", "1-5", "x", "10-20000"):
        with pytest.raises(EmbshardError, match="policy_curriculum"):
            params.curriculum_stages(bad)
    assert [f for f, _, _ in params.problems({"policy_curriculum": "200-100"})] == ["policy_curriculum"]
    assert params.problems({"policy_curriculum": "off"}) == []


def test_the_chosen_checkpoint_is_the_best_on_validation_not_the_last(monkeypatch, small_tables_df, pool):
    """Validation scores are scripted: the checkpoint at the 3rd evaluation is best, later ones worse; the
    returned weights are the ones of that checkpoint, and info names its step."""
    est = analytic()
    tables = TableSet.from_frame(small_tables_df)
    ctxs = []
    for k in range(3):
        sub = tables.subset(np.arange(k, k + 10))
        ctxs.append((f"t{k}", sub, TaskContext.build(est, sub.features(), sub.size_bytes, 3, 2**40)))
    script = iter([1.0, 0.98, 0.95, 0.7, 0.9, 0.99, 1.2, 1.1, 1.3, 1.05, 1.4])
    snapshots = []

    def scripted(policy, contexts, base):
        snapshots.append({k: v.clone() for k, v in policy.state_dict().items()})
        return next(script)

    monkeypatch.setattr(train_mod, "validation_ratio", scripted)
    cur = train_mod.Curriculum(est, generate_tasks(pool, [(10, 20), (20, 40)], 3, seed=0), work=2000)
    torch.manual_seed(0)
    policy = PolicyNet(16)
    cfg = TrainConfig(iterations=10, rollouts_per_task=4, lr=0.05, seed=0)  # a checkpoint every update
    history, info = [], {}
    train_mod.train_estimated(policy, ctxs[:2], ctxs[2:], cfg, history, progress=False, curriculum=cur, info=info)
    assert len(snapshots) == 11  # the start, then 10 checkpoints
    best = int(np.argmin([1.0, 0.98, 0.95, 0.7, 0.9, 0.99, 1.2, 1.1, 1.3, 1.05, 1.4]))
    assert info == {"best_step": 2, "best_val_ratio": 0.7}  # update 2 (0-based) ran before the 4th evaluation
    chosen = policy.state_dict()
    assert all(torch.equal(chosen[k], snapshots[best][k]) for k in chosen)
    assert not all(torch.equal(chosen[k], snapshots[-1][k]) for k in chosen)
    logged = [h["val_ratio_to_best_baseline"] for h in history if "val_ratio_to_best_baseline" in h]
    assert min(logged) == 0.7 and logged[-1] == 1.4
    stages = [h["curriculum_stage"] for h in history]
    assert stages == sorted(stages) and set(stages) == {0.0, 1.0}
    assert all(h["rollouts"] >= 2 for h in history)


def test_train_policy_with_the_curriculum_logs_its_learning_curve(measured_world, cost_model_uri, tmp_path):
    """The job with a (tiny) curriculum: >= 10 validation tasks spanning its stages, the learning curve in MLflow
    as metrics with steps (train reward, validation ratio per checkpoint, stage) and a PNG, the best checkpoint
    kept; the same call with 'off' uses the run's tasks only."""
    import mlflow

    from embshard.jobs.train_policy import train_round

    res = train_round(measured_world["tables"], measured_world["tasks"], str(tmp_path / "p"),
                      cost_model_uri=cost_model_uri, iterations=20, rollouts_per_task=4, register=False,
                      progress=False, curriculum="4-8,8-30")
    assert res["curriculum"] == [[4, 8], [8, 30]] and res["val_tasks"] >= 10
    client = mlflow.MlflowClient()
    stage = client.get_metric_history(res["run_id"], "curriculum_stage")
    assert [m.value for m in sorted(stage, key=lambda m: m.step)] == [0.0] * 10 + [1.0] * 10
    val = client.get_metric_history(res["run_id"], "val_ratio_to_best_baseline")
    assert len(val) == 20 and len(client.get_metric_history(res["run_id"], "reward_mean")) == 20
    metrics = client.get_run(res["run_id"]).data.metrics
    assert metrics["best_checkpoint_val_ratio"] <= min(m.value for m in val) + 1e-9
    assert metrics["final_val_ratio_to_best_baseline"] == pytest.approx(metrics["best_checkpoint_val_ratio"])
    assert {"final_val_ratio_run", "final_val_ratio_stage0", "final_val_ratio_stage1"} <= set(metrics)
    assert "policy_learning_curve.png" in [a.path for a in client.list_artifacts(res["run_id"])]
    off = train_round(measured_world["tables"], measured_world["tasks"], str(tmp_path / "q"),
                      cost_model_uri=cost_model_uri, iterations=20, rollouts_per_task=4, register=False,
                      progress=False, curriculum="off")
    assert off["curriculum"] == [] and off["val_tasks"] < 10
    assert not client.get_metric_history(off["run_id"], "curriculum_stage")
