"""Measured refinement: the K best distinct candidate plans of a task measured side by side with the ruler, the
measured best returned with its interval.

The candidates: the learned plan (always in), the other final drafts the composed planner kept
(`Placement.alternatives`: other starts, the cuts its split refinement tried but did not keep, and its plan
before those cuts), the greedy baselines' plans and TorchRec's table-wise plan. Plans with the same shard sets
(device numbers aside) cost the same and are measured once. The learned plan, the best predicted of each
kind of candidate, then the best predicted of the rest (K in all) are measured in R ruler rounds (embshard.ruler:
every distinct device shard once per round, in a fresh random order, paired per round). The winner is, of the
candidates whose paired per-round ratio to the learned plan's first choice has a 95% bootstrap interval below 1
(with fewer than 6 rounds, that interval is the rounds' range: stats.interval_words), the one of lowest median
cost, else the first choice; it is reported with that ratio and interval. It measures
on this machine, so it is a refinement only when this machine is the hardware the plan is for: the CPU here, the
GPU (torch backend) on a GPU host, same code.

The winner is chosen on these rounds, so its ratio is optimistic (winner's curse); an evaluation re-measures the
plan it is given independently, with fresh rounds, and never sees these numbers.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pandas as pd

from . import stats
from .bench.runner import MeasureSettings
from .checks import MAX_ROUNDS
from .errors import EmbshardError
from .placement import Placement
from .planners.base import Planner, inner_plans
from .planners.baselines import GREEDY_BASELINES, make_baseline
from .planners.compose import shard_sets
from .planners.search import cut_kind
from .ruler import DEFAULT_ROUNDS, Entry, distinct_shards, measure_rounds

log = logging.getLogger(__name__)
MAX_K = 16       # candidates measured; each adds its distinct device shards to every round
SUFFIX = "+refine"  # an evaluation entry "learned+refine4": the learned plan refined by measuring 4 candidates


def check_k(k, field: str = "refine") -> int:
    """K as given: 1..MAX_K (1 measures the learned plan alone, which then wins)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= int(k) <= MAX_K:
        raise EmbshardError(f"invalid value {k!r}", field=field,
                            fix=f"give how many candidate plans to measure, 1 to {MAX_K} (e.g. 3)")
    return int(k)


def check_rounds(rounds, field: str = "refine_rounds") -> int:
    # One round gives no interval, so no candidate could ever be chosen over the first choice.
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or not 2 <= int(rounds) <= MAX_ROUNDS:
        raise EmbshardError(f"invalid value {rounds!r}", field=field,
                            fix=f"give 2 to {MAX_ROUNDS} rounds (one has no interval; 5 or more for a useful one)")
    return int(rounds)


@dataclass
class Candidate:
    label: str          # unique in the table: "learned", "learned~2", "lookup_greedy", ...
    origin: str         # where it came from: the planner, and the draft's start for the learned ones
    placement: Placement
    predicted_ms: float = float("nan")


@dataclass
class Refinement:
    winner: Candidate
    first: Candidate             # the learned plan's first choice
    table: pd.DataFrame          # one row per measured candidate, the winner flagged
    rounds: int
    measured_on: str             # the hardware measured ("cpu:...", "cuda:...")
    ratio: tuple[float, float, float]  # winner / learned first choice: median, interval (stats.median_ci; paired)
    shard_measurements: int
    not_clear: str | None = None  # the lowest median when it is not the winner (not measurably faster)

    def meta(self, k: int) -> dict:
        """What plan.json's meta says about it."""
        w = self.table[self.table["winner"]].iloc[0]
        return {"refined": {"k": int(k), "rounds": self.rounds, "measured_on": self.measured_on,
                            "winner": self.winner.label, "winner_origin": self.winner.origin,
                            "measured_cost_ms": float(w["measured_cost_ms"]),
                            "ratio_to_first_choice": [float(x) for x in self.ratio],
                            "candidates": int(len(self.table)),
                            # what was measured: each candidate's paired ratio to the first choice [interval]
                            "measured": [{"candidate": r.candidate, "origin": r.origin,
                                          "ratio_to_first_choice": [float(r.ratio_to_first_choice),
                                                                    float(r.ratio_ci_low), float(r.ratio_ci_high)]}
                                         for r in self.table.itertuples(index=False)]}}

    def report(self) -> str:
        med, lo, hi = self.ratio
        with pd.option_context("display.width", 160, "display.float_format", "{:.3f}".format):
            body = self.table.drop(columns=["winner"]).to_string(index=False)
        kept = (f" (the lowest median, {self.not_clear}, is not measurably faster than the first choice)"
                if self.not_clear else "")
        # The ratio column is the median of per-round ratios (paired: a round's load cancels out), not the ratio of
        # the medians beside it; the two can disagree in order (a user read 4.161 vs 4.249 ms next to 1.009).
        return (f"measured refinement on {self.measured_on} ({self.rounds} paired rounds; a refinement for this "
                f"machine's hardware; ratio_to_first_choice is the median of the rounds' paired ratios, not the ratio "
                f"of the medians):\n{body}\nwinner: {self.winner.label} ({self.winner.origin}), "
                f"{med:.3f}x the planner's first choice ({self.first.label}) [{stats.interval_words(self.rounds)}: "
                f"{lo:.3f}, {hi:.3f}]{kept}")


