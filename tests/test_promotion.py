"""Promotion in a real MLflow registry (sqlite), with real measured evaluations.

Three registered learned planners: v1 and v3 trained against the session's real cost model, v2 against a
deliberately wrong one that believes every extra table on a device makes it cheaper (so it piles all tables on
one device: measured, clearly worse than any balanced placement, whatever the policy learned). Each test starts
from a registry without aliases and sets the one it needs.
"""
from __future__ import annotations

import pandas as pd
import pytest

from embshard import registry
from embshard.jobs.promote import COST, POLICY, evaluate_and_promote

BASELINES = ["dim_greedy", "size_lookup_greedy"]
GOOD, BAD, GOOD_TOO = "1", "2", "3"


def piling_cost_model(good):
    """A copy of `good` whose device cost only depends on its table count and falls as tables are added (no
    communication cost). Under it the best placement puts every table on one device."""
    import copy

    import torch

    from embshard.costmodel.model import COUNT, NUM_EXTRA

    bad = copy.deepcopy(good)
    with torch.no_grad():
        for member in bad.members:  # every member of the ensemble
            net = member.net
            for head in (net.fwd, net.bwd):
                head.mlp[-1].weight.zero_()
                head.mlp[-1].bias.fill_(5.0)
                head.skip.weight.zero_()
                head.skip.weight[0, head.skip.weight.shape[1] - NUM_EXTRA + COUNT] = -0.4
            for comm in (net.comm_rate, net.comm_latency, net.comm_latency_slope):
                comm.fill_(-40.0)  # softplus(-40) ~ 0: no communication cost
    return bad


@pytest.fixture(scope="module")
def store(measured_world, cost_model_uri, tmp_path_factory):
    """A module-wide MLflow store: cost models v1 (real) and v2 (piling), policies v1, v2, v3."""
    import mlflow

    from embshard.costmodel import load
    from embshard.costmodel.pyfunc import CostModelPyfunc
    from embshard.outer_loop import run as train_policy

    good = load(cost_model_uri)  # from the session store, before switching stores
    root = tmp_path_factory.mktemp("promotion")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
        registry.use(str(root))
        for name, model in (("good", good), ("bad", piling_cost_model(good))):
            with mlflow.start_run(run_name=f"cost-{name}"):
                registry.log_and_register(CostModelPyfunc(), model.save(str(root / f"cost-{name}")), COST,
                                          {"hardware": model.config.hardware})
        for cost_version, seed in (("1", 0), ("2", 0), ("1", 1)):
            train_policy(measured_world["tables"], measured_world["tasks"], str(root / "policy"),
                         cost_model_uri=f"models:/{COST}/{cost_version}", iterations=4, rollouts_per_task=4,
                         seed=seed, progress=False)
        try:
            yield {"root": root, **measured_world}
        finally:
            mlflow.set_tracking_uri(None)
            mlflow.set_registry_uri(None)


@pytest.fixture()
def fresh(store):
    """The module store with no aliases set."""
    import mlflow

    client = mlflow.MlflowClient()
    for name in (POLICY, COST):
        for alias in list(client.get_registered_model(name).aliases):
            client.delete_registered_model_alias(name, alias)
    return store


def aliases(name: str) -> dict[str, str]:
    import mlflow

    return {a: str(v) for a, v in mlflow.MlflowClient().get_registered_model(name).aliases.items()}


ROUNDS = 3


def promote(world, tmp_path, candidate: str, margin: float = 0.01) -> dict:
    return evaluate_and_promote(world["tables"], world["tasks"], str(tmp_path / "evaluation"),
                                candidate_version=candidate,
                                baselines=BASELINES, max_tasks=2, margin=margin, settings=world["settings"],
                                rounds=ROUNDS)


