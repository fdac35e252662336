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
    """The module store with no aliases set and every policy version back to `pending`."""
    import mlflow

    client = mlflow.MlflowClient()
    for name in (POLICY, COST):
        for alias in list(client.get_registered_model(name).aliases):
            client.delete_registered_model_alias(name, alias)
    for version in (GOOD, BAD, GOOD_TOO):
        registry.set_verdict(POLICY, version, registry.PENDING)
        for tag in ("airflow.run_id", registry.HEALTH_TAG, registry.HEALTH_REASON_TAG):
            if tag in client.get_model_version(POLICY, version).tags:
                client.delete_model_version_tag(POLICY, version, tag)
    return store


def verdict_tag(version: str) -> str:
    import mlflow

    return mlflow.MlflowClient().get_model_version(POLICY, version).tags[registry.VERDICT_TAG]


def health_tag(version: str) -> str | None:
    import mlflow

    return mlflow.MlflowClient().get_model_version(POLICY, version).tags.get(registry.HEALTH_TAG)


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
    # Registered but not judged yet: the gate replaces `pending` with its verdict.
    assert {t[registry.VERDICT_TAG] for t in tags.values()} == {"pending"}


def comp(median, lo, hi, tasks=10):
    return {"median": median, "ci_low": lo, "ci_high": hi, "wilcoxon_p": 0.01, "tasks": tasks}


FLOOR = {"median": 1.0, "ci_low": 0.95, "ci_high": 1.06}  # a noisy ruler's A/A floor


def slower_than_baselines(decision: dict) -> bool:
    """The gate's own reading of 'measurably slower': the interval clears 1 and the A/A floor's interval."""
    vs, floor = decision["candidate_vs_best_baseline"], decision["aa_floor"]
    return vs["ci_low"] > max(1.0, floor["ci_high"])


@pytest.mark.parametrize("vs_champion, vs_baseline, failed, floor, verdict, reason", [
    (None, comp(1.03, 1.01, 1.05), False, FLOOR, "promoted", "no champion yet"),
    (None, comp(1.10, 1.07, 1.12), False, FLOOR, "measurably_slower", "measurably slower than the best baseline"),
    # A first champion 16% slower in the median, its interval just inside the floor, was crowned: now undecided.
    (None, comp(1.163, 1.006, 1.369), False, {"median": 1.0, "ci_low": 0.99, "ci_high": 1.012}, "undecided",
     "slower than the best baseline in the median"),
    (comp(0.95, 0.92, 0.98), comp(0.95, 0.90, 0.99), False, FLOOR, "undecided", "not beyond the ruler's noise"),
    (comp(0.90, 0.88, 0.94), comp(0.95, 0.90, 0.99), False, FLOOR, "promoted", "faster than the champion"),
    (comp(1.02, 1.00, 1.05), comp(0.95, 0.90, 0.99), False, FLOOR, "not_better", "not faster than the champion"),
    (comp(1.05, 1.03, 1.07), comp(0.95, 0.90, 0.99), False, FLOOR, "not_better", "not faster than the champion"),
    (comp(1.10, 1.07, 1.12), comp(0.95, 0.90, 0.99), False, FLOOR, "measurably_slower", "slower than the champion"),
    # No baseline measured (eval_planners of TorchRec planners only, before they counted): it crowned a champion
    # on "nan [nan, nan] over 0 tasks".
    (None, comp(float("nan"), float("nan"), float("nan"), tasks=0), False, FLOOR, "undecided",
     "no baseline was measured"),
])
def test_a_difference_inside_the_rulers_a_a_floor_is_no_difference(vs_champion, vs_baseline, failed, floor,
                                                                    verdict, reason):
    from embshard.jobs.promote import decide

    got, why = decide(vs_champion, vs_baseline, margin=0.01, failed=failed, floor=floor)
    assert got == verdict and reason in why


REGRESSED = comp(1.15, 1.10, 1.20)  # a champion measured slower than the best baseline beyond FLOOR
HEALTHY = comp(1.03, 0.98, 1.08)    # slower in the median, inside the floor: no difference


