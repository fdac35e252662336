"""A fixed analytic cost model for planner tests: a bandwidth model (ms per byte and a per-device constant, per
head), so that a cut that spreads a hot table's lookups lowers the slowest device and one that only adds pieces
costs their constant and all-to-all bytes."""
from __future__ import annotations

import numpy as np

from embshard.costmodel.reference import AnalyticEstimator


def analytic() -> AnalyticEstimator:
    est = AnalyticEstimator()
    est.batch_size = 512.0
    est.coef = np.array([[2e-9, 0.05], [4e-9, 0.05], [1e-9, 0.05]])
    return est
