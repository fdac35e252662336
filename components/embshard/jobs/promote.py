"""Promotion in the MLflow registry: the candidate planner against the champion and the baselines, measured.

The alias `champion` of embshard-policy moves to the candidate only when its measured cost on held-out tasks
beats the champion's by the configured margin (median over tasks of candidate / champion <= 1 - margin), or
when there is no champion yet. Otherwise the candidate gets `challenger` and the champion stays. The cost
model the candidate was trained against follows it. The decision and its numbers are logged in MLflow.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from .. import registry, storage
from ..bench.runner import MeasureSettings
from ..policy.model import REGISTERED_NAME as POLICY

log = logging.getLogger(__name__)
COST = registry.COST_MODEL


def evaluate_and_promote(tables: str, tasks: str, out: str, *, candidate_version: str, cost_model_uri: str,
                         baselines: list[str], max_tasks: int | None = None, margin: float = 0.01,
                         settings: MeasureSettings | None = None, split: str = "test") -> dict:
    import mlflow

    from .evaluate import run as evaluate

    registry.use(out)
    champion = registry.version_for_alias(POLICY, "champion")
    cand_name = f"learned/{candidate_version}"
    planners = [cand_name]
    champ_name = None
    if champion is not None and str(champion.version) != str(candidate_version):
        champ_name = f"learned/{champion.version}"
        planners.append(champ_name)
    planners += baselines
    with registry.start_run(run_name="evaluate-and-promote"):
        res = evaluate(tables, tasks, out, planners=planners, split=split, max_tasks=max_tasks, settings=settings)
        df = res["frame"]
        cand = df[df["planner"] == cand_name].set_index("task_id")["measured_cost_ms"]
        decision: dict[str, Any] = {"candidate_version": str(candidate_version), "margin": margin,
                    "champion_version_before": None if champion is None else str(champion.version),
                    "candidate_median_ratio_best_baseline": float(
                        df[df["planner"] == cand_name]["ratio_to_best_baseline"].median())}
        if champ_name is not None:
            champ = df[df["planner"] == champ_name].set_index("task_id")["measured_cost_ms"]
            rel = (cand / champ).dropna()
            decision["candidate_over_champion_median"] = float(rel.median()) if len(rel) else float("nan")
            promote = bool(len(rel)) and rel.median() <= 1.0 - margin and cand.notna().all()
        else:
            promote = bool(cand.notna().all())
            decision["candidate_over_champion_median"] = None
        if not cand.notna().all():
            decision["reason"] = "the candidate failed to place some tasks"
        decision["promoted"] = bool(promote)
        if promote:
            registry.set_alias(POLICY, "champion", candidate_version)
            _follow_cost_model(candidate_version, "champion")
            decision.setdefault("reason", "no champion yet" if champ_name is None and champion is None
                                else f"beats the champion by >= {margin:.1%}")
        else:
            registry.set_alias(POLICY, "challenger", candidate_version)
            _follow_cost_model(candidate_version, "challenger")
            decision.setdefault("reason", f"not better than the champion by {margin:.1%}")
        decision["champion_version_after"] = str(registry.version_for_alias(POLICY, "champion").version) \
            if registry.version_for_alias(POLICY, "champion") is not None else None
        mlflow.log_params({"candidate_version": candidate_version, "margin": margin,
                           "champion_before": decision["champion_version_before"]})
        mlflow.log_metrics({k: v for k, v in decision.items() if isinstance(v, float) and np.isfinite(v)})
        mlflow.log_metric("promoted", float(decision["promoted"]))
        mlflow.set_tags({"decision": "promoted" if promote else "challenger", "reason": decision["reason"]})
        mlflow.log_artifact(res["evaluation"]) if "://" not in res["evaluation"] else None
        storage.write_text(storage.join(out, "decision.json"), json.dumps(decision, indent=1))
        decision["summary"] = res["summary_text"]
    log.info("promotion: %s", decision)
    return decision


def _follow_cost_model(policy_version: str, alias: str) -> None:
    """Give the cost model the policy was trained against the same alias."""
    import mlflow

    mv = mlflow.MlflowClient().get_model_version(POLICY, str(policy_version))
    uri = mv.tags.get("cost_model_uri", "")
    version = mv.tags.get("cost_model_version", "")
    if version and uri.startswith(f"models:/{COST}"):
        registry.set_alias(COST, alias, version)