@pytest.mark.parametrize("vs_champion, vs_baseline, champion_vs_baseline, verdict, reason", [
    # A candidate as good as the baselines replaces a regressed champion without clearing the margin against it.
    (comp(0.99, 0.95, 1.03), comp(1.00, 0.97, 1.03), REGRESSED, "promoted", "the champion is measurably slower"),
    # ... but not one slower than the champion in the median, nor one slower than the baselines in the median.
    (comp(1.01, 0.97, 1.05), comp(1.00, 0.97, 1.03), REGRESSED, "undecided", "straddles"),
    (comp(0.95, 0.90, 1.00), comp(1.07, 1.00, 1.09), REGRESSED, "undecided", "straddles"),
    # Measurably slower than the baselines itself: never promoted, whatever the champion.
    (comp(0.90, 0.85, 0.95), comp(1.12, 1.08, 1.15), REGRESSED, "measurably_slower", "best baseline"),
    # A healthy champion: the usual rule (the margin and the floor against the champion).
    (comp(0.99, 0.95, 1.03), comp(1.00, 0.97, 1.03), HEALTHY, "undecided", "straddles"),
])
def test_a_champion_slower_than_the_baselines_is_replaced_by_a_candidate_as_good_as_them(
        vs_champion, vs_baseline, champion_vs_baseline, verdict, reason):
    from embshard.jobs.promote import champion_regressed, decide

    assert champion_regressed(REGRESSED, FLOOR) and not champion_regressed(HEALTHY, FLOOR)
    got, why = decide(vs_champion, vs_baseline, margin=0.01, failed=False, floor=FLOOR,
                      champion_vs_baseline=champion_vs_baseline)
    assert got == verdict and reason in why


def test_a_regressed_champion_keeps_its_alias_is_tagged_and_loading_it_warns(fresh, caplog):
    """record_champion_health on a real registry: the tag, the warning, the alias kept; `load_planner` of the
    champion warns; a later healthy measurement clears the tag."""
    import logging

    from embshard.jobs.promote import record_champion_health
    from embshard.planners.registered import load_planner

    registry.set_alias(POLICY, "champion", GOOD)
    with caplog.at_level(logging.WARNING):
        assert record_champion_health(GOOD, REGRESSED, FLOOR, replaced=False) == "regressed"
    assert health_tag(GOOD) == "regressed" and aliases(POLICY) == {"champion": GOOD}
    assert "keeps its alias" in caplog.text and "1.150 [1.100, 1.200]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_planner(registry.alias_uri(POLICY))
    assert f"models:/{POLICY}/{GOOD} measured slower than the best baseline" in caplog.text
    assert record_champion_health(GOOD, HEALTHY, FLOOR, replaced=False) == "ok" and health_tag(GOOD) == "ok"
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_planner(registry.alias_uri(POLICY))
    assert "measured slower" not in caplog.text