def candidates(learned: Placement, cost_model=None, *, torchrec: bool = True, seed: int = 0) -> list[Candidate]:
    """Every candidate of the task `learned` was planned for, learned first, then its alternatives, the greedy
    baselines and TorchRec's table-wise plan (a baseline that cannot place the task is left out)."""
    topo, tid = learned.devices, learned.task_id
    name = learned.planner or "learned"
    out = [Candidate(name, f"{name} ({learned.meta.get('start_candidate', 'first choice')})", learned)]
    for j, alt in enumerate(learned.alternatives):
        alt = dataclasses.replace(alt, task_id=tid, topology=topo, alternatives=[])
        cut = f", cut {alt.meta['cut']}" if alt.meta.get("cut") else ""
        out.append(Candidate(f"{name}~{j + 2}", f"{name} ({alt.meta.get('start_candidate', '?')}{cut})", alt))
    others: list[tuple[str, Callable[[], Any]]] = [(b, partial(make_baseline, b, seed=seed))
                                                    for b in GREEDY_BASELINES]
    if torchrec:
        others.append(("torchrec_table_wise", _torchrec))
    for label, make in others:
        try:
            with inner_plans():  # candidates, not the user's plan: no warnings of their own
                out.append(Candidate(label, label, make().plan(learned.tables, topo, task_id=tid)))
        except (EmbshardError, ImportError) as exc:
            log.info("refine: %s has no plan for %s (%s)", label, tid, exc)
    if cost_model is not None:
        from .planners.scoring import placement_costs

        for c in out:
            c.predicted_ms = float(placement_costs(cost_model, c.placement).max())
    return out


def _torchrec():
    from .planners.torchrec_planner import TorchRecPlanner

    return TorchRecPlanner("table_wise")


def select(cands: list[Candidate], k: int) -> list[Candidate]:
    """Duplicates (equal shard sets) dropped, keeping the first; the first (learned) candidate kept, then the best
    predicted of each kind (the planner's other drafts, the greedy heuristics, TorchRec) and then the best
    predicted of the rest, up to k (kinds: `_kind`). One of each kind first: the cost model is what the planner
    already trusted, so ranking by it alone would measure little beyond its own choices (unpredicted candidates
    keep their order). From k = 3 on, one of the k is a plan the model did not make (the best predicted heuristic
    or TorchRec plan) even where the planner's own kinds fill the others: on hardware unlike the model's training
    data its plans can all lose to a heuristic (the hot-table list on 8 H100s: lookup_greedy measured 0.96x the
    learned plan, and its 3 cut variants took the other slots)."""
    seen: set = set()
    unique = []
    for c in cands:
        key = shard_sets(c.placement.shards)
        if key not in seen:
            seen.add(key)
            unique.append(c)
    first, rest = unique[0], unique[1:]
    rest = sorted(rest, key=lambda c: (not np.isfinite(c.predicted_ms), c.predicted_ms
                                       if np.isfinite(c.predicted_ms) else 0.0))
    leads: dict[str, Candidate] = {}
    for c in rest:
        leads.setdefault(_kind(c, first), c)
    ordered = sorted(leads.values(), key=rest.index) + [c for c in rest if c not in leads.values()]
    picked = ordered[: k - 1]
    outside = [c for c in ordered if _kind(c, first) in OUTSIDE_KINDS]
    if k >= 3 and outside and not any(c in outside for c in picked):
        picked[-1] = outside[0]
    return [first, *picked]


OUTSIDE_KINDS = ("heuristics", "torchrec")  # plans the learned planner's model did not make (select)


def _kind(c: Candidate, first: Candidate) -> str:
    """The planner's other drafts, its split variants by kind of cut (column slices / row-wise / table-row-wise /
    replica: the model may rank the kinds wrongly on tables unlike its training data), the heuristics, TorchRec."""
    cut = c.placement.meta.get("cut")
    if cut and c.label.startswith(f"{first.label}~"):
        return f"cut: {cut_kind(cut)}"
    if c.label.startswith(f"{first.label}~"):
        return "drafts"
    return "torchrec" if c.label.startswith("torchrec") else "heuristics"


