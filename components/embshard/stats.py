"""Statistics of paired, repeated measurements: medians with bootstrap intervals, a signed-rank test, and the
choice of a comparator on rounds that are not used to judge it (no winner's curse).

Ratios are handled as logs (a 0.9 and a 1/0.9 are equally far from 1) and reported back as ratios.
"""
from __future__ import annotations

import numpy as np

N_BOOT = 2000
LEVEL = 0.95


def median_ci(values, seed: int = 0, n_boot: int = N_BOOT) -> tuple[float, float, float]:
    """(median, low, high) of positive ratios, the interval a percentile bootstrap of the median of logs."""
    logs = np.log(np.asarray(values, dtype=float))
    logs = logs[np.isfinite(logs)]
    if len(logs) == 0:
        return (float("nan"),) * 3
    med = float(np.exp(np.median(logs)))
    if len(logs) == 1:
        return med, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    boots = np.median(logs[rng.integers(0, len(logs), size=(n_boot, len(logs)))], axis=1)
    lo, hi = np.quantile(boots, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return med, float(np.exp(lo)), float(np.exp(hi))


# Fewest rounds a verdict is read from (the ruler's default): below it the interval is the range of fewer rounds,
# which misses the median 1 time in 4 (3 rounds) to 1 in 2 (2); at 5, 1 in 16 (interval_words).
VERDICT_ROUNDS = 5


def interval_words(rounds: int) -> str:
    """What `median_ci` of `rounds` values is, in words. Below 6 values the bootstrap's 2.5-97.5% quantiles of
    the median are the smallest and the largest value: the range, which holds the true median only 75% (3 values)
    to 94% (5 values) of the time (1 - 2 x 0.5^n)."""
    if rounds >= 6:
        return "95% interval"
    if rounds <= 1:
        return "no interval (one round)"
    cover = 100 * (1 - 2 * 0.5 ** max(int(rounds), 1))
    return f"range of {int(rounds)} rounds (covers the median {cover:.0f}% of the time)"


def suite_ci(per_task: list, seed: int = 0, n_boot: int = N_BOOT) -> tuple[float, float, float]:
    """(median of task medians, low, high) for per-task arrays of per-round ratios; the interval resamples tasks,
    then rounds within each drawn task (both are sources of noise)."""
    tasks = [np.log(np.asarray(r, dtype=float)) for r in per_task]
    tasks = [t[np.isfinite(t)] for t in tasks]
    tasks = [t for t in tasks if len(t)]
    if not tasks:
        return (float("nan"),) * 3
    med = float(np.exp(np.median([np.median(t) for t in tasks])))
    if len(tasks) == 1 and len(tasks[0]) == 1:
        return med, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    boots = np.empty(n_boot)
    for b in range(n_boot):
        picked = rng.integers(0, len(tasks), size=len(tasks))
        boots[b] = np.median([np.median(tasks[i][rng.integers(0, len(tasks[i]), size=len(tasks[i]))])
                              for i in picked])
    lo, hi = np.quantile(boots, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return med, float(np.exp(lo)), float(np.exp(hi))


def wilcoxon_p(task_ratios) -> float:
    """Two-sided Wilcoxon signed-rank p-value of the task ratios against 1 (NaN with fewer than 2 tasks that
    differ from 1)."""
    from scipy.stats import wilcoxon

    logs = np.log(np.asarray(task_ratios, dtype=float))
    logs = logs[np.isfinite(logs) & (logs != 0)]
    if len(logs) < 2:
        return float("nan")
    return float(wilcoxon(logs).pvalue)


def held_out_best(costs: dict[str, np.ndarray]) -> tuple[np.ndarray, list[str]]:
    """The best of several comparators, judged without the round it is used in: for round k the comparator with
    the lowest median cost over the other rounds (all rounds when there is one). Returns (its cost in each
    round, its name in each round)."""
    names = list(costs)
    mat = np.vstack([np.asarray(costs[n], dtype=float) for n in names])  # (C, R)
    R = mat.shape[1]
    best_cost = np.empty(R)
    best_name = []
    for k in range(R):
        others = [j for j in range(R) if j != k] or [k]
        with np.errstate(all="ignore"):
            med = np.nanmedian(mat[:, others], axis=1)
        med = np.where(np.isfinite(med), med, np.inf)
        c = int(np.argmin(med))
        best_cost[k] = mat[c, k]
        best_name.append(names[c])
    return best_cost, best_name


def aa_floor(ratios, planner: str) -> tuple[float, float, float]:
    """The ruler's A/A floor in an evaluation's ratio frame: `planner`'s second entry ("x#2", measured separately)
    against its first, median over tasks of the per-round ratios with the suite interval; NaNs without a repeat.
    An A/B ratio has to clear this interval to count as a difference."""
    aa = ratios[(ratios["planner"] == f"{planner}#2") & (ratios["versus"] == planner)]
    per_task = [np.asarray(v, dtype=float) for v in aa["round_ratios"]]
    return suite_ci(per_task) if per_task else (np.nan, np.nan, np.nan)


def floor_verdict(lo: float, hi: float, aa_lo: float, aa_hi: float, at: float = 1.0) -> str:
    """'faster' / 'slower' than `at` only when the interval [lo, hi] clears `at` and the A/A floor's interval
    (NaN: no floor measured); else 'no difference'. 'not measured' without an interval."""
    if not np.isfinite(lo) or not np.isfinite(hi):
        return "not measured"
    floor_lo = min(at, aa_lo) if np.isfinite(aa_lo) else at
    floor_hi = max(at, aa_hi) if np.isfinite(aa_hi) else at
    if hi < floor_lo:
        return "faster"
    if lo > floor_hi:
        return "slower"
    return "no difference"
