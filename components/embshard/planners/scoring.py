"""Scores of plans: the cost-model scorer (embshard.costmodel.scoring, re-exported here for planner callers) and
the lower bound a plan's prediction is checked against.
"""
from __future__ import annotations

import numpy as np

from ..costmodel.scoring import (  # noqa: F401  (the planners' scoring vocabulary)
    TaskScorer,
    lower_bound,
    piece_features,
    placement_costs,
    single_threaded,
)
from ..errors import EmbshardError
from ..placement import Placement
from ..types import CostEstimator
from .baselines import BASELINES, make_baseline


def checked_lower_bound(cost_model: CostEstimator, placement: Placement, bound: float,
                        device_costs: np.ndarray) -> float | None:
    """`bound` if no placement we can cheaply predict falls below it, else None.

    The bound's terms hold for costs that never drop when a table is added and that are sub- or super-additive
    per head: real kernels are. A learned network is only nearly so: with its fused (sub-additive) correction it
    can predict a device holding the most expensive table plus a few small ones below that table alone. That is
    why `place` once printed a bound of 12.666 ms above its own predicted 12.402 ms. Such a number is not a bound
    of the model's predictions, so it is withheld (None) whenever this placement or a baseline's placement of the
    same task is predicted below it.
    """
    witnesses = [float(np.max(device_costs))]
    for name in BASELINES:
        try:
            other = make_baseline(name).plan(placement.tables, placement.num_devices,
                                             placement.memory_bytes_per_device, placement.task_id)
        except EmbshardError:
            continue
        witnesses.append(float(placement_costs(cost_model, other).max()))
    return None if min(witnesses) < bound * (1 - 1e-9) else bound
