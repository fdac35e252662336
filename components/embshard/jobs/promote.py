"""Promotion in the MLflow registry: the candidate planner against the champion and the baselines, measured with
the ruler (embshard.evaluation: R rounds, paired per-round ratios, intervals).

The first baseline is measured a second time as its own entry (an A/A test): its ratio to itself is the ruler's
noise floor in this very evaluation, and a difference whose interval does not clear that floor is no difference.
The gate, on the median over held-out tasks of the per-task ratios (95% interval: bootstrap over tasks and rounds),
gives one verdict (registry.GATE_VERDICTS):
- `infeasible`: the candidate failed to place a task; `measurably_slower`: the whole interval of candidate / best
  greedy baseline (or / champion) lies above 1 and above the A/A floor's interval. Never promoted;
- without a champion, a candidate that is neither and whose median ratio to the best baseline lies within the
  A/A floor (at most 1, or its upper bound) becomes the first champion (`promoted`), else `undecided`;
- with a champion: `promoted` when the whole interval of candidate / champion lies below 1 - margin and below the
  A/A floor's interval; `not_better` when it lies above 1 - margin (not faster by the margin, not measurably
  slower either); otherwise `undecided` (the measurement cannot tell, and a guess would move the champion by noise).
The registry is honest about it: every `embshard-policy` version carries its verdict in the `verdict` tag
(`pending` from registration until a gate judges it; `failed_run` when its Airflow run ended before the gate, set
by the next run's gate). `champion` moves only to a promoted candidate; `challenger` points only at an undecided
one: the newest undecided candidate takes it, a promotion removes it (it was undecided against the old champion),
and any other verdict leaves it where it was. The cost model the candidate was trained against follows its
aliases. decision.json records the intervals, the A/A floor, p-values, rounds and tasks; the decision and its
numbers are logged in MLflow.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from .. import registry, stats, storage
from ..bench.runner import MeasureSettings
from ..policy.model import REGISTERED_NAME as POLICY
from ..ruler import DEFAULT_ROUNDS

log = logging.getLogger(__name__)
COST = registry.COST_MODEL
REJUDGED = "rejudged"  # decision.json only: the gate ran again on the champion's own run (no tag or alias moves)


def _compare(round_costs: dict, a: str, b: str | None, baselines: list[str] | None = None) -> dict:
    """Suite comparison of entry `a` against entry `b` (or, given `baselines`, against each task's best of them,
    chosen on held-out rounds): median, interval, Wilcoxon p, tasks."""
    per_task = []
    for costs in round_costs.values():
        if a not in costs:
            continue
        if baselines is not None:
            # every baseline the run was asked to beat (eval_planners: TorchRec's too): a better TorchRec plan had
            # been left out of the best baseline, and a run of TorchRec baselines alone judged on none (nan)
            measured = {k: np.asarray(v) for k, v in costs.items() if k in baselines}
            if not measured:
                continue
            ref = stats.held_out_best(measured)[0]
        elif b in costs:
            ref = np.asarray(costs[b])
        else:
            continue
        per_task.append(np.asarray(costs[a]) / ref)
    med, lo, hi = stats.suite_ci(per_task)
    task_medians = [float(np.exp(np.median(np.log(r)))) for r in per_task]
    return {"median": med, "ci_low": lo, "ci_high": hi, "wilcoxon_p": stats.wilcoxon_p(task_medians),
            "tasks": len(per_task), "task_medians": task_medians}


def champion_regressed(champion_vs_baseline: dict | None, floor: dict | None) -> bool:
    """Whether the champion measured slower than the best baseline beyond the ruler's A/A floor."""
    if champion_vs_baseline is None:
        return False
    aa_lo, aa_hi = (floor["ci_low"], floor["ci_high"]) if floor else (np.nan, np.nan)
    return stats.floor_verdict(champion_vs_baseline["ci_low"], champion_vs_baseline["ci_high"], aa_lo,
                               aa_hi) == "slower"