def refine(learned: Placement, k: int, *, rounds: int = DEFAULT_ROUNDS, settings: MeasureSettings | None = None,
           cost_model=None, torchrec: bool = True, seed: int = 0) -> Refinement:
    """Measure the k best distinct candidates of `learned`'s task side by side and return the measured best."""
    k, rounds = check_k(k), check_rounds(rounds)
    picked = select(candidates(learned, cost_model, torchrec=torchrec, seed=seed), k)
    return measure_candidates(picked, rounds=rounds, settings=settings, seed=seed)


def measure_candidates(picked: list[Candidate], *, rounds: int = DEFAULT_ROUNDS,
                       settings: MeasureSettings | None = None, seed: int = 0) -> Refinement:
    """Measure picked candidates (the learned plan's first choice first) side by side; the measured best wins
    only when it is measurably faster than the first choice. Apart from `refine`, so that candidates chosen on
    one machine can be measured on the hardware they are for (benchmarks.gpu_quality)."""
    from .bench.backends import hardware, resolve_device

    rounds = check_rounds(rounds)
    settings = settings or MeasureSettings()
    entries = [Entry(c.label, c.placement) for c in picked]
    costs, _ = measure_rounds(entries, rounds, settings, seed=seed)
    w, best = choose_winner(costs)
    rows = []
    for j, c in enumerate(picked):
        m, lo, hi = stats.median_ci(costs[j])
        r = stats.median_ci(costs[j] / costs[0])
        rows.append({"candidate": c.label, "origin": c.origin, "predicted_ms": c.predicted_ms,
                     "measured_cost_ms": m, "cost_ci_low": lo, "cost_ci_high": hi,
                     "ratio_to_first_choice": r[0], "ratio_ci_low": r[1], "ratio_ci_high": r[2], "winner": j == w})
    return Refinement(picked[w], picked[0], pd.DataFrame(rows), rounds, hardware(resolve_device(settings.device)),
                      stats.median_ci(costs[w] / costs[0]), distinct_shards(entries) * rounds,
                      picked[best].label if best != w else None)


def choose_winner(costs: np.ndarray) -> tuple[int, int]:
    """(winner, lowest median) of per-round costs (candidates x rounds, the first choice first).

    A switch needs evidence: only candidates whose paired interval against the first choice is below 1 may win
    (on the run's test tasks, switches on an interval across 1 came out slower in the re-measurement); of those,
    the lowest median, else the first choice. Not simply the lowest median when it clears: a noisy one across 1
    must not hide a measurably faster one (on 4 hosts of 4 it hid a table-row-wise plan at 0.785 [0.775, 0.835])."""
    medians = np.median(costs, axis=1)
    best = int(np.argmin(medians))  # ties: the earlier one, the learned plan first
    clear = [j for j in range(1, len(costs)) if stats.median_ci(costs[j] / costs[0])[2] < 1.0]
    return (min(clear, key=lambda j: (medians[j], j)) if clear else 0), best


def winner_placement(result: Refinement, k: int) -> Placement:
    """The winner as the plan to write: the learned plan's identity (planner, model) kept, since it is that
    planner's refined answer; its meta says it was refined and which candidate won."""
    first = result.table.iloc[0]
    src, learned = result.winner.placement, result.first.placement
    pl = dataclasses.replace(src, planner=learned.planner, model_uri=learned.model_uri, alternatives=[],
                             meta={**src.meta, **result.meta(k)})
    pl.meta["refined"]["first_choice_cost_ms"] = float(first["measured_cost_ms"])
    return pl


def explore(planner) -> None:
    """Ask a composed planner to also search the first cuts its split search skips and carry each kind on, as
    alternatives for a refinement to measure (planners.compose.Splits); other planners are left as they are."""
    if hasattr(planner, "explore_cuts"):
        planner.explore_cuts = True


def parse_refined(name: str) -> tuple[str, int] | None:
    """("learned", 4) for an entry name "learned+refine4" (any planner before the suffix), else None."""
    base, sep, k = name.rpartition(SUFFIX)
    if not sep or not base or not k.isdigit():
        return None
    return base, int(k)


class RefinedPlanner(Planner):
    """A planner whose plan is refined by measurement on this machine (`refine`, K candidates): what `embshard
    place --refine K` returns, as an evaluation entry. Its planning time includes the measuring."""

    def __init__(self, inner: Planner, k: int, *, rounds: int = DEFAULT_ROUNDS,
                 settings: MeasureSettings | None = None, seed: int = 1, name: str | None = None):
        self.inner, self.k, self.rounds, self.settings, self.seed = inner, check_k(k), rounds, settings, seed
        explore(inner)
        self.name = name or f"{inner.name}{SUFFIX}{self.k}"
        self.cost_model = getattr(inner, "cost_model", None)

    def _plan(self, tables, topology, task_id):
        first = self.inner.plan(tables, topology, task_id=task_id)
        result = refine(first, self.k, rounds=self.rounds, settings=self.settings, cost_model=self.cost_model,
                        seed=self.seed)
        return dataclasses.replace(winner_placement(result, self.k), planner=self.name)
