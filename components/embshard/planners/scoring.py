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
from .base import inner_plans
from .baselines import BASELINES, make_baseline


def unseen_types_warning(model, tables) -> str | None:
    """One warning line when tables hold an element type the cost model was never measured on (None otherwise, or
    for a model that recorded no types): its features carry a table's bytes, not its type, so it prices an FP16
    table as an FP32 table of half the bytes (on this CPU, FP16 tables measured 9-44% above such predictions on a
    user's list; the median shard holding one, 16-34% by model: benchmarks/results/costmodel_types.md,
    costmodel_seeds_fp16.md)."""
    seen = list(getattr(getattr(model, "config", None), "element_bytes_seen", None) or [])
    if not seen:
        return None
    odd = [(str(t), int(b)) for t, b in zip(tables.table_ids, tables.bytes_per_element) if int(b) not in seen]
    if not odd:
        return None
    kinds = ", ".join(sorted({f"{b} bytes per element" for _, b in odd}))
    names = ", ".join(t for t, _ in odd[:3]) + (f" and {len(odd) - 3} more" if len(odd) > 3 else "")
    return (f"{len(odd)} table(s) of {kinds} ({names}) are of a type the cost model was never measured on (it saw "
            f"{', '.join(map(str, seen))} bytes per element): their predicted costs are extrapolated from their bytes "
            "(an FP32-only model priced shards holding an FP16 table a median 16-34% below their measured cost on a "
            "CPU) (fix: measure such tables, a table spec with them or fp16_fraction > 0, and compare the two models' "
            "plans: python -m benchmarks.model_ab)")


def model_hardware(model) -> str:
    """The hardware a cost model was measured on ('' when it does not say, or there is no model)."""
    return str(getattr(getattr(model, "config", None), "hardware", "") or "")


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
            with inner_plans():  # witnesses, not the user's plans: no warnings of their own
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
