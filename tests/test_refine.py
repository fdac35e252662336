"""Measured refinement (embshard.refine, `embshard place --refine K`): the K best distinct candidates measured side
by side with the ruler on real FBGEMM CPU kernels, the measured best returned."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from fixed_models import analytic

from embshard import schemas
from embshard.bench.runner import MeasureSettings
from embshard.errors import EmbshardError
from embshard.planners.compose import shard_sets
from embshard.planners.learned import LearnedPlanner
from embshard.refine import MAX_K, candidates, check_k, choose_winner, refine, select, winner_placement
from embshard.tableset import TableSet

SETTINGS = MeasureSettings(batch_size=256, iterations=10, warmup=2, comm_bandwidth_gbps=10.0, comm_latency_us=20.0,
                           max_shard_gb=0.05)


@pytest.fixture(scope="module")
def learned(small_tables_df):
    tables = TableSet.from_frame(small_tables_df).subset(np.arange(10))
    planner = LearnedPlanner(None, analytic(), composition_name="no_policy", search_evaluations=2000)
    return planner.plan(tables, 3, 2**40, "t"), planner.cost_model


def test_the_planner_keeps_distinct_final_drafts_as_alternatives(learned):
    pl, _ = learned
    keys = [shard_sets(p.shards) for p in [pl, *pl.alternatives]]
    assert pl.alternatives and len(set(keys)) == len(keys)
    assert "alternatives" not in pl.meta  # kept beside the plan, never written into plan.json


def test_winner_rule_a_noisy_lowest_median_does_not_hide_a_measurably_faster_candidate():
    rng = np.random.default_rng(0)
    first = 10 + rng.normal(0, 0.05, 6)
    steady = first * 0.8                                     # measurably faster in every round
    noisy = first * np.array([0.5, 0.5, 0.5, 0.6, 1.3, 1.4])  # lower median, interval across 1
    slower = first * 1.2
    assert choose_winner(np.stack([first, noisy, steady, slower])) == (2, 1)
    assert choose_winner(np.stack([first, noisy, slower])) == (0, 1)  # nothing clears: the first choice
    assert choose_winner(np.stack([first, steady * 0.9, steady])) == (1, 1)


def test_winner_is_the_measurably_fastest_candidate_or_the_first_choice_and_duplicates_once(learned):
    pl, model = learned
    res = refine(pl, 4, rounds=2, settings=SETTINGS, cost_model=model, torchrec=False)
    t = res.table
    assert len(t) == len(set(t["candidate"])) <= 4 and t.iloc[0]["candidate"] == pl.planner
    assert res.winner.label in set(t["candidate"])
    lowest = t["measured_cost_ms"].idxmin()
    clear = t.iloc[1:][t.iloc[1:]["ratio_ci_high"] < 1.0]
    if len(clear):  # the measurably faster candidate of lowest median wins ...
        assert t.loc[clear["measured_cost_ms"].idxmin(), "winner"]
    else:  # ... else the first choice is kept
        assert t.iloc[0]["winner"]
    winner = int(np.flatnonzero(t["winner"])[0])
    assert res.not_clear == (None if winner == lowest else t.loc[lowest, "candidate"])  # the report says which
    keys = [shard_sets(c.placement.shards) for c in select(candidates(pl, model, torchrec=False), 16)]
    assert len(keys) == len(set(keys))  # equal shard sets: one candidate, measured once
    dup = candidates(pl, model, torchrec=False)
    assert len(select(dup + dup, 16)) == len(select(dup, 16))
    out = winner_placement(res, 4)
    assert out.meta["refined"]["k"] == 4 and out.meta["refined"]["winner"] == res.winner.label
    assert [m["candidate"] for m in out.meta["refined"]["measured"]] == list(t["candidate"])
    assert out.planner == pl.planner and not out.alternatives
    out.check()


def test_from_k_3_one_candidate_is_a_plan_the_model_did_not_make(learned):
    """Where the planner's own kinds are all predicted cheaper than every heuristic, one of k >= 3 slots still goes
    to the best predicted heuristic (on a GPU the model's plans can all lose to one); k = 2 stays the best
    predicted alternative, and a heuristic already picked is not picked twice."""
    import dataclasses

    pl, model = learned
    cands = candidates(pl, model, torchrec=False)
    first = cands[0]
    own = [c for c in cands[1:] if c.label.startswith(f"{first.label}~")]
    heur = [c for c in cands[1:] if not c.label.startswith(f"{first.label}~")]
    assert own and len(heur) >= 2
    # The planner's drafts predicted cheapest, the heuristics dearer (the second one the cheaper of them).
    fake = [first] + [dataclasses.replace(c, predicted_ms=1.0 + 0.01 * j) for j, c in enumerate(own)] + \
        [dataclasses.replace(c, predicted_ms=50.0 - j) for j, c in enumerate(heur)]
    for k in (3, 4, 6):
        picked = select(fake, k)
        outside = [c for c in picked[1:] if not c.label.startswith(f"{first.label}~")]
        assert len(picked) == min(k, len(fake)) and picked[0] is first
        assert outside and outside[0].label == heur[-1].label  # the best predicted heuristic
    assert select(fake, 2)[1].label == own[0].label  # k = 2: the best predicted alternative only
    mixed = [first, dataclasses.replace(heur[0], predicted_ms=0.5)] + fake[1:1 + len(own)]
    assert [c.label for c in select(mixed, 3)][:2] == [first.label, heur[0].label]
    assert sum(not c.label.startswith(f"{first.label}~") for c in select(mixed, 3)[1:]) == 1


def test_k_1_returns_the_learned_plan(learned):
    pl, model = learned
    res = refine(pl, 1, rounds=2, settings=SETTINGS, cost_model=model, torchrec=False)
    assert len(res.table) == 1 and res.winner.placement is pl
    assert res.ratio[0] == 1.0


@pytest.mark.parametrize("k", [0, -1, MAX_K + 1, 2.5, True])
def test_bad_k_is_one_line_error(k):
    with pytest.raises(EmbshardError) as exc:
        check_k(k)
    assert "refine" in str(exc.value) and len(str(exc.value).splitlines()) == 1


def _cli(args, tmp_path):
    env = {**os.environ, "EMBSHARD_CALIBRATION_DIR": str(tmp_path / "calib")}
    return subprocess.run([sys.executable, "-m", "embshard", *args], capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.parametrize("flags", [["--refine", "0"], ["--refine", "2", "--refine-rounds", "1"]])
def test_place_refine_0_is_an_error_not_off_and_one_round_is_refused(small_tables_path, tmp_path, flags):
    """--refine 0 is not "off"; one round gives no interval, so no candidate could ever win (it ran and said
    'not measurably faster')."""
    proc = _cli(["place", "--tables", str(small_tables_path), "--planner", "size_greedy", "--devices", "2",
                 "--memory-gb", "64", *flags, "--out", str(tmp_path / "o")], tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "refine" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_pipeline_refining_in_one_round_is_refused_before_any_work():
    from embshard import params
    from embshard.errors import EmbshardError

    with pytest.raises(EmbshardError, match="eval_rounds: one round gives no interval: the promotion gate and "
                                             "refine_k 2"):
        params.check({"refine_k": 2, "eval_rounds": 1})
    # nor does the gate's verdict on single measurements (it read "measurably slower" from 2 numbers)
    with pytest.raises(EmbshardError, match="eval_rounds: one round gives no interval: the promotion gate would"):
        params.check({"refine_k": 0, "eval_rounds": 1})
    assert params.check({"refine_k": 0, "eval_rounds": 2})["eval_rounds"] == 2


def test_place_refine_end_to_end_writes_the_refined_plan(small_tables_df, tmp_path):
    tables = str(tmp_path / "tables.parquet")
    schemas.write(small_tables_df.head(6), tables, "tables")
    out = tmp_path / "placed"
    given = tmp_path / "given"  # --calibration-dir, as evaluate takes it, over EMBSHARD_CALIBRATION_DIR
    proc = _cli(["place", "--tables", tables, "--planner", "size_greedy", "--devices", "2", "--memory-gb", "64",
                 "--refine", "2", "--refine-rounds", "2", "--calibration-dir", str(given), "--out", str(out)],
                tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "measured refinement on cpu" in proc.stdout and "winner:" in proc.stdout
    assert "median of the rounds' paired ratios" in proc.stdout  # not the ratio of the medians beside it
    assert "x the planner's first choice (size_greedy)" in proc.stdout  # not "the learned plan's"
    # 2 rounds: the "interval" is their range (it covers the median half the time), said so, not "95%"
    assert "[range of 2 rounds (covers the median 50% of the time):" in proc.stdout and "95%:" not in proc.stdout
    assert ", refined by measurement: " in proc.stdout  # the header names the plan written (or the first kept)
    assert [p.name for p in given.iterdir()] and not (tmp_path / "calib").exists()
    plan = json.loads((out / "plan.json").read_text())
    refined = plan["meta"]["refined"]
    assert refined["k"] == 2 and refined["rounds"] == 2 and refined["winner_origin"]
    assert refined["measured_on"].startswith("cpu")


def test_export_stage_places_the_refined_plans_and_says_what_won(small_tables_path, tmp_path):
    from embshard.jobs import tasks
    from embshard.jobs.export import place_tasks
    from embshard.planners.baselines import make_baseline

    tasks_path = tasks.run(str(small_tables_path), str(tmp_path), num_tasks=2, tables_per_task="4-6", devices=2,
                           memory_gb=64, seed=0)
    out = place_tasks(str(small_tables_path), tasks_path, make_baseline("size_greedy"),
                      str(tmp_path / "export" / "planned.parquet"), split="all", refine_k=2, refine_rounds=2,
                      settings=SETTINGS)
    df = schemas.read(out, "placements")
    refined = json.loads((tmp_path / "export" / "refine.json").read_text())
    assert set(refined) == set(df["task_id"]) and all(r["k"] == 2 and r["rounds"] == 2 for r in refined.values())
    assert set(df["planner"]) == {"size_greedy"}  # the planner's refined answer, under its own name


def test_an_evaluation_entry_name_refine_k_measures_the_refined_plan(small_tables_path, tmp_path):
    """`NAME+refineK`: NAME's plan refined by measuring K candidates, then measured by the evaluation like any
    plan (its planning time includes the refinement's rounds)."""
    from embshard import evaluation
    from embshard.jobs import tasks

    tasks_path = tasks.run(str(small_tables_path), str(tmp_path), num_tasks=2, tables_per_task="4-6", devices=2,
                           memory_gb=64, seed=0)
    res = evaluation.run(str(small_tables_path), tasks_path, str(tmp_path / "ev"), rounds=2, settings=SETTINGS,
                         planners=["size_greedy+refine3", "size_greedy", "lookup_greedy"], max_tasks=1,
                         progress=False)
    df = res["frame"].set_index("planner")
    assert df["feasible"].all() and np.isfinite(df["measured_cost_ms"]).all()
    # size_greedy's own plan is the first candidate; the refinement measured it beside two others first
    assert df.loc["size_greedy+refine3", "planning_time_s"] > 10 * df.loc["size_greedy", "planning_time_s"]
    # what the refinement measured is in its row, to read back (the other entries have none)
    measured = json.loads(df.loc["size_greedy+refine3", "refinement"])["measured"]
    assert measured[0]["candidate"] == "size_greedy" and measured[0]["ratio_to_first_choice"][0] == 1.0
    assert 1 <= len(measured) <= 3 and df.drop(index="size_greedy+refine3")["refinement"].isna().all()
    placed = schemas.read(str(tmp_path / "ev" / "placements.parquet"), "placements")
    assert "size_greedy+refine3" in set(placed["planner"])


@pytest.mark.parametrize("name, field_text", [("size_greedy+refine0", "1 to"), ("size_greedy+refine17", "1 to"),
                                              ("nope+refine2", "unknown planner"), ("size_greedy+refine", "unknown")])
def test_a_bad_refined_entry_name_is_a_one_line_error(name, field_text):
    from embshard.evaluation import check_planner_names

    with pytest.raises(EmbshardError) as exc:
        check_planner_names([name])
    assert field_text in str(exc.value) and len(str(exc.value).splitlines()) == 1


def test_a_refinement_asks_a_composed_planner_to_explore_its_cuts_and_leaves_others_alone(learned):
    from embshard.planners.baselines import make_baseline
    from embshard.refine import RefinedPlanner, explore

    greedy = make_baseline("size_greedy")
    explore(greedy)
    assert not hasattr(greedy, "explore_cuts")
    composed = LearnedPlanner(None, analytic(), composition_name="no_policy", search_evaluations=500)
    assert composed.explore_cuts is False
    RefinedPlanner(composed, 2)
    assert composed.explore_cuts is True


def test_place_refine_warns_when_the_model_was_priced_for_another_network(tmp_path, caplog):
    """`place --refine` measures with this machine's stored calibration; a model trained on one 2.2x apart is named
    in one warning (and nothing is calibrated just to check: no stored calibration, no warning)."""
    import json
    import logging
    from types import SimpleNamespace

    from embshard.bench.comm import CALIBRATION_FILE
    from embshard.jobs import place

    trained = {"latency_s": 1.5e-4, "bandwidth_Bps": 1.48e9, "source": "calibrated:gloo-2proc"}
    model = SimpleNamespace(config=SimpleNamespace(comm_calibration=trained))
    with caplog.at_level(logging.WARNING, logger=place.log.name):
        place._warn_if_priced_for_another_network(model, "cpu:test", str(tmp_path / "none"))
        assert not caplog.records
        (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"cpu:test": {
            "latency_s": 2.4e-4, "bandwidth_Bps": 0.66e9, "source": "calibrated:gloo-2proc"}}))
        place._warn_if_priced_for_another_network(model, "cpu:test", str(tmp_path))
    assert len(caplog.records) == 1 and "1.48 GB/s" in caplog.records[0].getMessage()
