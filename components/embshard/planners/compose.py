"""The planner as a composition, in the spirit of TorchRec's planner (proposers, partitioner, estimators):

- a `Proposer` makes one whole candidate plan of a task (or none): the policy's greedy and sampled rollouts,
  the cost-model greedy, each heuristic baseline, TorchRec's planner;
- every candidate is scored by the cost model and ranked (ties keep the proposers' order);
- `Refiner`s improve the ranked drafts in turn: local search (moves and swaps) refines the best few and keeps
  the best, splits cut the dominant table (k column slices, row-wise over all devices, or table-row-wise within
  a host) where that lowers the predicted slowest device; a measured refinement can be added as one more refiner;
- proposers place pieces: the task's tables, cut where they would not fit otherwise (planners.splitting);
- all of them share one work `Budget` (scored candidates, not seconds: the same inputs and seed give the same
  plan on any machine), assembled by `ComposedPlanner`.

`COMPOSITIONS` names the planners built this way (`learned`, `policy_only` and the ablations); `compose(name,
policy, cost_model)` builds one. Portfolio guarantee of the compositions that propose every heuristic: the result
is never predicted worse than the best baseline, since those are candidates and refiners only accept
improvements.
"""
from __future__ import annotations

import logging
import numbers
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

from .. import checks
from ..errors import EmbshardError
from ..hardware import mismatch_warning
from ..placement import Placement, Shard
from ..policy.core import PolicyNet, TaskContext, rollout
from ..tableset import TableSet
from ..types import COLUMN, REPLICATED, WHOLE, CostEstimator, DeviceTopology
from .base import Planner, no_room_error
from .baselines import BASELINES, make_baseline
from .scoring import (
    TaskScorer,
    balanced_estimate,
    model_hardware,
    piece_features,
    placement_costs,
    predicted_costs,
    replica_extra_ms,
    single_threaded,
    unseen_types_warning,
)
from .search import Budget, CutCache, SearchState, cut_kind, local_search, try_splits
from .splitting import (
    DEFAULT_SPEED_SLICE_BYTES,
    PieceView,
    column_pieces,
    first_fit,
    is_pinned,
    max_speed_column_parts,
    merge_shared_slices,
    speed_slice_bytes,
    split_to_fit,
)

log = logging.getLogger(__name__)


@dataclass
class Problem:
    """One task as proposers and refiners see it; the cost model's view (`ctx`) is built once, when asked."""

    tables: TableSet
    topology: DeviceTopology
    task_id: str
    cost_model: CostEstimator
    seed: int = 0
    # Called with a short phase name as planning goes on (`embshard place` shows it on long plans).
    on_phase: Callable[[str], None] | None = None
    # Carry on the cuts not kept, one branch per kind (Splits): only when a measured refinement will measure them.
    explore_cuts: bool = False
    _rollouts: dict = field(default_factory=dict, repr=False)
    # The split search's encodings of cut pieces and replica costs, shared by its kept line and branches.
    cuts: CutCache = field(default_factory=CutCache, repr=False)
    # The narrowest column slice (bytes per row) the split search cuts for speed: the cost model's hardware's.
    min_slice_bytes: int = DEFAULT_SPEED_SLICE_BYTES

    def phase(self, text: str) -> None:
        if self.on_phase is not None:
            self.on_phase(text)

    @cached_property
    def view(self) -> PieceView:
        """The pieces proposers place: the tables, cut only where the task would not fit otherwise."""
        return split_to_fit(self.tables, self.topology, self.task_id)

    @cached_property
    def ctx(self) -> TaskContext:
        """The cost model's view of the free pieces (the tables themselves when none is cut)."""
        view = self.view
        return TaskContext.build(self.cost_model, view.pieces.features(), view.pieces.size_bytes,
                                 self.topology.count, view.memory)

    @property
    def memory(self) -> int:
        return self.topology.memory_bytes

    def policy_rollouts(self, policy: PolicyNet, samples: int):
        """One greedy and `samples` sampled rollouts (seeded by the problem's seed) in one batched pass, cached:
        the greedy and the sampled proposers share it (each step's cost-model call is most of a rollout)."""
        key = (id(policy), int(samples))
        if key not in self._rollouts:
            policy.eval()
            gen = torch.Generator().manual_seed(self.seed)
            self._rollouts[key] = rollout(policy, self.ctx, 1 + sampled_rollouts(samples, len(self.ctx.sizes),
                                                                              self.topology.count),
                                          "sample", gen, greedy=1, stats=False)
        return self._rollouts[key]


SAMPLES_UP_TO = 250  # pieces up to which every sampled rollout asked for runs (on up to SAMPLES_DEVICES devices)
SAMPLES_DEVICES = 16  # above SAMPLES_UP_TO x SAMPLES_DEVICES piece-devices, proportionally fewer sampled rollouts