def promote_run(candidate: str):
    import mlflow

    runs = mlflow.search_runs(experiment_names=[registry.DEFAULT_EXPERIMENT],
                              filter_string="attributes.run_name = 'evaluate-and-promote'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    row = runs.iloc[0]
    assert row["params.candidate_version"] == candidate
    return row


def test_registered_versions_carry_the_cost_model_they_were_trained_against(store):
    import mlflow

    client = mlflow.MlflowClient()
    tags = {v: client.get_model_version(POLICY, v).tags for v in (GOOD, BAD, GOOD_TOO)}
    assert {v: (t["cost_model_uri"], t["cost_model_version"]) for v, t in tags.items()} == {
        GOOD: (f"models:/{COST}/1", "1"), BAD: (f"models:/{COST}/2", "2"), GOOD_TOO: (f"models:/{COST}/1", "1")}


def comp(median, lo, hi, tasks=10):
    return {"median": median, "ci_low": lo, "ci_high": hi, "wilcoxon_p": 0.01, "tasks": tasks}


FLOOR = {"median": 1.0, "ci_low": 0.95, "ci_high": 1.06}  # a noisy ruler's A/A floor


def slower_than_baselines(decision: dict) -> bool:
    """The gate's own reading of 'measurably slower': the interval clears 1 and the A/A floor's interval."""
    vs, floor = decision["candidate_vs_best_baseline"], decision["aa_floor"]
    return vs["ci_low"] > max(1.0, floor["ci_high"])


@pytest.mark.parametrize("vs_champion, vs_baseline, failed, floor, verdict, reason", [
    (None, comp(1.03, 1.01, 1.05), False, FLOOR, "promoted", "no champion yet"),
    (None, comp(1.10, 1.07, 1.12), False, FLOOR, "challenger", "measurably slower than the best baseline"),
    (comp(0.95, 0.92, 0.98), comp(0.95, 0.90, 0.99), False, FLOOR, "undecided", "not beyond the ruler's noise"),
    (comp(0.90, 0.88, 0.94), comp(0.95, 0.90, 0.99), False, FLOOR, "promoted", "faster than the champion"),
    (comp(1.02, 1.00, 1.05), comp(0.95, 0.90, 0.99), False, FLOOR, "challenger", "not faster than the champion"),
])
def test_a_difference_inside_the_rulers_a_a_floor_is_no_difference(vs_champion, vs_baseline, failed, floor,
                                                                    verdict, reason):
    from embshard.jobs.promote import decide

    got, why = decide(vs_champion, vs_baseline, margin=0.01, failed=failed, floor=floor)
    assert got == verdict and reason in why


@pytest.mark.parametrize("vs_champion, vs_baseline, failed, verdict, reason", [
    (None, comp(0.95, 0.90, 0.99), False, "promoted", "no champion yet"),
    (None, comp(1.00, 0.97, 1.03), False, "promoted", "no champion yet"),
    # Measurably slower than the best baseline: never promoted, even as the first champion.
    (None, comp(1.03, 1.01, 1.05), False, "challenger", "measurably slower than the best baseline"),
    (comp(0.80, 0.70, 0.90), comp(1.03, 1.01, 1.05), False, "challenger", "measurably slower"),
    (comp(0.95, 0.92, 0.98), comp(0.95, 0.90, 0.99), False, "promoted", "faster than the champion"),
    (comp(0.98, 0.96, 1.00), comp(0.95, 0.90, 0.99), False, "undecided", "straddles"),
    (comp(1.02, 1.00, 1.05), comp(0.95, 0.90, 0.99), False, "challenger", "not faster than the champion"),
    (comp(0.95, float("nan"), float("nan"), 1), comp(0.95, 0.9, 0.99), False, "undecided", "too few"),
    (comp(0.50, 0.40, 0.60), comp(0.5, 0.4, 0.6), True, "challenger", "failed to place"),
])
def test_the_gate_decides_on_intervals_and_says_undecided_rather_than_guessing(vs_champion, vs_baseline, failed,
                                                                                 verdict, reason):
    from embshard.jobs.promote import decide

    got, why = decide(vs_champion, vs_baseline, margin=0.01, failed=failed)
    assert got == verdict and reason in why


def test_without_a_champion_a_candidate_not_slower_than_the_baselines_becomes_champion(fresh, tmp_path):
    import json

    decision = promote(fresh, tmp_path, GOOD)
    vs = decision["candidate_vs_best_baseline"]
    assert decision["rounds"] == ROUNDS and decision["tasks"] == 2 and vs["tasks"] == 2
    assert vs["ci_low"] <= vs["median"] <= vs["ci_high"]
    assert decision["champion_version_before"] is None
    floor = decision["aa_floor"]
    assert floor["planner"] == BASELINES[0] and floor["ci_low"] <= floor["median"] <= floor["ci_high"]
    if slower_than_baselines(decision):  # the tiny test policy can lose to the heuristics: then never promoted
        assert decision["verdict"] == "challenger" and aliases(POLICY) == {"challenger": GOOD}
    else:
        assert decision["verdict"] == "promoted" and decision["reason"].startswith("no champion yet")
        assert decision["champion_version_after"] == GOOD and aliases(POLICY) == {"champion": GOOD}
        assert aliases(COST) == {"champion": "1"}  # the cost model follows its policy
    run = promote_run(GOOD)
    assert run["metrics.promoted"] == float(decision["promoted"]) and run["tags.decision"] == decision["verdict"]
    # Evaluated against the baselines only (there was no champion to compare with), the files are written.
    ev = pd.read_parquet(tmp_path / "evaluation" / "evaluation.parquet")
    assert set(ev["planner"]) == {f"learned/{GOOD}", *BASELINES, f"{BASELINES[0]}#2"}  # and the A/A repeat
    assert (ev["rounds"] == ROUNDS).all() and ev["round_costs_ms"].map(len).eq(ROUNDS).all()
    saved = json.loads((tmp_path / "evaluation" / "decision.json").read_text())
    assert saved["verdict"] == decision["verdict"] and saved["candidate_vs_best_baseline"]["tasks"] == 2


def test_a_candidate_slower_than_the_baselines_is_never_promoted_even_without_a_champion(fresh, tmp_path):
    """The piling planner (every table on one device) against balanced baselines: measurably slower."""
    decision = promote(fresh, tmp_path, BAD)
    assert decision["verdict"] == "challenger" and decision["promoted"] is False
    assert decision["reason"].startswith("measurably slower than the best baseline")
    assert slower_than_baselines(decision)
    assert decision["champion_version_after"] is None
    assert aliases(POLICY) == {"challenger": BAD}


def test_a_worse_candidate_leaves_the_champion_where_it_was(fresh, tmp_path):
    registry.set_alias(POLICY, "champion", GOOD)
    registry.set_alias(COST, "champion", "1")
    decision = promote(fresh, tmp_path, BAD)
    assert decision["promoted"] is False
    assert decision["champion_version_before"] == decision["champion_version_after"] == GOOD
    # Genuinely worse when measured, not a near tie decided by noise: the whole interval is above 1.
    assert decision["candidate_over_champion_median"] > 1.1
    assert decision["candidate_vs_champion"]["ci_low"] > 1.0
    assert aliases(POLICY) == {"champion": GOOD, "challenger": BAD}
    assert aliases(COST) == {"champion": "1", "challenger": "2"}
    run = promote_run(BAD)
    assert run["metrics.promoted"] == 0.0 and run["tags.decision"] == "challenger"
    assert run["metrics.candidate_vs_champion_median"] == pytest.approx(decision["candidate_over_champion_median"])
    # Why it is worse: its cost model put every table on one device, the champion spread them.
    placed = pd.read_parquet(tmp_path / "evaluation" / "placements.parquet")
    devices = placed.groupby(["planner", "task_id"])["device"].nunique().groupby("planner").max()
    assert devices[f"learned/{BAD}"] == 1 and devices[f"learned/{GOOD}"] == 2


def test_a_better_candidate_replaces_a_worse_champion(fresh, tmp_path):
    registry.set_alias(POLICY, "champion", BAD)
    registry.set_alias(COST, "champion", "2")
    decision = promote(fresh, tmp_path, GOOD)
    assert decision["candidate_over_champion_median"] < 0.9
    # Clear of the margin and of the ruler's A/A floor: a difference, not noise.
    assert decision["candidate_vs_champion"]["ci_high"] < min(0.99, decision["aa_floor"]["ci_low"])
    if slower_than_baselines(decision):
        assert decision["verdict"] == "challenger"  # never promoted while measurably slower than a heuristic
        return
    assert decision["promoted"] is True and decision["reason"].startswith("faster than the champion")
    assert decision["champion_version_before"] == BAD and decision["champion_version_after"] == GOOD
    assert aliases(POLICY) == {"champion": GOOD}
    assert aliases(COST) == {"champion": "1"}  # the cost model follows the policy back to v1
    assert promote_run(GOOD)["metrics.promoted"] == 1.0


def test_a_candidate_not_better_by_the_margin_gets_challenger(fresh, tmp_path):
    """Margin 0.9 (the Param's maximum): only a candidate 10x faster than the champion could pass."""
    registry.set_alias(POLICY, "champion", GOOD)
    registry.set_alias(COST, "champion", "1")
    decision = promote(fresh, tmp_path, GOOD_TOO, margin=0.9)
    assert decision["promoted"] is False and decision["margin"] == 0.9
    assert decision["candidate_over_champion_median"] > 0.1
    assert decision["verdict"] == "challenger"
    assert aliases(POLICY) == {"champion": GOOD, "challenger": GOOD_TOO}
    assert aliases(COST) == {"champion": "1", "challenger": "1"}
    ev = pd.read_parquet(tmp_path / "evaluation" / "evaluation.parquet")
    assert set(ev["planner"]) == {f"learned/{GOOD_TOO}", f"learned/{GOOD}", *BASELINES, f"{BASELINES[0]}#2"}
    assert promote_run(GOOD_TOO)["metrics.promoted"] == 0.0
