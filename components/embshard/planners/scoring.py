"""Scores of plans: the cost-model scorer (embshard.costmodel.scoring, re-exported here for planner callers) and
the balanced estimate a plan's prediction is checked against.
"""
from __future__ import annotations

import numpy as np

from ..costmodel.scoring import (  # noqa: F401  (the planners' scoring vocabulary)
    TaskScorer,
    balanced_estimate,
    piece_features,
    placement_costs,
    replica_extra_ms,
    replica_extras,
    single_threaded,
)
from ..errors import EmbshardError
from ..placement import Placement
from ..types import CostEstimator
from .baselines import BASELINES, make_baseline

FLOAT_TOL = 1e-5  # relative: predictions are float32 sums (on one device the estimate is the plan's own cost)


def checked_balanced_estimate(cost_model: CostEstimator, placement: Placement, estimate: float,
                              device_costs: np.ndarray) -> float | None:
    """`estimate` if no placement we can cheaply predict falls below it, else None.

    Its terms would bound costs that never drop when a table is added and that are sub- or super-additive per
    head. A learned network is only nearly so: with its fused (sub-additive) correction it can predict a device
    holding the most expensive table plus a few small ones below that table alone (`place` once printed 12.666 ms
    above its own predicted 12.402 ms). A number the model's own predictions contradict says nothing about
    balance, so it is withheld (None) whenever this placement or a baseline's placement of the same task is
    predicted below it.
    """
    witnesses = [float(np.max(device_costs))]
    candidates = placement.meta.get("candidate_costs")
    if candidates:  # a composed plan scored its candidates (the baselines' plans among them) already
        witnesses += [float(c) for c in candidates.values()]
        return None if min(witnesses) < estimate * (1 - FLOAT_TOL) else estimate
    for name in BASELINES:
        try:
            other = make_baseline(name).plan(placement.tables, placement.num_devices,
                                             placement.memory_bytes_per_device, placement.task_id)
        except EmbshardError:
            continue
        witnesses.append(float(placement_costs(cost_model, other).max()))
    return None if min(witnesses) < estimate * (1 - FLOAT_TOL) else estimate


def predicted_costs(cost_model: CostEstimator, placement: Placement) -> tuple[np.ndarray, float, float | None]:
    """(each device's predicted cost, the balanced estimate, the estimate as a plan may quote it: None when the
    model's own predictions contradict it, checked_balanced_estimate). Every planner may cut tables, so the
    estimate treats each table as divisible (docs/method.md, "Splits"). A withheld estimate is said in the plan's
    meta (`balanced_estimate_withheld`), so that plan.json's null has its reason beside it."""
    costs = placement_costs(cost_model, placement)
    estimate = balanced_estimate(cost_model, placement.tables, placement.num_devices, column_splits=True)
    checked = checked_balanced_estimate(cost_model, placement, estimate, costs)
    if checked is None:
        placement.meta["balanced_estimate_withheld"] = (
            f"{estimate:.3f} ms: the cost model predicts a plan of these tables below it (it is not monotone on "
            "them), so it would say nothing about balance")
    return costs, estimate, checked