def decide(vs_champion: dict | None, vs_baseline: dict, margin: float, failed: bool,
           floor: dict | None = None, champion_vs_baseline: dict | None = None) -> tuple[str, str]:
    """(verdict, reason): verdict one of registry.GATE_VERDICTS. `floor`: the A/A floor (median, ci_low, ci_high;
    None or NaNs when not measured), whose interval a ratio has to clear to count as a difference.
    `champion_vs_baseline`: the champion against the best baseline in the same evaluation (module docstring: a
    regressed champion is replaced by a candidate that is as good as the baselines and not slower than it)."""
    def fmt(c: dict) -> str:
        return f"{c['median']:.3f} [{c['ci_low']:.3f}, {c['ci_high']:.3f}] over {c['tasks']} tasks"

    aa_lo, aa_hi = (floor["ci_low"], floor["ci_high"]) if floor else (np.nan, np.nan)
    aa = f"; A/A floor [{aa_lo:.3f}, {aa_hi:.3f}]" if np.isfinite(aa_lo) and np.isfinite(aa_hi) else ""
    if failed:
        return registry.INFEASIBLE, "the candidate failed to place some tasks"
    if not vs_baseline.get("tasks") or not np.isfinite(vs_baseline["median"]):
        # Nothing to judge by: a verdict on a nan ratio had crowned a champion "over 0 tasks".
        return registry.UNDECIDED, (f"no baseline was measured beside the candidate ({fmt(vs_baseline)}); give "
                                    "eval_planners a baseline that places these tasks")
    if stats.floor_verdict(vs_baseline["ci_low"], vs_baseline["ci_high"], aa_lo, aa_hi) == "slower":
        return registry.SLOWER, f"measurably slower than the best baseline: {fmt(vs_baseline)}{aa}"
    ceiling = max(1.0, aa_hi) if np.isfinite(aa_hi) else 1.0
    if vs_champion is not None and champion_regressed(champion_vs_baseline, floor):
        assert champion_vs_baseline is not None
        if vs_baseline["median"] <= ceiling and vs_champion["median"] <= 1.0:
            return registry.PROMOTED, (f"the champion is measurably slower than the best baseline "
                                       f"({fmt(champion_vs_baseline)}{aa}); the candidate is not "
                                       f"({fmt(vs_baseline)}) and not slower than the champion "
                                       f"({fmt(vs_champion)})")
    if vs_champion is None:
        # The first champion is what training jobs load: "not measurably slower" alone once crowned a candidate
        # at 1.163 [1.006, 1.369] (the floor reached 1.012). Its median must also be within the noise.
        if vs_baseline["median"] > ceiling:
            return registry.UNDECIDED, (f"no champion yet, but slower than the best baseline in the median, though "
                                        f"not beyond the ruler's noise: {fmt(vs_baseline)}{aa}; measure more tasks "
                                        "or rounds to decide")
        return registry.PROMOTED, (f"no champion yet, and not slower than the best baseline "
                                   f"({fmt(vs_baseline)}{aa})")
    if not (np.isfinite(vs_champion["ci_low"]) and np.isfinite(vs_champion["ci_high"])):
        return registry.UNDECIDED, f"too few tasks or rounds for an interval against the champion ({fmt(vs_champion)})"
    if stats.floor_verdict(vs_champion["ci_low"], vs_champion["ci_high"], aa_lo, aa_hi, at=1.0 - margin) == "faster":
        return registry.PROMOTED, f"faster than the champion by more than {margin:.1%}: {fmt(vs_champion)}{aa}"
    if stats.floor_verdict(vs_champion["ci_low"], vs_champion["ci_high"], aa_lo, aa_hi) == "slower":
        return registry.SLOWER, f"measurably slower than the champion: {fmt(vs_champion)}{aa}"
    if vs_champion["ci_low"] > 1.0 - margin:
        return registry.NOT_BETTER, f"not faster than the champion by {margin:.1%}: {fmt(vs_champion)}"
    if vs_champion["ci_high"] < 1.0 - margin:
        return registry.UNDECIDED, (f"faster than the champion, but not beyond the ruler's noise: "
                                    f"{fmt(vs_champion)}{aa}; measure more tasks or rounds to decide")
    return registry.UNDECIDED, (f"the interval against the champion straddles {1 - margin:.3f}: {fmt(vs_champion)}; "
                                "measure more tasks or rounds to decide")


