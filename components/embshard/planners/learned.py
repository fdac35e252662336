"""The learned planner: a composition (planners.compose) of the policy's rollouts, the cost-model greedy and the
heuristics as proposers, local search and splits as refiners.

plan():
 1. candidates: one greedy and K sampled policy rollouts, a cost-model greedy (each table, most expensive first,
    onto the device whose predicted cost after adding it is lowest), and every baseline's placement;
 2. each candidate is scored by the cost model; the best few are improved by local search (moves and swaps)
    within a work budget (scored candidates, not seconds: the same inputs and seed give the same plan);
 3. splits of dominant tables (k column slices, row-wise, table-row-wise within a host) where they lower the
    predicted cost; tables that would not fit whole are cut before anything is proposed (planners.splitting);
    then a second line that cuts every dominant table before placing (compose.DominantCuts), kept where it is
    predicted lower;
 4. portfolio guarantee: the result is never predicted worse than the best baseline placement, since those are
    candidates and search only accepts improvements.
`policy_only` and the ablations are other entries of compose.COMPOSITIONS (`composition=`).
"""
from __future__ import annotations

import numbers

from ..errors import EmbshardError
from ..policy.core import PolicyNet
from ..types import CostEstimator
from .compose import ComposedPlanner, composition, cost_greedy

__all__ = ["LearnedPlanner", "cost_greedy"]


class LearnedPlanner(ComposedPlanner):
    """A named composition (default `learned`) around a policy and the cost model it was trained against."""

    def __init__(self, policy: PolicyNet | None, cost_model: CostEstimator, *, composition_name: str = "learned",
                 num_samples: int | None = None, refine_top: int | None = None,
                 search_evaluations: int | None = None, time_budget_s: float | None = None, seed: int = 0,
                 model_uri: str | None = None, min_slice_bytes: int | None = None):
        # None: the composition's own (8 sampled rollouts, the best 3 candidates refined)
        settings = {k: v for k, v in (("num_samples", num_samples), ("refine_top", refine_top)) if v is not None}
        for k, v in settings.items():
            least = 0 if k == "num_samples" else 1
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < least:
                raise EmbshardError(f"{k}={v!r}", field=k, fix=f"give a whole number >= {least}, or None for the "
                                    "default")
        super().__init__(composition(composition_name, policy, **settings),
                         cost_model, name=composition_name, search_evaluations=search_evaluations,
                         time_budget_s=time_budget_s, seed=seed, model_uri=model_uri,
                         min_slice_bytes=min_slice_bytes)
        self.policy = policy