@pytest.mark.parametrize("vs_champion, vs_baseline, failed, verdict, reason", [
    (None, comp(0.95, 0.90, 0.99), False, "promoted", "no champion yet"),
    (None, comp(1.00, 0.97, 1.03), False, "promoted", "no champion yet"),
    (None, comp(1.02, 0.97, 1.05), False, "undecided", "no champion yet, but slower"),
    # Measurably slower than the best baseline: never promoted, even as the first champion.
    (None, comp(1.03, 1.01, 1.05), False, "measurably_slower", "measurably slower than the best baseline"),
    (comp(0.80, 0.70, 0.90), comp(1.03, 1.01, 1.05), False, "measurably_slower", "measurably slower"),
    (comp(0.95, 0.92, 0.98), comp(0.95, 0.90, 0.99), False, "promoted", "faster than the champion"),
    (comp(0.98, 0.96, 1.00), comp(0.95, 0.90, 0.99), False, "undecided", "straddles"),
    (comp(1.02, 1.00, 1.05), comp(0.95, 0.90, 0.99), False, "not_better", "not faster than the champion"),
    (comp(1.04, 1.02, 1.05), comp(0.95, 0.90, 0.99), False, "measurably_slower", "slower than the champion"),
    (comp(0.95, float("nan"), float("nan"), 1), comp(0.95, 0.9, 0.99), False, "undecided", "too few"),
    (comp(0.50, 0.40, 0.60), comp(0.5, 0.4, 0.6), True, "infeasible", "failed to place"),
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
        # ... and not challenger either: that alias is for undecided candidates only.
        assert decision["verdict"] == "measurably_slower" and aliases(POLICY) == {}
    elif vs["median"] > max(1.0, floor["ci_high"]):  # slower in the median, within the noise: not crowned
        assert decision["verdict"] == "undecided" and aliases(POLICY) == {"challenger": GOOD}
    else:
        assert decision["verdict"] == "promoted" and decision["reason"].startswith("no champion yet")
        assert decision["champion_version_after"] == GOOD and aliases(POLICY) == {"champion": GOOD}
        assert aliases(COST) == {"champion": "1"}  # the cost model follows its policy
    assert verdict_tag(GOOD) == decision["verdict"]
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
    registry.set_alias(POLICY, "challenger", GOOD_TOO)  # an earlier undecided candidate keeps the alias
    registry.set_alias(COST, "challenger", "1")
    decision = promote(fresh, tmp_path, BAD)
    assert decision["verdict"] == "measurably_slower" and decision["promoted"] is False
    assert decision["reason"].startswith("measurably slower than the best baseline")
    assert slower_than_baselines(decision)
    assert decision["champion_version_after"] is None
    assert aliases(POLICY) == {"challenger": GOOD_TOO} and aliases(COST) == {"challenger": "1"}
    assert verdict_tag(BAD) == "measurably_slower"


def test_a_worse_candidate_leaves_the_champion_where_it_was(fresh, tmp_path):
    registry.set_alias(POLICY, "champion", GOOD)
    registry.set_alias(COST, "champion", "1")
    decision = promote(fresh, tmp_path, BAD)
    assert decision["promoted"] is False
    assert decision["champion_version_before"] == decision["champion_version_after"] == GOOD
    # Genuinely worse when measured, not a near tie decided by noise: the whole interval is above 1.
    assert decision["candidate_over_champion_median"] > 1.1
    assert decision["candidate_vs_champion"]["ci_low"] > 1.0
    # Measurably slower (than a baseline or the champion): it takes no alias, and its version says why.
    assert decision["verdict"] == "measurably_slower" and verdict_tag(BAD) == "measurably_slower"
    assert aliases(POLICY) == {"champion": GOOD}
    assert aliases(COST) == {"champion": "1"}
    # The champion measured beside it is checked too: its health tag agrees with its interval.
    champ, floor = decision["champion_vs_best_baseline"], decision["aa_floor"]
    regressed = champ["ci_low"] > max(1.0, floor["ci_high"])
    assert health_tag(GOOD) == decision["champion_health"] == ("regressed" if regressed else "ok")
    run = promote_run(BAD)
    assert run["metrics.promoted"] == 0.0 and run["tags.decision"] == "measurably_slower"
    assert run["metrics.candidate_vs_champion_median"] == pytest.approx(decision["candidate_over_champion_median"])
    # Why it is worse: its cost model put every table on one device, the champion spread them.
    placed = pd.read_parquet(tmp_path / "evaluation" / "placements.parquet")
    devices = placed.groupby(["planner", "task_id"])["device"].nunique().groupby("planner").max()
    assert devices[f"learned/{BAD}"] == 1 and devices[f"learned/{GOOD}"] == 2


def test_a_better_candidate_replaces_a_worse_champion(fresh, tmp_path):
    """The champion is the piling planner: measured slower than the baselines (regressed), so a candidate as good
    as the baselines replaces it without having to clear the margin against it."""
    registry.set_alias(POLICY, "champion", BAD)
    registry.set_alias(COST, "champion", "2")
    registry.set_alias(POLICY, "challenger", GOOD_TOO)  # undecided against the champion about to be replaced
    registry.set_alias(COST, "challenger", "1")
    decision = promote(fresh, tmp_path, GOOD)
    assert decision["candidate_over_champion_median"] < 0.9
    champ, floor = decision["champion_vs_best_baseline"], decision["aa_floor"]
    assert champ["ci_low"] > max(1.0, floor["ci_high"])  # the piling champion: measurably slower than a heuristic
    assert decision["champion_health"] == "regressed" and health_tag(BAD) == "regressed"
    assert promote_run(GOOD)["metrics.champion_vs_best_baseline_median"] == pytest.approx(champ["median"])
    from embshard.stage_report import promotion_lines

    assert any("champion vs the best baseline" in line and "REGRESSED" in line
               for line in promotion_lines(decision, str(tmp_path)))
    if slower_than_baselines(decision):
        assert decision["verdict"] == "measurably_slower"  # never promoted while measurably slower than a heuristic
        assert aliases(POLICY)["champion"] == BAD  # a regressed champion keeps its alias until replaced
        return
    if decision["candidate_vs_best_baseline"]["median"] > max(1.0, floor["ci_high"]):
        assert decision["verdict"] != "promoted" or decision["reason"].startswith("faster than the champion")
        return
    assert decision["promoted"] is True
    assert decision["reason"].startswith(("the champion is measurably slower", "faster than the champion"))
    assert decision["champion_version_before"] == BAD and decision["champion_version_after"] == GOOD
    # The old challenger was undecided against the old champion: the promotion removes the alias.
    assert aliases(POLICY) == {"champion": GOOD}
    assert aliases(COST) == {"champion": "1"}  # the cost model follows the policy back to v1
    assert verdict_tag(GOOD) == "promoted"
    assert promote_run(GOOD)["metrics.promoted"] == 1.0


def test_a_candidate_not_better_by_the_margin_takes_no_alias(fresh, tmp_path):
    """Margin 0.9 (the Param's maximum): only a candidate 10x faster than the champion could pass. Decided (not
    better, or measurably slower), so `challenger` stays with the earlier undecided candidate."""
    registry.set_alias(POLICY, "champion", GOOD)
    registry.set_alias(COST, "champion", "1")
    registry.set_alias(POLICY, "challenger", BAD)  # stands in for an earlier undecided candidate
    registry.set_alias(COST, "challenger", "2")
    decision = promote(fresh, tmp_path, GOOD_TOO, margin=0.9)
    assert decision["promoted"] is False and decision["margin"] == 0.9
    assert decision["candidate_over_champion_median"] > 0.1
    assert decision["verdict"] in ("not_better", "measurably_slower")
    assert verdict_tag(GOOD_TOO) == decision["verdict"]
    assert aliases(POLICY) == {"champion": GOOD, "challenger": BAD}
    assert aliases(COST) == {"champion": "1", "challenger": "2"}
    ev = pd.read_parquet(tmp_path / "evaluation" / "evaluation.parquet")
    assert set(ev["planner"]) == {f"learned/{GOOD_TOO}", f"learned/{GOOD}", *BASELINES, f"{BASELINES[0]}#2"}
    assert promote_run(GOOD_TOO)["metrics.promoted"] == 0.0


def test_the_registry_records_each_verdict_and_challenger_only_follows_undecided(fresh, monkeypatch):
    """record_verdict without a measurement: the gate's bookkeeping on a real registry."""
    import mlflow

    from embshard.jobs.promote import record_verdict

    client = mlflow.MlflowClient()
    registry.set_alias(POLICY, "champion", GOOD)
    assert record_verdict(GOOD_TOO, "undecided", "straddles") == []
    assert aliases(POLICY) == {"champion": GOOD, "challenger": GOOD_TOO} and verdict_tag(GOOD_TOO) == "undecided"
    assert aliases(COST) == {"challenger": "1"}
    record_verdict(BAD, "measurably_slower", "slower")  # the undecided one keeps the alias
    assert aliases(POLICY) == {"champion": GOOD, "challenger": GOOD_TOO}
    # an older run's gate run again (its task cleared) finds its candidate undecided too: `challenger` stays with
    # the newest undecided candidate (it had moved back to the older version)
    assert record_verdict(BAD, "undecided", "straddles again") == []
    assert aliases(POLICY) == {"champion": GOOD, "challenger": GOOD_TOO} and verdict_tag(BAD) == "undecided"
    record_verdict(GOOD_TOO, "not_better", "re-judged")  # re-judged and decided: the alias goes
    assert aliases(POLICY) == {"champion": GOOD} and aliases(COST) == {}
    # A version an earlier Airflow run registered and left pending (that run failed before its gate) is tagged
    # failed_run by the next run's gate; a command-line version (no Airflow run) stays pending.
    for v in (GOOD, BAD, GOOD_TOO):
        registry.set_verdict(POLICY, v, registry.PENDING)
    client.set_model_version_tag(POLICY, BAD, "airflow.run_id", "manual__earlier")
    monkeypatch.setenv("EMBSHARD_AIRFLOW_RUN_ID", "manual__now")
    registry.set_alias(POLICY, "champion", GOOD_TOO)
    assert record_verdict(GOOD, "promoted", "faster") == [BAD]
    # the champion it replaced keeps its verdict and says since when it is no longer champion
    assert f"champion until version {GOOD} was promoted" in client.get_model_version(POLICY, GOOD_TOO).tags[
        "replaced_by"]
    assert verdict_tag(BAD) == "failed_run" and "manual__earlier" in \
        client.get_model_version(POLICY, BAD).tags[registry.VERDICT_REASON_TAG]
    assert verdict_tag(GOOD_TOO) == "pending" and verdict_tag(GOOD) == "promoted"
    # A version the same run root registered before its stage was run again (by hand: no Airflow run) was left
    # pending for good, looking like a run in progress: that root's next gate tags it superseded.
    monkeypatch.delenv("EMBSHARD_AIRFLOW_RUN_ID")
    monkeypatch.setenv("EMBSHARD_RUN_ROOT", "/runs/r1")
    client.set_model_version_tag(POLICY, GOOD_TOO, "embshard.run_root", "/runs/r1")
    assert record_verdict(GOOD, "promoted", "faster") == []
    assert verdict_tag(GOOD_TOO) == "superseded" and f"version {GOOD}" in \
        client.get_model_version(POLICY, GOOD_TOO).tags[registry.VERDICT_REASON_TAG]
    # The pipeline's own candidate of that root (made inside its Airflow run), its stages then run again by hand:
    # the by-hand gate supersedes it too (it stayed pending).
    registry.set_verdict(POLICY, BAD, registry.PENDING)
    client.set_model_version_tag(POLICY, BAD, "embshard.run_root", "/runs/r1")
    assert record_verdict(GOOD, "promoted", "faster") == []
    assert verdict_tag(BAD) == "superseded"
    # An Airflow run's candidate its gate left undecided (the challenger), then a stage of that run cleared and
    # run again, registering another candidate: the run's first one is superseded, and no longer the challenger,
    # whatever the new one's verdict (two undecided versions of one run had read as two open questions).
    monkeypatch.delenv("EMBSHARD_RUN_ROOT")
    monkeypatch.setenv("EMBSHARD_AIRFLOW_RUN_ID", "manual__cleared")
    for v in (BAD, GOOD_TOO):
        client.set_model_version_tag(POLICY, v, "airflow.run_id", "manual__cleared")
    record_verdict(BAD, "undecided", "straddles")
    assert aliases(POLICY)["challenger"] == BAD
    record_verdict(GOOD_TOO, "not_better", "re-run's candidate, decided")
    assert verdict_tag(BAD) == "superseded" and "challenger" not in aliases(POLICY)
    assert "manual__cleared was run again" in client.get_model_version(POLICY, BAD).tags[registry.VERDICT_REASON_TAG]
    assert verdict_tag(GOOD_TOO) == "not_better"  # a decided verdict is never superseded


def test_the_decision_block_says_none_for_a_missing_champion_and_reads_the_verdict():
    from embshard.stages import promotion_lines

    lines = promotion_lines({"verdict": "measurably_slower", "promoted": False, "candidate_version": "4",
                             "champion_version_before": None, "champion_version_after": None,
                             "reason": "measurably slower than the best baseline"}, "/r")
    decision = next(line for line in lines if "decision:" in line)
    assert "vNone" not in decision and "champion before none, after none" in decision
    assert "MEASURABLY SLOWER (no alias)" in decision and "candidate v4" in decision


def test_a_median_whose_interval_holds_the_noise_reads_as_no_difference():
    """`make run` printed '0.929x [95%: 0.857, 1.106] (7.1% faster)': a newcomer read a gain the interval denies."""
    from embshard.stages import promotion_lines

    def line(ci, floor=(0.96, 1.04)):
        decision = {"verdict": "promoted", "candidate_median_ratio_best_baseline": 0.929, "tasks": 12,
                    "candidate_vs_best_baseline": {"median": 0.929, "ci_low": ci[0], "ci_high": ci[1]},
                    "aa_floor": {"planner": "dim_greedy", "median": 1.0, "ci_low": floor[0], "ci_high": floor[1]}}
        return next(x for x in promotion_lines(decision, "/r") if "vs the best baseline" in x)

    assert "(no difference: 7.1% faster at the median, its interval does not clear 1 and the A/A floor)" in \
        line((0.857, 1.106))
    # clear of 1 but not of the floor: said so (it had read "does not clear 1 and the A/A floor" for [0.897, 0.986])
    assert ("(no difference: 7.1% faster at the median, its interval clears 1 but overlaps the A/A floor "
            "[0.900, 1.040])") in line((0.857, 0.95), floor=(0.90, 1.04))
    assert line((0.857, 0.95)).endswith("(7.1% faster)")  # clear of both


def test_the_report_goes_to_the_log_not_stdout(caplog, capsys):
    """Airflow reads a task's stdout and its log records on two channels: a printed report can arrive after the
    "Post Execute" marker and land in that collapsed group; a log record keeps its order."""
    import logging

    from embshard.stages import log_report

    decision = {"verdict": "undecided", "candidate_version": "2", "champion_version_before": "1",
                "champion_version_after": "1", "reason": "straddles", "candidate_median_ratio_best_baseline": 0.97}
    with caplog.at_level(logging.INFO, logger="embshard.stages"):
        log_report("evaluate_and_promote", decision, "/r")
    assert capsys.readouterr().out == ""
    logged = [r.getMessage() for r in caplog.records if r.name == "embshard.stages"]
    assert any("decision: UNDECIDED (now challenger)" in m for m in logged)
    assert all("\n" not in m for m in logged)  # one record per line: the block stays aligned


def test_the_evaluation_summary_has_no_column_that_nothing_filled():
    """No TorchRec planner ran (the default baselines): its ratio column is all NaN and is left out."""
    import numpy as np

    from embshard.jobs.evaluate import format_summary

    summary = pd.DataFrame({"tasks": [2, 2], "median_ratio_best_baseline": [0.98, 1.0],
                            "median_ratio_torchrec": [np.nan, np.nan], "wilcoxon_p": [np.nan, 0.5]},
                           index=pd.Index(["learned/1", "dim_greedy"], name="planner"))
    text = format_summary(summary, rounds=3)
    assert "median_ratio_torchrec" not in text and "median_ratio_best_baseline" in text
    assert "wilcoxon_p" in text  # partly filled columns stay


def test_the_gate_run_again_on_the_champions_own_run_moves_no_alias_or_verdict(fresh, tmp_path):
    """Clearing evaluate_and_promote after its promotion judged the champion as a first champion (and could have
    tagged it anew, or put `challenger` on it): it is re-measured against the baselines, health only."""
    registry.set_alias(POLICY, "champion", GOOD)
    registry.set_alias(COST, "champion", "1")
    registry.set_alias(POLICY, "challenger", GOOD_TOO)
    registry.set_verdict(POLICY, GOOD, "promoted", "faster than the champion: the original gate")
    decision = promote(fresh, tmp_path, GOOD)
    assert decision["verdict"] == "rejudged" and decision["promoted"] is False
    assert decision["reason"].startswith(f"version {GOOD} is the champion already")
    assert decision["champion_version_before"] == decision["champion_version_after"] == GOOD
    assert aliases(POLICY) == {"champion": GOOD, "challenger": GOOD_TOO}
    import mlflow

    tags = mlflow.MlflowClient().get_model_version(POLICY, GOOD).tags
    assert tags[registry.VERDICT_TAG] == "promoted" and tags["verdict_reason"].endswith("the original gate")
    assert tags[registry.HEALTH_TAG] == decision["champion_health"] in ("ok", "regressed")
    from embshard.stage_report import promotion_lines

    assert any("RE-MEASURED the champion" in line for line in promotion_lines(decision, str(tmp_path)))


def test_the_best_baseline_is_the_best_of_the_runs_eval_planners():
    """The gate's best baseline was the best greedy one: a better TorchRec plan in eval_planners was left out, and
    eval_planners of TorchRec planners alone gave no baseline at all."""
    from embshard.jobs.promote import _compare

    rounds = {"t1": {"cand": [1.0, 1.0, 1.0, 1.0, 1.0], "dim_greedy": [2.0] * 5, "torchrec_table_wise": [1.25] * 5},
              "t2": {"cand": [1.0] * 5, "dim_greedy": [2.0] * 5, "torchrec_table_wise": [1.25] * 5}}
    with_torchrec = _compare(rounds, "cand", None, baselines=["dim_greedy", "torchrec_table_wise"])
    assert with_torchrec["median"] == pytest.approx(0.8) and with_torchrec["tasks"] == 2
    assert _compare(rounds, "cand", None, baselines=["dim_greedy"])["median"] == pytest.approx(0.5)
    assert _compare(rounds, "cand", None, baselines=["torchrec_table_wise"])["tasks"] == 2


def test_the_gate_says_when_it_has_fewer_held_out_tasks_than_eval_tasks(fresh, tmp_path, caplog):
    """eval_tasks 10 with 4 held-out tasks evaluated 4, without a word."""
    import logging

    with caplog.at_level(logging.WARNING, logger="embshard.jobs.promote"):
        evaluate_and_promote(fresh["tables"], fresh["tasks"], str(tmp_path / "evaluation"), candidate_version=GOOD,
                             baselines=BASELINES, max_tasks=9, settings=fresh["settings"], rounds=2)
    warned = [r.getMessage() for r in caplog.records if "held-out tasks" in r.getMessage()]
    assert len(warned) == 1 and "eval_tasks 9, but the run has 4 held-out tasks" in warned[0], warned


def test_a_champion_set_by_hand_moves_both_aliases_says_why_and_needs_force_for_a_bad_verdict(fresh, capsys):
    """`embshard champion --set V --reason ...`: the rollback an incident needs without a run. The policy's and
    its cost model's champion move together (the cost model had stayed behind after a rollback by hand), a
    challenger at that version is dropped, the version records who set it and why, and a version the gate measured
    slower needs --force; `embshard champion` lists every version with its aliases and verdict."""
    import mlflow

    from embshard.cli import main
    from embshard.jobs.champion import CHAMPION_SET_TAG

    registry.set_alias(POLICY, registry.CHAMPION, GOOD)
    registry.follow_cost_model(GOOD, registry.CHAMPION)
    registry.set_alias(POLICY, registry.CHALLENGER, BAD)
    registry.set_verdict(POLICY, BAD, registry.SLOWER, "measured 1.2x the best baseline")
    assert main(["champion", "--set", BAD, "--reason", "incident 42"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"version {BAD}'s gate verdict is measurably_slower" in err[0] and "--force" in err[0]
    assert main(["champion", "--set", BAD]) == 2 and "needs a reason" in capsys.readouterr().err
    assert main(["champion", "--set", "99", "--reason", "x"]) == 2 and "has no version 99" in capsys.readouterr().err
    assert int(registry.version_for_alias(POLICY, registry.CHAMPION).version) == int(GOOD)  # nothing moved

    assert main(["champion", "--set", BAD, "--reason", "incident 42", "--force"]) == 0
    out = capsys.readouterr().out
    client = mlflow.MlflowClient()
    cost_of_bad = client.get_model_version(POLICY, BAD).tags["cost_model_version"]
    assert str(registry.version_for_alias(POLICY, registry.CHAMPION).version) == BAD
    assert str(registry.version_for_alias(COST, registry.CHAMPION).version) == cost_of_bad
    assert registry.version_for_alias(POLICY, registry.CHALLENGER) is None  # it was the challenger: dropped
    assert "incident 42" in client.get_model_version(POLICY, BAD).tags[CHAMPION_SET_TAG]
    assert f"champion until version {BAD} was set by hand" in client.get_model_version(POLICY, GOOD).tags[
        "replaced_by"]
    assert f"version {GOOD} -> {BAD}" in out and "set champion by hand" in out and "measurably_slower" in out
    assert main(["champion"]) == 0 and "training jobs load models:/embshard-policy@champion" in \
        capsys.readouterr().out
    # the champion set again: nothing moves, and its recorded reason stays (a user's "1 -> 1" had replaced it)
    tag = client.get_model_version(POLICY, BAD).tags[CHAMPION_SET_TAG]
    assert main(["champion", "--set", BAD, "--reason", "trying it", "--force"]) == 0
    assert f"version {BAD} already, with its cost model: nothing changed" in capsys.readouterr().out
    assert client.get_model_version(POLICY, BAD).tags[CHAMPION_SET_TAG] == tag