def evaluate_and_promote(tables: str, tasks: str, out: str, *, candidate_version: str,
                         baselines: list[str], max_tasks: int | None = None, margin: float = 0.01,
                         settings: MeasureSettings | None = None, split: str = "test",
                         rounds: int = DEFAULT_ROUNDS) -> dict:
    import mlflow

    from ..evaluation import run as evaluate

    registry.use(out)
    champion = registry.version_for_alias(POLICY, registry.CHAMPION)
    cand_name = f"learned/{candidate_version}"
    planners = [cand_name]
    champ_name = None
    if champion is not None and str(champion.version) != str(candidate_version):
        champ_name = f"learned/{champion.version}"
        planners.append(champ_name)
    planners += baselines
    # The first baseline once more, as its own entry: the A/A floor of this evaluation.
    aa_planner = baselines[0] if baselines else None
    if aa_planner is not None:
        planners.append(aa_planner)
    with registry.start_run(run_name="evaluate-and-promote"):
        res = evaluate(tables, tasks, out, planners=planners, split=split, max_tasks=max_tasks, settings=settings,
                       rounds=rounds)
        df = res["frame"]
        measured = int(df["task_id"].nunique())
        if max_tasks is not None and measured < int(max_tasks):  # said, not silently capped
            log.warning("eval_tasks %d, but the run has %d held-out tasks: the verdict rests on those %d (fix: "
                        "raise num_tasks for more)", int(max_tasks), measured, measured)
        cand = df[df["planner"] == cand_name]
        failed = not cand["feasible"].astype(bool).all()
        vs_baseline = _compare(res["round_costs"], cand_name, None, baselines=baselines)
        vs_champion = _compare(res["round_costs"], cand_name, champ_name) if champ_name else None
        floor = None
        if aa_planner is not None:
            med, lo, hi = stats.aa_floor(res["ratio_frame"], aa_planner)
            floor = {"planner": aa_planner, "median": med, "ci_low": lo, "ci_high": hi}
        champ_vs_baseline = (_compare(res["round_costs"], champ_name, None, baselines=baselines)
                             if champ_name else None)
        # The gate run again on a root whose candidate is the champion now (a stage cleared or re-run after its
        # promotion): it re-measures the champion against the baselines, and moves no alias and no verdict (judged
        # as a first champion, a noisier run once tagged it anew, or put `challenger` on the champion).
        rejudged = champion is not None and str(champion.version) == str(candidate_version)
        health: str | None = None
        if rejudged:
            health = record_champion_health(str(candidate_version), vs_baseline, floor, replaced=False)
            vb = vs_baseline
            verdict, reason = REJUDGED, (f"version {candidate_version} is the champion already (this gate ran "
                                         f"again): it measured {vb['median']:.3f} [{vb['ci_low']:.3f}, "
                                         f"{vb['ci_high']:.3f}] of the best baseline, health {health}; no alias or "
                                         "verdict moved")
            champ_vs_baseline = vs_baseline
        else:
            verdict, reason = decide(vs_champion, vs_baseline, margin, failed, floor, champ_vs_baseline)
        promote = verdict == "promoted"
        if not rejudged and champion is not None and champ_vs_baseline is not None:
            health = record_champion_health(str(champion.version), champ_vs_baseline, floor, replaced=promote)
        decision: dict[str, Any] = {
            "candidate_version": str(candidate_version), "margin": margin, "verdict": verdict, "reason": reason,
            "promoted": promote, "rounds": res["rounds"], "tasks": int(df["task_id"].nunique()),
            "champion_version_before": None if champion is None else str(champion.version),
            "candidate_median_ratio_best_baseline": vs_baseline["median"],
            "candidate_vs_best_baseline": vs_baseline,
            "candidate_over_champion_median": None if vs_champion is None else vs_champion["median"],
            "candidate_vs_champion": vs_champion, "aa_floor": floor,
            "champion_vs_best_baseline": champ_vs_baseline, "champion_health": health}
        decision["failed_runs"] = record_verdict(candidate_version, verdict, reason, judged=not rejudged)
        after = registry.version_for_alias(POLICY, registry.CHAMPION)
        decision["champion_version_after"] = str(after.version) if after is not None else None
        mlflow.log_params({"candidate_version": candidate_version, "margin": margin, "rounds": res["rounds"],
                           "champion_before": decision["champion_version_before"]})
        comparisons: tuple[tuple[str, dict | None], ...] = (
            ("candidate_vs_best_baseline", vs_baseline), ("candidate_vs_champion", vs_champion), ("aa_floor", floor),
            ("champion_vs_best_baseline", champ_vs_baseline))
        for key, comp in comparisons:
            for k in ("median", "ci_low", "ci_high", "wilcoxon_p"):
                value = None if comp is None else comp.get(k)
                if isinstance(value, float) and np.isfinite(value):
                    mlflow.log_metric(f"{key}_{k}", value)
        mlflow.log_metric("promoted", float(promote))
        mlflow.set_tags({"decision": verdict, "reason": reason[:250]})
        if "://" not in res["evaluation"]:
            mlflow.log_artifact(res["evaluation"])
        storage.write_text(storage.join(out, "decision.json"), json.dumps(decision, indent=1, default=float))
        decision["summary"] = res["summary_text"]
    log.info("promotion: %s (%s)", verdict, reason)
    return decision


def record_champion_health(version: str, champion_vs_baseline: dict, floor: dict | None, replaced: bool) -> str:
    """Tag the champion version measured in this gate with its health (registry.HEALTH_TAG): `regressed` when it
    measured slower than the best baseline beyond the A/A floor, else `ok`. A regressed champion that the candidate
    does not replace keeps its alias, and the log says so. Returns the health."""
    c = champion_vs_baseline
    measured = f"{c['median']:.3f} [{c['ci_low']:.3f}, {c['ci_high']:.3f}] over {c['tasks']} tasks"
    if not champion_regressed(c, floor):
        registry.set_health(POLICY, version, registry.HEALTH_OK, f"champion / best baseline {measured}")
        return registry.HEALTH_OK
    registry.set_health(POLICY, version, registry.HEALTH_REGRESSED,
                        f"measured slower than the best baseline: {measured}")
    if not replaced:
        log.warning("the champion (version %s) measured slower than the best baseline: %s; it keeps its alias "
                    "(training jobs load it) until a candidate as good as the baselines replaces it", version,
                    measured)
    return registry.HEALTH_REGRESSED