def sampled_rollouts(samples: int, pieces: int, devices: int = 1) -> int:
    """The sampled rollouts run for a task: all asked for up to SAMPLES_UP_TO pieces and SAMPLES_UP_TO x
    SAMPLES_DEVICES piece-devices, proportionally fewer above (at least one). Their work grows with pieces x
    devices x samples, and on larger tasks a sampled rollout rarely beats the greedy ones (none did on the
    planning-time grid's 300 to 2,000 tables; on 100-200 tables over 32-128 devices, fewer samples left the
    searched plans' predicted costs unchanged on 7 of 7 tasks)."""
    limit = SAMPLES_UP_TO * max(min(devices, SAMPLES_DEVICES), 1)
    work = pieces * max(devices, 1)
    if samples <= 0 or work <= limit:
        return max(samples, 0)
    return max(1, samples * limit // work)


@dataclass
class Draft:
    """A candidate plan: its pieces, where it started, and its search state (whose assignment is the device of
    each piece: `shards` reads them from it, so a search that moves pieces rebuilds no shards)."""

    name: str
    pieces: list[Shard] | None  # None: the task's tables, whole (piece i is table i; built only when asked for)
    state: SearchState
    cut: str | None = None  # a split variant: the cut it tried (Splits), e.g. "cat_20 row-wise over 16 devices"
    alternative: bool = False  # kept for a measured refinement only: never the plan (Splits' explore_cuts)

    @property
    def shards(self) -> list[Shard]:
        if self.pieces is None:
            return [Shard(i, int(a)) for i, a in enumerate(self.state.assignment)]
        return [s if s.device == a else s.on(a) for s, a in zip(self.pieces, self.state.assignment)]

    def shard_sets(self) -> frozenset:
        """`shard_sets(self.shards)`, without building the shards of a table-wise draft."""
        if self.pieces is not None:
            return shard_sets(self.shards)
        by_device: dict[int, list[tuple]] = {}
        for i, a in enumerate(self.state.assignment.tolist()):
            by_device.setdefault(a, []).append((i, 0, None, 0, None))
        return frozenset(frozenset(v) for v in by_device.values())

    @property
    def overall(self) -> float:
        return self.state.overall

    @classmethod
    def table_wise(cls, problem: Problem, name: str, assignment: np.ndarray) -> Draft:
        """A proposer's assignment of the view's free pieces (the tables themselves when none is cut)."""
        view = problem.view
        if not view.is_whole:
            return cls.of_shards(problem, name, view.shards(assignment))
        ctx = problem.ctx
        return cls(name, None, SearchState(ctx.scorer, ctx.sizes, problem.memory, assignment))

    @classmethod
    def of_shards(cls, problem: Problem, name: str, shards: list[Shard]) -> Draft:
        """Any pieces (column slices, row ranges): scored piece by piece; row pieces stay where they are."""
        if all(s.kind == WHOLE for s in shards) and [s.table for s in shards] == list(range(len(problem.tables))):
            return cls.table_wise(problem, name, np.array([s.device for s in shards], dtype=np.int64))
        return cls(name, list(shards), pieces_state(problem, shards))


def pieces_state(problem: Problem, shards: list[Shard]) -> SearchState:
    """The search state of any pieces: row pieces and replicas pinned (TorchRec's layouts fix their devices);
    replicas carry their analytic communication (costmodel.scoring.replica_extra_ms)."""
    D = problem.topology.count
    feats = piece_features(problem.tables, shards, D)
    scorer = TaskScorer(problem.cost_model, feats, D,
                        extra=replica_extra_ms(problem.cost_model, problem.tables, shards, D, feats))
    return SearchState(scorer, feats[:, 3].astype(np.int64), problem.memory,
                       np.array([s.device for s in shards], dtype=np.int64),
                       movable=np.array([not is_pinned(s) for s in shards]))


class Proposer(Protocol):
    """Makes one whole candidate plan (table-wise assignment or pieces), or None when it has none. An optional
    `phase` attribute names what it does in the progress lines (default: its name); an optional
    `applies(problem) -> bool` says it has nothing to propose for this kind of task (not run, not reported)."""

    name: str

    def propose(self, problem: Problem) -> np.ndarray | list[Shard] | None:
        ...


class Refiner(Protocol):
    """Improves ranked drafts (best first) within the shared budget; returns them ranked, best first."""

    def refine(self, problem: Problem, drafts: list[Draft], budget: Budget) -> list[Draft]:
        ...


# -- proposers ---------------------------------------------------------------------------------------------------
@dataclass
class PolicyGreedy:
    """The policy's greedy rollout (its most likely device for each table)."""

    policy: PolicyNet
    samples: int = 0  # sampled rollouts run in the same pass (PolicySampled's, when it is also proposed)
    name: str = "policy_greedy"
    phase: str = "policy rollouts"

    def propose(self, problem):
        ro = problem.policy_rollouts(self.policy, self.samples)
        return ro.assignment[0] if ro.feasible[0] else None


@dataclass
class PolicySampled:
    """The best feasible of `samples` sampled rollouts (seeded by the problem's seed; fewer on tasks of more than
    SAMPLES_UP_TO pieces, see `sampled_rollouts`)."""

    policy: PolicyNet
    samples: int = 8
    name: str = "policy_sampled"
    phase: str = "policy rollouts"

    def propose(self, problem):
        ro = problem.policy_rollouts(self.policy, self.samples)
        ok = 1 + np.flatnonzero(ro.feasible[1:])
        return ro.assignment[ok[np.argmin(ro.overall[ok])]] if len(ok) else None


@dataclass
class CostGreedy:
    """Most expensive table first onto the device whose predicted cost after adding it is lowest."""

    name: str = "cost_greedy"
    phase: str = "heuristic starting points"

    def propose(self, problem):
        return cost_greedy(problem.ctx)


@dataclass
class RowWiseFit:
    """The cost greedy on a second view of a task that must be cut to fit: tables cut row-wise where the view's
    column slices would be narrower than the hardware's slice floor (splitting.split_to_fit's `fit_slice_bytes`),
    as TorchRec cuts them. No plan when the two views cut alike. Narrow slices or row ranges: which is cheaper
    depends on the hardware (narrow slices measured 0.72-0.86x on this CPU on the MLPerf-like list on 32 x 4 GiB), so
    the cost model chooses; a row range cut to fit is pinned, and no search cuts a slice row-wise later."""

    name: str = "row_wise_fit"
    phase: str = "heuristic starting points"

    def _view(self, problem) -> PieceView:
        return split_to_fit(problem.tables, problem.topology, problem.task_id, fit_slice_bytes=problem.min_slice_bytes)

    def applies(self, problem) -> bool:
        """Only where the two views differ (so it is not counted among the proposers that placed nothing): where the
        view holds a slice below the floor (up to there both views cut alike, in the same order)."""
        view, tables = problem.view, problem.tables
        narrow = any(s.col_size * int(tables.bytes_per_element[s.table]) < problem.min_slice_bytes
                     for s in view.free if s.kind == COLUMN)
        if not narrow:
            return False
        try:
            return not np.array_equal(self._view(problem).levels, view.levels)
        except EmbshardError:  # row-wise cuts that do not pack where the slices do: nothing to propose
            return False

    def propose(self, problem):
        return greedy_on_view(problem, self._view(problem))


def greedy_on_view(problem, view: PieceView) -> list[Shard] | None:
    """The cost greedy's plan of another view of the task than the problem's own (its pieces encoded for it)."""
    if not view.free:
        return list(view.pinned)
    ctx, assignment = _greedy_of_free(problem, view)
    return None if assignment is None else view.shards(assignment)


def greedy_draft_on_view(problem, view: PieceView, name: str) -> Draft | None:
    """`greedy_on_view`'s plan as a draft. Without pinned pieces its state is scored with the encodings the greedy
    used (the view's pieces, in the shards' order: the same values as encoding the shards again, which had been a
    fifth of the dominant-cut line's time at 200 tables on 128 devices)."""
    if not view.free or view.pinned:  # the pinned row pieces are not in the greedy's context
        shards = greedy_on_view(problem, view)
        return None if shards is None else Draft.of_shards(problem, name, shards)
    ctx, assignment = _greedy_of_free(problem, view)
    if assignment is None:
        return None
    return Draft(name, view.shards(assignment), SearchState(ctx.scorer, ctx.sizes, problem.memory, assignment))


def _greedy_of_free(problem, view: PieceView) -> tuple[TaskContext, np.ndarray | None]:
    """The view's free pieces encoded (their task context) and the cost greedy's assignment of them (None: none)."""
    ctx = TaskContext.build(problem.cost_model, view.pieces.features(), view.pieces.size_bytes,
                            problem.topology.count, view.memory)
    return ctx, cost_greedy(ctx)


@dataclass
class DominantCut:
    """The cost greedy on a view whose dominant tables are cut before anything is placed: every whole table whose
    predicted cost alone exceeds the balanced estimate (what a device would cost if the work were spread evenly)
    into the fewest column slices, 2, 4, ... down to the hardware's slice floor, whose cost alone does not (the
    finest allowed when none does). No plan when no table dominates. The learned planner carries it on after the
    split search (DominantCuts), not as a proposal: as the best-predicted start it took the split search from the
    uncut drafts, whose cuts (row-wise, one host's rows) predicted better on the MLPerf-like lists."""

    name: str = "dominant_cut"

    def levels(self, problem) -> np.ndarray | None:
        """The view's cut levels with the dominant tables cut, or None when no table dominates."""
        view, tables, D = problem.view, problem.tables, problem.topology.count
        if D < 2 or not view.free:
            return None
        single = problem.ctx.single
        # the task context's encodings are the tables' own when no table is cut to fit (the view is whole)
        enc = problem.ctx.scorer.model_enc if view.is_whole else None
        target = balanced_estimate(problem.cost_model, tables, D, column_splits=True, enc=enc)
        trials: list[tuple[int, int, Shard]] = []  # (table, k, its widest slice: a width's remainder is the last's)
        for p, piece in enumerate(view.free):
            t = piece.table
            if piece.kind != WHOLE or single[p] <= target:
                continue
            parts = max_speed_column_parts(int(tables.dims[t]), int(tables.bytes_per_element[t]),
                                           problem.min_slice_bytes)
            k = 2
            while k <= min(parts, D):
                trials.append((t, k, max(column_pieces(t, int(tables.dims[t]), k), key=lambda c: c.col_size or 0)))
                k *= 2
        if not trials:
            return None
        costs = TaskScorer(problem.cost_model, piece_features(tables, [c for *_, c in trials], D), D).single_costs()
        options: dict[int, list[tuple[int, float]]] = {}  # table -> (k, its widest slice's cost), k increasing
        for (t, k, _), cost in zip(trials, costs):
            options.setdefault(t, []).append((k, float(cost)))
        levels = view.levels.copy()
        for t, opts in options.items():
            levels[t] = next((k for k, cost in opts if cost <= target), opts[-1][0])
        return levels

    def applies(self, problem) -> bool:
        return self.levels(problem) is not None

    def propose(self, problem, levels: np.ndarray | None = None):
        draft = self.draft(problem, levels)
        return None if draft is None else draft.shards

    def draft(self, problem, levels: np.ndarray | None = None) -> Draft | None:
        """`propose`'s plan as a draft (None: no table dominates, or the cut view does not fit)."""
        levels = self.levels(problem) if levels is None else levels
        if levels is None:
            return None
        view = PieceView.build(problem.tables, problem.topology, levels)
        return greedy_draft_on_view(problem, view, self.name) if first_fit(view)[0] else None


@dataclass
class DominantCuts:
    """A second line of cuts beside the split search's: the dominant-cut draft (DominantCut) searched (moves and
    swaps, then more cuts) on an allowance of `share` of the planner's work, kept as the plan when it is predicted
    lower than the plan so far (else it stays a draft). The split search cuts one table at a time and its guard
    stops it early, so a task planned worse with more memory than with less, where cutting to fit had done the cuts
    (a user's 120 tables on 32 devices: 6.78 ms predicted at 40-80 GiB, 5.93 at 12 GiB; 4.71 with this line,
    measured 0.80x the former plan; development tasks of 60-200 tables at 16-64 devices 0.72-0.86x, the held-out
    901 tables on 128 devices 0.46x)."""

    share: float = 0.1  # as a split branch's (BRANCH_SHARE): 0.25 took 1.3-1.6x the plan's time, same plans
    max_splits: int = 8
    columns: bool = True
    rows: bool = True
    replicas: bool = True

    def refine(self, problem, drafts, budget):
        maker = DominantCut()
        # Its own allowance, as the split search's branches have: not skipped when the shared work is spent (on
        # 300 tables x 128 devices it was, and the line predicted 0.70x); the safety cap still holds.
        if time.perf_counter() > budget.deadline:
            budget.cap_hit = True  # skipped by the safety cap: the plan depends on the machine's speed (reported)
            return drafts
        levels = maker.levels(problem)
        if levels is None:
            return drafts
        problem.phase("dominant tables cut")
        start = maker.draft(problem, levels)
        if start is None:
            return drafts
        allowance = Budget(int(budget.evaluations * self.share), budget.deadline)
        state = local_search(start.state, allowance)
        carried, state = try_splits(problem.tables, start.shards, state, problem.cost_model, problem.topology,
                                    allowance, self.max_splits, columns=self.columns, rows=self.rows,
                                    replicas=self.replicas, cache=problem.cuts,
                                    min_slice_bytes=problem.min_slice_bytes)
        budget.absorb_side(allowance)
        line = Draft(maker.name, carried, state)
        # stable: at equal cost the plan so far stays first
        return sorted([*drafts, line], key=lambda d: (d.alternative, d.overall))


@dataclass
class Heuristic:
    """A baseline planner's plan (random, round-robin, a proxy greedy) as a candidate."""

    name: str
    phase: str = "heuristic starting points"

    def propose(self, problem):
        try:
            p = make_baseline(self.name, seed=problem.seed).plan(problem.tables, problem.topology,
                                                                 task_id=problem.task_id)
        except EmbshardError:
            return None
        whole = all(s.kind == WHOLE for s in p.shards)
        return p.device_of_shards() if whole and problem.view.is_whole else p.shards


@dataclass
class TorchRecProposal:
    """TorchRec's plan (optional extra) as a candidate; None when TorchRec is missing or finds no plan."""

    search: str = "table_wise"
    timeout_s: float | None = None  # None: DEFAULT_TIMEOUT_S (inside the learned planner, under its own cap)
    name: str = ""
    phase: str = "heuristic starting points"

    def __post_init__(self):
        self.name = self.name or f"torchrec_{self.search}"

    def propose(self, problem):
        from .torchrec_planner import DEFAULT_TIMEOUT_S, TorchRecPlanner

        timeout = self.timeout_s if self.timeout_s is not None else DEFAULT_TIMEOUT_S
        try:
            p = TorchRecPlanner(self.search, timeout_s=timeout).plan(problem.tables, problem.topology,
                                                                           task_id=problem.task_id)
        except EmbshardError:
            return None
        return p.shards


def cost_greedy(ctx: TaskContext) -> np.ndarray | None:
    """Most expensive first onto the device whose predicted cost after adding it is lowest (memory-aware)."""
    sc = ctx.scorer
    D = sc.num_devices
    sums = torch.zeros(D, sc.dim)
    free = np.full(D, ctx.memory, dtype=np.int64)
    assignment = np.empty(len(ctx.sizes), dtype=np.int64)
    for i in ctx.order:
        fits = free >= ctx.sizes[i]
        if not fits.any():
            return None
        cand = sc.totals_nonempty(sums + sc.enc[i]).numpy()
        d = int(np.argmin(np.where(fits, cand, np.inf)))
        assignment[i] = d
        sums[d] += sc.enc[i]
        free[d] -= ctx.sizes[i]
    return assignment


# -- refiners ----------------------------------------------------------------------------------------------------
@dataclass
class LocalSearch:
    """Moves and swaps off the slowest device on each of the `top` best drafts, which share `share` of the whole
    budget equally; keeps the best (ties: the better-ranked start). The drafts as proposed stay candidates behind
    them (each search moves a copy): joining a searched plan's slices can raise its cost
    (splitting.merge_shared_slices), and with a small budget a plan had ended above the best baseline's (the
    portfolio guarantee)."""

    top: int = 3
    share: float = 1.0

    def refine(self, problem, drafts, budget):
        top = drafts[: max(1, self.top)]
        total = int(budget.evaluations * self.share)
        out = []
        for k, d in enumerate(top):
            problem.phase(f"search from {d.name} ({k + 1} of {len(top)}; {budget.used:,} of "
                          f"{budget.evaluations:,} evaluations)")
            sub = budget.share((total - budget.used) // (len(top) - k))
            if sub.evaluations > 0:
                out.append(Draft(d.name, d.pieces, local_search(d.state.copy(), sub)))
            budget.absorb(sub)
        # stable: ties keep the better-ranked start (a searched draft before the same draft as proposed)
        return sorted([*out, *drafts], key=lambda d: d.overall)


@dataclass
class Splits:
    """Cut the most expensive movable piece of the slowest device while that lowers the predicted cost: into k
    column slices (k = 2, 4, ...), row-wise over all devices, or table-row-wise within one host (when the
    topology names hosts), or a replica on every device of a small hot table; each cut is followed by local search
    and the best cut is kept (search.try_splits). Works on the best draft.

    Keeping the best first cut is myopic, so the best first cut of each other kind is carried on too, with more
    cuts on an allowance of its own (a branch), and the plan is the best predicted of the kept line and the
    branches (ties: the kept line). On the MLPerf-like list at 16 devices the kept line (the hot table in 4 column
    slices first) stopped at a predicted 10.3 ms, the branch that first replicates a tiny table reached 8.1 ms,
    measured 12.2 and 9.8 ms. The cuts and branches not chosen stay as drafts (`Draft.cut` says which), ranked with
    the rest, so a measured refinement can measure the best of each kind."""

    max_splits: int = 8
    columns: bool = True
    rows: bool = True
    replicas: bool = True  # also try a replica on every device of a small hot table (search.replica_candidate)
    branches: bool = True  # carry the other kinds of first cut on (False: the kept line alone, the former planner)

    def refine(self, problem, drafts, budget):
        if budget.exhausted() or not (self.columns or self.rows or self.replicas):
            return drafts
        best = drafts[0]
        problem.phase(f"splits ({budget.used:,} of {budget.evaluations:,} evaluations)")
        tried: list = []
        shards, state = try_splits(problem.tables, best.shards, best.state, problem.cost_model, problem.topology,
                                   budget, self.max_splits, columns=self.columns, rows=self.rows,
                                   replicas=self.replicas, variants=tried, explore=problem.explore_cuts,
                                   cache=problem.cuts, min_slice_bytes=problem.min_slice_bytes)
        cuts = [Draft(best.name, pieces, trial, cut=label, alternative=variant_only)
                for label, pieces, trial, variant_only in tried]
        # The plan's branches start from the cuts the search tried for itself; with explore_cuts (a measured
        # refinement) the cuts it only tried as variants are carried on too, as alternatives only, so that the
        # plan is the same with and without a refinement.
        own = [d for d, (_, _, _, variant_only) in zip(cuts, tried) if not variant_only]
        # The best of them is the kept line's own first cut (when it was kept: it lowered the cost), already
        # carried on by try_splits: not carried on again.
        kept_first = min(own, key=lambda d: d.overall, default=None)
        if kept_first is not None and kept_first.overall >= best.overall * (1 - 1e-4):
            kept_first = None
        plan_leads = [d for d in _kind_leads(own) if d is not kept_first] if self.branches else []
        extra_leads = [d for d in _kind_leads(cuts) if d is not kept_first and all(d is not p for p in plan_leads)
                       ] if problem.explore_cuts else []
        plan_branches = [b for d in plan_leads if (b := self._carry_on(problem, d, budget, charged=True)) is not None]
        extra_branches = [b for d in extra_leads
                          if (b := self._carry_on(problem, d, budget, charged=False)) is not None]
        for b in extra_branches:
            b.alternative = True
        kept = Draft(best.name, shards, state)
        plan = min([kept, *plan_branches], key=lambda d: d.overall)  # the first of equals: the kept line
        # The plan before these cuts stays a draft too (its state is not changed by try_splits): the model may
        # price the cuts wrongly (on the MLPerf-like list on 8 x 16 GiB, the learned planner without split
        # refinement measured 0.92x the learned plan).
        uncut = Draft(f"{best.name}, before splits", best.pieces, best.state)
        others = [d for d in [kept, *plan_branches, *extra_branches] if d is not plan]
        # stable: at equal cost the other proposers' drafts come before the cut variants
        return [plan, *sorted([uncut, *drafts[1:], *others, *cuts], key=lambda d: d.overall)]

    def _carry_on(self, problem, lead: Draft, budget, charged: bool) -> Draft | None:
        """`lead` (a first cut) carried on with more cuts on an allowance of BRANCH_SHARE of the planner's work of
        its own, or None when no more cut helps (the lead itself is already a draft). Its work is recorded apart
        (`Budget.side`, the plan's `branch_evaluations`) when the branch can become the plan (`charged`), not when
        it is only an alternative; its safety-cap hits and guard stops count with the planner's."""
        allowance = Budget(int(budget.evaluations * BRANCH_SHARE), budget.deadline)
        carried, state = try_splits(problem.tables, lead.shards, lead.state, problem.cost_model, problem.topology,
                                    allowance, self.max_splits, columns=self.columns, rows=self.rows,
                                    replicas=self.replicas, cache=problem.cuts,
                                    min_slice_bytes=problem.min_slice_bytes)
        if charged:
            budget.absorb_side(allowance)
        pieces_before = Counter(p.table for p in lead.shards if p.kind != WHOLE)
        if not any(p.kind != WHOLE and p.table not in pieces_before for p in carried):
            return None  # no other table cut: the lead itself is the draft of this kind
        # The label names every table cut (or replicated) after the first cut, the lead's own table too when it was
        # cut finer: "X ..., then Y, Z cut; W replicated" (a replica had read "cut").
        pieces_after = Counter(p.table for p in carried if p.kind != WHOLE)
        changed = [t for t in pieces_after if pieces_after[t] != pieces_before.get(t, 0)]
        replicated = {p.table for p in carried if p.kind == REPLICATED}
        groups = [", ".join(str(problem.tables.table_ids[t]) for t in changed if (t in replicated) == rep)
                  + (" replicated" if rep else " cut") for rep in (False, True)
                  if any((t in replicated) == rep for t in changed)]
        return Draft(lead.name, carried, state, cut=f"{lead.cut}, then {'; '.join(groups)}")


def _joined(problem: Problem, draft: Draft) -> Draft:
    """`draft` with its column slices that share a device joined (itself when there are none), re-scored."""
    if draft.pieces is None:
        return draft
    shards = draft.shards
    joined = merge_shared_slices(shards, problem.tables.dims)
    if joined is shards:
        return draft
    out = Draft.of_shards(problem, draft.name, joined)
    out.cut, out.alternative = _still_cut(problem.tables, draft.cut, joined), draft.alternative
    return out


def _still_cut(tables: TableSet, label: str | None, shards: list[Shard]) -> str | None:
    """A branch's label ('X ..., then Y, Z cut; W replicated') naming only the later cuts still in `shards` (a
    table whose slices were all joined back on one device is whole again), its first cut marked "(since joined
    back whole)" when that table is whole again too. Table ids hold no commas, semicolons or spaces
    (checks.ID_RULE)."""
    if not label:
        return label
    first, _, rest = label.partition(", then ")
    cut = {str(tables.table_ids[s.table]) for s in shards if s.kind != WHOLE}
    if first.split(" ", 1)[0] not in cut:
        first += " (since joined back whole)"  # "(whole again)" had read as a cut the plan still makes
    groups = []
    for group in rest.split("; ") if rest else []:
        names, _, verb = group.rpartition(" ")
        kept = [name for name in names.split(", ") if name in cut]
        if kept:
            groups.append(f"{', '.join(kept)} {verb}")
    return f"{first}, then {'; '.join(groups)}" if groups else first


def _kind_leads(cuts: list[Draft]) -> list[Draft]:
    """The best (lowest predicted) cut of each kind (column slices, row-wise, table-row-wise, replica): a kind's
    first cut alone is rarely the best plan of that kind (on the MLPerf-like list at 16 devices, the hottest table
    row-wise measured 7.2 ms, and row-wise with the next table in column halves 5.7 ms, against 7.8 ms for the
    column slices the model preferred; on 4 hosts of 4, its table-row-wise branch measured 5.8 ms)."""
    lead: dict[str, Draft] = {}
    for d in sorted(cuts, key=lambda d: d.overall):
        lead.setdefault(cut_kind(d.cut or ""), d)
    return list(lead.values())


# -- the planner -------------------------------------------------------------------------------------------------
ALTERNATIVES = 7  # distinct final drafts kept beside the plan (a measured refinement's candidates)
BRANCH_SHARE = 0.1  # each cut branch's own allowance of search work, a share of the planner's (Splits._carry_on)


def shard_sets(shards: list[Shard]) -> frozenset:
    """A plan's pieces grouped by device, device numbers left out: two plans with equal shard sets cost the same."""
    by_device: dict[int, list[tuple]] = {}
    for s in shards:
        by_device.setdefault(s.device, []).append((s.table, s.col_offset, s.col_size, s.row_offset, s.row_size,
                                                   s.kind))
    return frozenset(frozenset(v) for v in by_device.values())


@dataclass
class Composition:
    """What a composed planner is made of: proposers, fallbacks (asked only when no proposer has a plan) and
    refiners, applied in order."""

    proposers: list[Proposer] = field(default_factory=list)
    fallbacks: list[Proposer] = field(default_factory=list)
    refiners: list[Refiner] = field(default_factory=list)


class ComposedPlanner(Planner):
    """Proposers, then refiners, sharing one work budget (see the module docstring)."""

    def __init__(self, composition: Composition, cost_model: CostEstimator, *, name: str = "composed",
                 search_evaluations: int | None = None, time_budget_s: float | None = None, seed: int = 0,
                 model_uri: str | None = None, min_slice_bytes: int | None = None):
        self.composition = composition
        self.cost_model = cost_model
        self.name = name
        # checked here, not where first used: a negative budget had turned the search off without a word, a seed
        # of -1 failed in numpy at the first plan
        if search_evaluations is not None and (not isinstance(search_evaluations, numbers.Integral)
                                               or isinstance(search_evaluations, bool) or search_evaluations < 0):
            raise EmbshardError(f"search_evaluations={search_evaluations!r}", field="search_evaluations",
                                fix="give a whole number >= 0 of scored moves and swaps (0: no search), or None "
                                    "for the default")
        if time_budget_s is not None and (isinstance(time_budget_s, bool) or not isinstance(time_budget_s, numbers.Real)
                                          or not float(time_budget_s) >= 0):  # inf: no cap
            raise EmbshardError(f"time_budget_s={time_budget_s!r}", field="time_budget_s",
                                fix="give a safety cap in seconds >= 0, or None for the default (60 s)")
        self.search_evaluations = search_evaluations
        self.time_budget_s = time_budget_s
        self.seed = checks.seed(seed)
        self.model_uri = model_uri
        # None: the floor of the cost model's hardware (splitting.speed_slice_bytes), read when a task is planned,
        # since a caller may swap the cost model (benchmarks.gpu_quality plans with a GPU-trained one).
        self.min_slice_bytes = min_slice_bytes
        # Called with a short phase name as planning goes on (`embshard place` shows it on long plans).
        self.on_phase: Callable[[str], None] | None = None
        # Set by a measured refinement (embshard.refine.explore): keep more cut variants as alternatives.
        self.explore_cuts = False

    def evaluations_for(self, num_tables: int) -> int:
        """Search work (scored moves and swaps): the given budget, else 40,000 up to 250 tables, growing to
        160,000 at 1,000 tables. Counted, so the plan does not depend on the machine's speed or load; sized so that
        planning takes about what the former 0.45-2 s time budgets took (200 tables on 8 devices: 1.05x, measured
        side by side on a 2-core machine; 60,000 cost 1.16x for a 0.8% lower predicted cost)."""
        if self.search_evaluations is not None:
            return max(int(self.search_evaluations), 0)
        return 40_000 if num_tables <= 250 else min(160_000, 40_000 + 160 * (num_tables - 250))

    def time_cap_for(self) -> float:
        """Safety cap on the wall time of the search (the given --time-budget-s, else 60 s): only a guard against
        a pathological case; when it is hit the plan depends on the machine and this is reported."""
        return float(self.time_budget_s) if self.time_budget_s is not None else 60.0

    def _plan(self, tables, topology, task_id):
        # What a training job that reads only the plan must know of its prices: the hardware the model was measured
        # on (meta.model_hardware) and the warnings planning gave (meta.warnings), logged here as well, so that
        # the Python API says what `embshard place` says.
        hardware = model_hardware(self.cost_model)
        warnings = [line for line in (
            # the costs are the model's measurements whatever the topology names
            mismatch_warning(hardware, topology.hardware, asked=True, planning=True,
                             source="the topology's hardware") if topology.hardware else None,
            unseen_types_warning(self.cost_model, tables)) if line]
        for line in warnings:  # each line once per planner (an evaluation plans many tasks of the same tables)
            if line not in self.warned_lines():
                self.warned_lines().add(line)
                log.warning("%s: %s", task_id, line)
        # inference_mode, not no_grad: no version counters or view tracking on the thousands of tiny ops of a
        # plan (14% of its time at 10-200 tables, measured); nothing it makes outlives the plan but Python values.
        with single_threaded(), torch.inference_mode():
            placement = self._compose(Problem(tables, topology, task_id, self.cost_model, self.seed, self.on_phase,
                                              explore_cuts=self.explore_cuts, min_slice_bytes=self.slice_floor()))
        if hardware:
            placement.meta["model_hardware"] = hardware
        if warnings:  # before the planning's own (a time cap hit)
            placement.meta["warnings"] = [*warnings, *placement.meta.get("warnings", [])]
        return placement

    def predicted_costs(self, placement: Placement) -> np.ndarray:
        """Each device's predicted cost (ms) of `placement` by this planner's cost model: what `embshard place`
        writes, e.g. `write_plan_json(placement, path, device_costs=planner.predicted_costs(placement))`."""
        return placement_costs(self.cost_model, placement)

    def balanced_estimate(self, placement: Placement) -> float | None:
        """The balanced estimate (ms) `embshard place` writes beside the costs, e.g. `write_plan_json(placement,
        path, device_costs=..., balanced_estimate=planner.balanced_estimate(placement))`: None where the model's
        own predictions contradict it (scoring.predicted_costs)."""
        return predicted_costs(self.cost_model, placement)[2]

    def slice_floor(self) -> int:
        """The split search's slice floor (bytes per row): the one given, else the cost model's hardware's."""
        if self.min_slice_bytes is not None:
            return int(self.min_slice_bytes)
        config = getattr(self.cost_model, "config", None)
        return speed_slice_bytes(getattr(config, "hardware", ""))

    def _propose(self, problem: Problem, proposers: list[Proposer], budget: Budget | None = None) -> list[Draft]:
        """The proposers' drafts. Past the budget's safety cap (`budget.deadline`) the proposers not run yet are
        skipped once there is a draft (the cap is recorded): at a near-full memory the heuristics' cut-to-fit loops
        took 9.5 minutes before the search began."""
        drafts: list[Draft] = []
        shown = None
        for p in proposers:
            if budget is not None and drafts and time.perf_counter() > budget.deadline:
                budget.cap_hit = True
                budget.skipped_proposers.append(p.name)
                continue
            if not getattr(p, "applies", lambda _: True)(problem):  # a proposer for some tasks only
                continue
            phase = getattr(p, "phase", p.name)
            if phase != shown:
                problem.phase(phase)
                shown = phase
            out = p.propose(problem)
            if out is None:
                if budget is not None:
                    budget.no_plan.append(p.name)
                continue
            if isinstance(out, np.ndarray):
                drafts.append(Draft.table_wise(problem, p.name, out))
            else:
                drafts.append(Draft.of_shards(problem, p.name, out))
        return drafts

    def _alternatives(self, problem: Problem, drafts: list[Draft]) -> list[Placement]:
        """The best ALTERNATIVES distinct final drafts after the first (distinct: other sets of device shards), for
        a measured refinement (embshard.refine) to measure beside it; each with its start and predicted cost."""
        seen = {drafts[0].shard_sets()}
        out: list[Placement] = []
        for d in drafts[1:]:
            if len(out) >= ALTERNATIVES:
                break
            key = d.shard_sets()
            if key in seen or len(out) >= ALTERNATIVES:
                continue
            seen.add(key)
            out.append(Placement(problem.tables, problem.topology.count, problem.memory, list(d.shards),
                                 planner=self.name, model_uri=self.model_uri,
                                 meta={"start_candidate": d.name, "predicted_ms": float(d.overall),
                                       **({"cut": d.cut} if d.cut else {})}))
        return out

    def _compose(self, problem: Problem) -> Placement:
        start = time.perf_counter()
        n = len(problem.tables)
        cap = self.time_cap_for()
        budget = Budget(self.evaluations_for(n), deadline=start + cap)
        problem.phase("encoding the tables with the cost model")
        if not problem.view.free:  # every table cut row-wise to fit: those pinned pieces are the one plan there is
            drafts = [Draft.of_shards(problem, "cut to fit", list(problem.view.pinned))]
        else:
            _ = problem.ctx  # built here (every draft is scored with it) so that its time shows as its own phase
            drafts = self._propose(problem, self.composition.proposers, budget)
        if not drafts:
            drafts = self._propose(problem, self.composition.fallbacks)
        if not drafts:
            tables, D, mem = problem.tables, problem.topology.count, problem.memory
            raise no_room_error(tables, int(np.argmax(tables.size_bytes)), np.full(D, mem), problem.task_id)
        drafts = sorted(drafts, key=lambda d: d.overall)  # stable: ties keep the proposers' order
        candidate_costs = {d.name: d.overall for d in drafts}
        for refiner in self.composition.refiners:
            drafts = refiner.refine(problem, drafts, budget)
        # Slices a search left side by side on one device are joined back (splitting.merge_shared_slices), then
        # the plan chosen again among the drafts that may be the plan: a cut whose gain was only that model error
        # no longer wins. Without joins it is drafts[0] (the first of equals), as the refiners ranked it.
        joined = [_joined(problem, d) for d in drafts]
        best = min((d for d in joined if not d.alternative), key=lambda d: d.overall)
        drafts = [best, *sorted((d for d in joined if d is not best), key=lambda d: d.overall)]
        placement = Placement(problem.tables, problem.topology.count, problem.memory, best.shards,
                              planner=self.name, model_uri=self.model_uri)
        placement.alternatives = self._alternatives(problem, drafts)
        placement.meta.update({
            "start_candidate": best.name,
            "candidate_costs": candidate_costs,
            "planning_time_s": time.perf_counter() - start,
            "column_splits": len({s.table for s in best.shards if s.kind == "column"}),
            "row_splits": len({s.table for s in best.shards if s.kind == "row"}),
            "replicas": len({s.table for s in best.shards if s.kind == "replicated"}),
            "search_evaluations": budget.used, "search_budget": budget.evaluations, "branch_evaluations": budget.side,
            "time_cap_hit": budget.cap_hit, "search_guard_stops": budget.guard_stops,
            **({"cut": best.cut} if best.cut else {}),  # the plan is a branch of the split search (Splits)
        })
        if budget.skipped_proposers:
            placement.meta["skipped_proposers"] = list(budget.skipped_proposers)
        if budget.no_plan:
            # Under tight memory the policy's rollouts (and the cost greedy) may place nothing; the plan then
            # starts from a heuristic, which a user had no way to tell from the output.
            placement.meta["proposers_without_plan"] = list(budget.no_plan)
            log.info("%s: %s placed nothing (within memory, or at all); the plan starts from %s", problem.task_id,
                     ", ".join(budget.no_plan), best.name)
        if budget.cap_hit:
            skipped = (f" (proposals skipped: {', '.join(budget.skipped_proposers)})" if budget.skipped_proposers
                       else "")
            line = (f"planning hit its {cap:g} s safety cap after {time.perf_counter() - start:.1f} s, "
                    f"{budget.used:,} of {budget.evaluations:,} search evaluations{skipped}; this plan depends on "
                    "the machine's speed (raise the time budget, --time-budget-s or time_budget_s, for a "
                    "reproducible plan)")
            log.warning("%s: %s", problem.task_id, line)
            # in the plan too: a training job that reads only the plan had no way to tell (meta.warnings)
            placement.meta.setdefault("warnings", []).append(line)
        return placement


# -- the named compositions --------------------------------------------------------------------------------------
def _learned(policy, *, num_samples=8, refine_top=3, policy_proposers=True, cost_greedy=True, portfolio=True,
             column_splits=True, row_splits=True, replicas=True, branches=True, search=True, dominant_cut=True,
             torchrec: str | None = None) -> Composition:
    proposers: list[Proposer] = []
    if policy is not None and policy_proposers:
        proposers.append(PolicyGreedy(policy, max(num_samples, 0)))
        if num_samples > 0:
            proposers.append(PolicySampled(policy, num_samples))
    if cost_greedy:
        proposers.append(CostGreedy())
    if cost_greedy or portfolio:  # not part of the cost greedy's ablation; not in policy_only (the policy alone)
        proposers.append(RowWiseFit())
    heuristics: list[Proposer] = [Heuristic(b) for b in BASELINES]
    if torchrec:
        heuristics.append(TorchRecProposal(torchrec))
    refiners: list[Refiner] = []
    splits = column_splits or row_splits or replicas
    if search:
        # Splits get the last quarter of the work; the refined candidates share the rest equally.
        refiners.append(LocalSearch(refine_top, 0.75 if splits else 1.0))
    if splits:
        refiners.append(Splits(columns=column_splits, rows=row_splits, replicas=replicas, branches=branches))
    if search and column_splits and dominant_cut:  # cuts for speed: not in no_splits (it cuts only to fit)
        refiners.append(DominantCuts(columns=column_splits, rows=row_splits, replicas=replicas))
    return Composition(proposers + (heuristics if portfolio else []), [] if portfolio else heuristics, refiners)


# name -> (what it is, the settings of _learned it changes)
COMPOSITIONS: dict[str, tuple[str, dict]] = {
    "learned": ("policy rollouts, cost greedy and every heuristic; local search; column and row splits, replicas",
                {}),
    "policy_only": ("the policy's greedy rollout alone (heuristics only when it has no plan); no search",
                    {"num_samples": 0, "cost_greedy": False, "portfolio": False, "column_splits": False,
                     "row_splits": False, "replicas": False, "search": False}),
    "no_splits": ("learned without split refinement (tables are cut only to fit, never replicated)",
                  {"column_splits": False, "row_splits": False, "replicas": False}),
    "no_column_splits": ("learned without column splits (row-wise ones only)", {"column_splits": False}),
    "no_row_splits": ("learned without row-wise splits (column slices only)", {"row_splits": False}),
    "no_replicas": ("learned without replicating small hot tables (data-parallel)", {"replicas": False}),
    "no_branches": ("learned keeping only its best first cut (no other kind of first cut carried on)",
                    {"branches": False}),
    "no_dominant_cut": ("learned without cutting dominant tables before placing (the split search alone cuts)",
                        {"dominant_cut": False}),
    "no_portfolio": ("learned without the heuristics as candidates", {"portfolio": False}),
    "no_cost_greedy": ("learned without the cost-model greedy candidate", {"cost_greedy": False}),
    "no_policy": ("learned without the policy's rollouts (cost greedy and heuristics, searched)",
                  {"policy_proposers": False}),
    "no_search": ("learned's candidates, the best one as it is",
                  {"search": False, "column_splits": False, "row_splits": False, "replicas": False}),
    "learned_with_torchrec": ("learned plus TorchRec's table-wise plan as a candidate (extra torchrec)",
                              {"torchrec": "table_wise"}),
}


def composition(name: str, policy: PolicyNet | None, **settings) -> Composition:
    """The named composition (COMPOSITIONS), with settings of `_learned` (num_samples, refine_top) on top."""
    if name not in COMPOSITIONS:
        raise EmbshardError(f"unknown composition {name!r}", field="planner",
                            fix=f"choose one of {', '.join(COMPOSITIONS)}")
    return _learned(policy, **{**COMPOSITIONS[name][1], **settings})
