"""The ruler (embshard.ruler, jobs.evaluate with rounds): what is shared, what is measured apart, the statistics,
and the A/A test (a planner named twice) on real FBGEMM measurements."""
from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from embshard import stats
from embshard.bench.runner import MeasureSettings
from embshard.planners.baselines import make_baseline
from embshard.ruler import Entry, distinct_shards, measure_probed, measure_rounds
from embshard.tableset import TableSet

SETTINGS = MeasureSettings(batch_size=256, iterations=10, warmup=2, comm_bandwidth_gbps=10.0, comm_latency_us=20.0,
                           max_shard_gb=0.05)


@pytest.fixture(scope="module")
def tables(small_tables_df):
    return TableSet.from_frame(small_tables_df).subset(np.arange(12))


def test_identical_shards_are_measured_once_per_round_except_for_an_a_a_repeat(tables):
    pl = make_baseline("lookup_greedy").plan(tables, 3, 2**40, "t")
    same = make_baseline("lookup_greedy").plan(tables, 3, 2**40, "t")
    other = make_baseline("round_robin").plan(tables, 3, 2**40, "t")
    assert distinct_shards([Entry("a", pl), Entry("b", same)]) == 3  # two planners, same shards: shared
    assert distinct_shards([Entry("a", pl), Entry("a#2", same, "#2")]) == 6  # A/A: built and timed apart
    assert distinct_shards([Entry("a", pl), Entry("c", other)]) > 3


def test_rounds_give_one_cost_per_entry_and_round_the_max_over_devices(tables):
    pl = make_baseline("lookup_greedy").plan(tables, 3, 2**40, "t")
    rr = make_baseline("round_robin").plan(tables, 3, 2**40, "t")
    costs, dev = measure_rounds([Entry("a", pl), Entry("b", rr), Entry("a#2", pl, "#2")], 3, SETTINGS, seed=1)
    assert costs.shape == (3, 3) and dev.shape == (3, 3, 3)
    assert (costs > 0).all() and np.allclose(costs, dev.max(axis=1))
    assert not np.allclose(costs[0], costs[2])  # the A/A copy was measured, not copied


def test_input_workers_make_the_rounds_inputs_ahead_with_the_same_results(tables, monkeypatch):
    # On a GPU helper processes make the next shards' inputs (EMBSHARD_BENCH_WORKERS forces them here): every
    # measurement of every round still gets its inputs, and the entries' costs keep their shape.
    import embshard.bench.runner as runner

    pl = make_baseline("lookup_greedy").plan(tables, 3, 2**40, "t")
    rr = make_baseline("round_robin").plan(tables, 3, 2**40, "t")
    made = []
    real = runner.InputPrefetcher.get

    def counted(self, k):
        made.append((k, self.workers))
        return real(self, k)

    monkeypatch.setattr(runner.InputPrefetcher, "get", counted)
    monkeypatch.setenv("EMBSHARD_BENCH_WORKERS", "2")
    costs, dev = measure_rounds([Entry("a", pl), Entry("b", rr)], 2, SETTINGS, seed=3)
    n = distinct_shards([Entry("a", pl), Entry("b", rr)])
    assert [k for k, _ in made] == list(range(2 * n)) and {w for _, w in made} == {2}
    assert costs.shape == (2, 2) and (costs > 0).all() and np.allclose(costs, dev.max(axis=1))
    with pytest.raises(ValueError, match="same tables"):
        measure_rounds([Entry("a", pl), Entry("x", make_baseline("round_robin").plan(
            tables.subset(np.arange(6)), 3, 2**40, "t"))], 1, SETTINGS)


def test_probes_are_measured_in_every_round_sharing_a_plans_identical_shard(tables, monkeypatch):
    """The balanced estimate's shards as probes (evaluation.estimate_probes): measured once per round beside the
    entries' shards, in the same order draw; a probe equal to a plan's device shard is that measurement."""
    import embshard.ruler as ruler
    from embshard.evaluation import FUSED_PROBE, balanced_estimate_rounds, estimate_probes
    from embshard.placement import Placement
    from embshard.types import Shard

    # table 0 alone on device 0, the others on devices 1 and 2
    pl = Placement.from_assignment(tables, np.array([0] + [1, 2] * 5 + [1]), 3, 2**40, planner="x", task_id="t")
    timed = []
    real = ruler.measure_shard
    monkeypatch.setattr(ruler, "measure_shard", lambda *a, **k: timed.append(k["where"]) or real(*a, **k))
    alone, t_alone = 0, 0
    probes = estimate_probes(tables)
    out = measure_probed([Entry("a", pl)], 2, SETTINGS, seed=1, probes=probes)
    # 3 plan shards + the fused one + 12 singles, less the single the plan already holds alone, per round
    assert len(timed) == 2 * (3 + 1 + 12 - 1)
    assert set(out.probes) == set(probes) and all(v.shape == (2, 3) for v in out.probes.values())
    assert (out.probes[FUSED_PROBE] > 0).all()
    # the shared single is the plan's device, round by round (heads summed: the device's cost)
    assert np.allclose(out.probes[f"alone:{t_alone}"].sum(1), out.device_costs[0, alone])
    est, table_wise = balanced_estimate_rounds(out.probes, len(tables), 3)
    singles = np.stack([out.probes[f"alone:{i}"] for i in range(len(tables))])
    want = np.minimum(out.probes[FUSED_PROBE], singles.sum(0)).sum(1) / 3
    assert np.allclose(est, want) and (table_wise >= est).all()
    assert probes[FUSED_PROBE] == [Shard(i, 0) for i in range(len(tables))]