def record_verdict(candidate_version: str, verdict: str, reason: str, judged: bool = True) -> list[str]:
    """The gate's verdict in the registry: the candidate's `verdict` tag, the aliases (champion to a promoted
    candidate; challenger to an undecided one, removed on a promotion, else left where it was) and, inside an
    Airflow run, `failed_run` on versions other runs left `pending` (runs of the DAG queue one at a time, so those
    runs are over: they failed before their gate; should one still be going, e.g. an `embshard pipeline` beside
    `make ui` on the same store, its own gate overwrites the tag with its verdict); `superseded` on versions the
    same run (or, by hand, the same run root) left `pending` before a stage of it was run again. Returns the
    versions tagged failed_run. `judged` False (the champion re-judged): its tag and the aliases stay."""
    from ..run_context import mlflow_tags

    candidate_version = str(candidate_version)
    if judged:
        _record_aliases(candidate_version, verdict, reason)
    lineage = mlflow_tags()
    run_id, root = lineage.get("airflow.run_id"), lineage.get("embshard.run_root")
    failed: list[str] = []
    for mv in registry.versions_with_verdict(POLICY, registry.PENDING):
        if str(mv.version) == candidate_version:
            continue
        made_by = mv.tags.get("airflow.run_id")
        if run_id and made_by and made_by != run_id:
            registry.set_verdict(POLICY, mv.version, registry.FAILED_RUN,
                                 f"its Airflow run {made_by} failed before its promotion gate judged it (seen by "
                                 f"run {run_id})")
            failed.append(str(mv.version))
        elif root and mv.tags.get("embshard.run_root") == root and (made_by == run_id or not run_id):
            # the same run registered it before a stage was run again, or (a gate run by hand, outside Airflow)
            # its root's run or an earlier by-hand stage did: never judged (a pipeline's candidate stayed pending
            # after its root's stages were run again by hand)
            registry.set_verdict(POLICY, mv.version, registry.SUPERSEDED,
                                 f"its stage was run again on {root}: version {candidate_version} is the candidate "
                                 "the gate judged")
    if run_id:
        # An earlier candidate of this same Airflow run that its gate left undecided, before a stage of the run was
        # cleared and registered this one: no longer the run's candidate (two undecided versions of one run had
        # read as two open questions). A decided verdict stays: it is a measurement of that version.
        for mv in registry.versions_with_verdict(POLICY, registry.UNDECIDED):
            if str(mv.version) != candidate_version and mv.tags.get("airflow.run_id") == run_id:
                registry.set_verdict(POLICY, mv.version, registry.SUPERSEDED,
                                     f"a stage of its Airflow run {run_id} was run again: version "
                                     f"{candidate_version} is the run's candidate the gate judged")
                challenger = registry.version_for_alias(POLICY, registry.CHALLENGER)
                if challenger is not None and str(challenger.version) == str(mv.version):
                    registry.drop_challenger()  # `challenger` names undecided candidates only
    return failed


def _record_aliases(candidate_version: str, verdict: str, reason: str) -> None:
    """The candidate's verdict tag, and the aliases that follow from it (record_verdict)."""
    registry.set_verdict(POLICY, candidate_version, verdict, reason)
    if verdict == registry.PROMOTED:
        before = registry.version_for_alias(POLICY, registry.CHAMPION)
        registry.set_alias(POLICY, registry.CHAMPION, candidate_version)
        if before is not None and str(before.version) != candidate_version:
            registry.mark_replaced(before.version, f"version {candidate_version} was promoted")
        registry.follow_cost_model(candidate_version, registry.CHAMPION)
        registry.drop_challenger()
    elif verdict == registry.UNDECIDED:
        current = registry.version_for_alias(POLICY, registry.CHALLENGER)
        if current is not None and int(current.version) > int(candidate_version):
            # an older run's gate run again (a cleared task): `challenger` is the newest undecided candidate
            log.info("version %s undecided; challenger stays the newer version %s", candidate_version,
                     current.version)
            return
        registry.set_alias(POLICY, registry.CHALLENGER, candidate_version)
        registry.follow_cost_model(candidate_version, registry.CHALLENGER)
    else:
        current = registry.version_for_alias(POLICY, registry.CHALLENGER)
        if current is not None and str(current.version) == candidate_version:  # re-judged: no longer undecided
            registry.drop_challenger()


