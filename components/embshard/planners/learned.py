"""The learned planner: policy rollouts, the baselines as a portfolio, then local search and column splits.

plan():
 1. candidates: one greedy and K sampled policy rollouts, a cost-model greedy (each table, most expensive first,
    onto the device whose predicted cost after adding it is lowest), and every baseline's placement;
 2. each candidate is scored by the cost model; the best few are improved by local search (moves and swaps)
    within a work budget (scored candidates, not seconds: the same inputs and seed give the same plan);
 3. column-wise splits of dominant tables where they lower the predicted cost (optional);
 4. portfolio guarantee: the result is never predicted worse than the best baseline placement, since those are
    candidates and search only accepts improvements.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import torch

from ..errors import EmbshardError
from ..placement import Placement, Shard
from ..policy.core import PolicyNet, TaskContext, rollout
from .base import Planner, no_room_error
from .baselines import BASELINES, make_baseline
from .scoring import single_threaded
from .search import Budget, SearchState, local_search, try_column_splits

log = logging.getLogger(__name__)


class LearnedPlanner(Planner):
    name = "learned"

    def __init__(self, policy: PolicyNet | None, cost_model, *, num_samples: int = 8,
                 search_evaluations: int | None = None, time_budget_s: float | None = None,
                 column_splits: bool = True, portfolio: bool = True, refine_top: int = 3, seed: int = 0,
                 model_uri: str | None = None, cost_greedy: bool = True):
        self.policy = policy
        self.cost_model = cost_model
        self.num_samples = num_samples
        self.search_evaluations = search_evaluations
        self.time_budget_s = time_budget_s
        self.column_splits = column_splits
        self.portfolio = portfolio
        self.refine_top = refine_top
        self.seed = seed
        self.model_uri = model_uri
        self.use_cost_greedy = cost_greedy
        # Called with a short phase name as planning goes on (`embshard place` shows it on long plans).
        self.on_phase: Callable[[str], None] | None = None

    def _phase(self, text: str) -> None:
        if self.on_phase is not None:
            self.on_phase(text)

    def _plan(self, tables, num_devices, memory_bytes_per_device, task_id):
        with single_threaded(), torch.no_grad():
            return self._search(tables, num_devices, memory_bytes_per_device, task_id)

    def evaluations_for(self, num_tables: int) -> int:
        """Search work (scored moves and swaps): the given budget, else 40,000 up to 250 tables, growing to
        160,000 at 1,000 tables. Counted, so the plan does not depend on the machine's speed or load; sized so that
        planning takes about what the former 0.45-2 s time budgets took (200 tables on 8 devices: 1.05x, measured
        side by side on a 2-core machine; 60,000 cost 1.16x for a 0.8% lower predicted cost)."""
        if self.search_evaluations is not None:
            return max(int(self.search_evaluations), 0)
        return 40_000 if num_tables <= 250 else min(160_000, 40_000 + 160 * (num_tables - 250))

    def time_cap_for(self, num_tables: int) -> float:
        """Safety cap on the wall time of the search (the given --time-budget-s, else 60 s): only a guard against
        a pathological case; when it is hit the plan depends on the machine and this is reported."""
        return float(self.time_budget_s) if self.time_budget_s is not None else 60.0

    def _search(self, tables, num_devices, memory_bytes_per_device, task_id):
        start = time.perf_counter()
        cap = self.time_cap_for(len(tables))
        budget = Budget(self.evaluations_for(len(tables)), deadline=start + cap)
        self._phase("encoding the tables with the cost model")
        ctx = TaskContext.build(self.cost_model, tables.features(), tables.size_bytes, num_devices,
                                memory_bytes_per_device)
        cands: dict[str, np.ndarray] = {}
        if self.policy is not None:
            self._phase("policy rollouts")
            self.policy.eval()
            gen = torch.Generator().manual_seed(self.seed)
            greedy = rollout(self.policy, ctx, 1, "greedy")
            if greedy.feasible[0]:
                cands["policy_greedy"] = greedy.assignment[0]
            if self.num_samples > 0:
                sampled = rollout(self.policy, ctx, self.num_samples, "sample", gen)
                ok = np.flatnonzero(sampled.feasible)
                if len(ok):
                    best = ok[np.argmin(sampled.overall[ok])]
                    cands["policy_sampled"] = sampled.assignment[best]
        self._phase("heuristic starting points")
        lpt = cost_greedy(ctx) if self.use_cost_greedy else None
        if lpt is not None:
            cands["cost_greedy"] = lpt
        if self.portfolio or not cands:
            for name in BASELINES:
                try:
                    p = make_baseline(name, seed=self.seed).plan(tables, num_devices, memory_bytes_per_device, task_id)
                except EmbshardError:
                    continue
                cands[name] = p.device_of_shards()
        if not cands:
            raise no_room_error(tables, int(np.argmax(tables.size_bytes)),
                                np.full(num_devices, memory_bytes_per_device), task_id)
        scored = sorted(((float(ctx.scorer.device_costs(a).max()), n, a) for n, a in cands.items()),
                        key=lambda x: x[0])
        best_state, best_from = None, None
        top = scored[: max(1, self.refine_top)]
        # Column splits get the last quarter of the work; the refined candidates share the rest equally.
        search_total = int(budget.evaluations * (0.75 if self.column_splits else 1.0))
        for k, (_, name, a) in enumerate(top):
            self._phase(f"search from {name} ({k + 1} of {len(top)}; {budget.used:,} of {budget.evaluations:,} "
                        "evaluations)")
            sub = budget.share((search_total - budget.used) // (len(top) - k))
            st = SearchState(ctx.scorer, ctx.sizes, memory_bytes_per_device, a)
            if sub.evaluations > 0:
                st = local_search(st, sub)
            budget.absorb(sub)
            # ties keep the earlier (better-scored) candidate: the order of `scored` is deterministic
            if best_state is None or st.overall < best_state.overall:
                best_state, best_from = st, name
        shards = [Shard(i, int(d)) for i, d in enumerate(best_state.assignment)]
        assignment = best_state.assignment
        if self.column_splits and not budget.exhausted():
            self._phase(f"column splits ({budget.used:,} of {budget.evaluations:,} evaluations)")
            shards, assignment, _ = try_column_splits(tables, shards, assignment, self.cost_model, num_devices,
                                                      memory_bytes_per_device, budget)
        shards = [Shard(s.table, int(d), s.col_offset, s.col_size) for s, d in zip(shards, assignment)]
        placement = Placement(tables, num_devices, memory_bytes_per_device, shards, planner=self.name,
                              model_uri=self.model_uri)
        placement.meta.update({
            "start_candidate": best_from,
            "candidate_costs": {n: c for c, n, _ in scored},
            "planning_time_s": time.perf_counter() - start,
            "column_splits": sum(s.col_size is not None for s in shards),
            "search_evaluations": budget.used, "search_budget": budget.evaluations,
            "time_cap_hit": budget.cap_hit, "search_guard_stops": budget.guard_stops,
        })
        if budget.cap_hit:
            log.warning("%s: the search hit its %.1f s safety cap after %d of %d evaluations; this plan depends "
                        "on the machine's speed (raise --time-budget-s for a reproducible plan)", task_id, cap,
                        budget.used, budget.evaluations)
        return placement


def cost_greedy(ctx: TaskContext) -> np.ndarray | None:
    """Most expensive first onto the device whose predicted cost after adding it is lowest (memory-aware)."""
    sc = ctx.scorer
    D = sc.num_devices
    sums = torch.zeros(D, sc.dim)
    counts = torch.zeros(D, dtype=torch.long)
    free = np.full(D, ctx.memory, dtype=np.int64)
    assignment = np.empty(len(ctx.sizes), dtype=np.int64)
    for i in ctx.order:
        fits = free >= ctx.sizes[i]
        if not fits.any():
            return None
        cand = sc.totals(sums + sc.enc[i], counts + 1).numpy()
        d = int(np.argmin(np.where(fits, cand, np.inf)))
        assignment[i] = d
        sums[d] += sc.enc[i]
        counts[d] += 1
        free[d] -= ctx.sizes[i]
    return assignment