@pytest.mark.parametrize("flag, env, want", [(["--calibration-dir", "RUNCAL"], None, "RUNCAL"),
                                              ([], "SHARED", "SHARED"), ([], None, None)])
def test_evaluate_uses_the_calibration_it_is_given(monkeypatch, capsys, tmp_path, flag, env, want):
    """A fresh all-to-all calibration moves from one call to the next (1.03-1.56 GB/s over 8 calls here), and
    comm-heavy plans move with it: `evaluate` reads the run's (--calibration-dir) or the shared one when given."""
    import embshard.jobs.evaluate as job
    from embshard.cli import build_parser

    seen = {}

    def fake_run(*a, settings, **k):
        seen["dir"] = settings.calibration_dir
        frame = pd.DataFrame({"planner": ["a"], "task_id": ["t"], "feasible": [True], "error": [None]})
        return {"summary_text": "", "ranking": {"pairs": 0}, "evaluation": "e", "ratios": "r", "plot": "p",
                "frame": frame}

    monkeypatch.setattr(job, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    os.mkdir("RUNCAL")  # a folder given must exist (a typo would calibrate anew into a new one)
    if env:
        monkeypatch.setenv("EMBSHARD_CALIBRATION_DIR", env)
    else:
        monkeypatch.delenv("EMBSHARD_CALIBRATION_DIR", raising=False)
    args = build_parser().parse_args(["evaluate", "--tables", "t", "--tasks", "k", "--out", "o", *flag])
    assert job.main(args) == 0 and seen["dir"] == want


def test_rounds_in_fresh_processes_measure_every_shard_of_every_round_there(tables, monkeypatch):
    """round_processes: each round in a process spawned for it (ruler.py: the spread between processes then
    shows in the intervals); nothing is measured in this process, and the costs keep their shape."""
    import embshard.ruler as ruler

    pl = make_baseline("lookup_greedy").plan(tables, 3, 2**40, "t")
    rr = make_baseline("round_robin").plan(tables, 3, 2**40, "t")
    here = []
    monkeypatch.setattr(ruler, "measure_shard", lambda *a, **k: here.append(1))  # only this process sees it
    costs, dev = measure_rounds([Entry("a", pl), Entry("b", rr)], 2, SETTINGS.replace(round_processes=True), seed=3)
    assert not here
    assert costs.shape == (2, 2) and (costs > 0).all() and np.allclose(costs, dev.max(axis=1))
    with pytest.raises(ValueError, match="modelled all-to-all"):
        measure_rounds([Entry("a", pl)], 1, SETTINGS.replace(round_processes=True, comm_ranks=2,
                                                             comm_bandwidth_gbps=None, comm_latency_us=None))


def test_statistics():
    med, lo, hi = stats.median_ci([1.0, 1.02, 0.98, 1.01, 0.99])
    assert lo <= med <= hi and lo < 1 < hi
    med, lo, hi = stats.median_ci([1.2, 1.25, 1.22, 1.21, 1.3])
    assert lo > 1.0
    s_med, s_lo, s_hi = stats.suite_ci([np.full(5, 0.9), np.full(5, 0.95), np.full(5, 0.92)])
    assert s_lo <= s_med <= s_hi < 1.0
    assert stats.wilcoxon_p([0.9, 0.92, 0.95, 0.91, 0.93, 0.94]) < 0.05
    assert np.isnan(stats.wilcoxon_p([1.0]))
    # The comparator of round k is chosen on the other rounds: a baseline that is best only by a lucky round k
    # is not the comparator of round k (no winner's curse).
    cost, names = stats.held_out_best({"x": np.array([1.0, 10.0, 10.0]), "y": np.array([5.0, 5.0, 5.0])})
    assert names == ["y", "y", "y"] and list(cost) == [5.0, 5.0, 5.0]


@pytest.mark.parametrize("lo, hi, floor, at, want", [
    (0.90, 0.97, (np.nan, np.nan), 1.0, "faster"),            # no floor measured: only 1 to clear
    (0.90, 0.97, (0.95, 1.05), 1.0, "no difference"),         # below 1, but inside a noisy ruler's floor
    (0.88, 0.94, (0.95, 1.05), 1.0, "faster"),
    (1.03, 1.08, (0.95, 1.05), 1.0, "no difference"),
    (1.06, 1.10, (0.95, 1.05), 1.0, "slower"),
    (1.01, 1.03, (0.99, 1.005), 1.0, "slower"),               # a tight floor: a small difference is real
    (0.94, 0.985, (0.995, 1.01), 0.99, "faster"),             # judged against 1 - margin
    (np.nan, np.nan, (0.95, 1.05), 1.0, "not measured"),
])
def test_a_difference_counts_only_when_it_clears_the_a_a_floor(lo, hi, floor, at, want):
    assert stats.floor_verdict(lo, hi, *floor, at=at) == want


def test_a_planner_named_twice_is_an_a_a_test(measured_world, tmp_path, capsys):
    """`embshard evaluate --planners lookup_greedy,lookup_greedy`: two labelled entries, measured apart; their
    ratio is reported per task with its interval, and the evaluation file carries the rounds."""
    from embshard.cli import main

    out = tmp_path / "aa"
    assert main(["evaluate", "--tables", measured_world["tables"], "--tasks", measured_world["tasks"],
                 "--planners", "lookup_greedy,lookup_greedy", "--rounds", "3", "--batch-size", "256",
                 "--max-tasks", "1", "--out", str(out)]) == 0
    ev = pd.read_parquet(out / "evaluation.parquet")
    assert list(ev["planner"]) == ["lookup_greedy", "lookup_greedy#2"]
    assert (ev["rounds"] == 3).all() and ev["round_costs_ms"].map(len).eq(3).all()
    ratios = pd.read_parquet(out / "ratios.parquet")
    aa = ratios[(ratios["planner"] == "lookup_greedy#2") & (ratios["versus"] == "lookup_greedy")].iloc[0]
    assert aa["ci_low"] <= aa["median_ratio"] <= aa["ci_high"]
    assert 0.8 < aa["median_ratio"] < 1.25  # the same plan: only noise between the two
    assert (out / "evaluation.png").exists()
    # The floor the promotion gate and the quality suites judge against is this very ratio.
    f_med, f_lo, f_hi = stats.aa_floor(ratios, "lookup_greedy")
    assert f_med == pytest.approx(aa["median_ratio"]) and f_lo <= f_med <= f_hi
    assert all(np.isnan(stats.aa_floor(ratios, "dim_greedy")))  # no repeat measured: no floor


def test_evaluate_can_pair_the_balanced_estimate_with_the_plans_round_by_round(measured_world, tmp_path):
    """--estimate-in-rounds: the estimate's shards are measured in every round, so a plan's multiple of it is a
    paired ratio with an interval; without it the multiple has no interval (measured once, outside the rounds)."""
    from embshard.cli import main

    rows = {}
    for flag in ([], ["--estimate-in-rounds"]):
        out = tmp_path / ("paired" if flag else "once")
        assert main(["evaluate", "--tables", measured_world["tables"], "--tasks", measured_world["tasks"],
                     "--planners", "lookup_greedy,dim_greedy", "--rounds", "3", "--batch-size", "256",
                     "--max-tasks", "1", "--out", str(out), *flag]) == 0
        rows[bool(flag)] = pd.read_parquet(out / "evaluation.parquet")
    once, paired = rows[False], rows[True]
    assert not once["estimate_in_rounds"].any() and once["estimate_ratio_ci_low"].isna().all()
    assert np.allclose(once["estimate_ratio"], once["measured_cost_ms"] / once["balanced_estimate_ms"])
    assert paired["estimate_in_rounds"].all()
    assert (paired["estimate_ratio_ci_low"] <= paired["estimate_ratio"]).all()
    assert (paired["estimate_ratio"] <= paired["estimate_ratio_ci_high"]).all()
    assert np.allclose(paired["gap_to_estimate"], paired["estimate_ratio"] - 1.0)
    assert (paired["balanced_estimate_table_wise_ms"] >= paired["balanced_estimate_ms"]).all()


def test_evaluate_help_lists_only_names_it_accepts(capsys):
    from embshard.cli import main

    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    text = capsys.readouterr().out
    assert "baselines" not in text.replace("greedy baselines", "")
    for name in ("learned@ALIAS", "policy_only", "lookup_greedy", "torchrec_full"):
        assert name in text


def test_an_evaluation_on_a_host_without_mlflow_logs_nothing_instead_of_failing(monkeypatch, tmp_path):
    # A bare GPU image measures without MLflow: the evaluation's results must not be lost to its logging step.
    import sys

    from embshard import evaluation

    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` raises ImportError
    summary = pd.DataFrame({"median_ratio_best_baseline": [1.0], "worst_ratio_best_baseline": [1.0],
                            "median_gap_to_estimate": [0.1]}, index=["learned"])
    evaluation._log_to_mlflow(summary, str(tmp_path / "missing.png"))
