"""What a person reads at the end of a stage's log (embshard.stages prints it; `embshard pipeline` reuses the
promotion's lines): the promotion decision in full, else the stage's outputs.
"""
from __future__ import annotations

from .run_layout import _join, path


def report(name: str, result: dict, root: str) -> str:
    """What a person reads at the end of a stage's log: the promotion decision in full, else the outputs."""
    bar = "=" * 72
    lines = [bar, f"embshard {name}: done   (run root {root})"]
    if name == "evaluate_and_promote":
        lines += promotion_lines(result, root)
    else:
        for k, v in result.items():
            if k == "summary" and v:
                lines.append(str(v))
            elif isinstance(v, (str, int, float)) or v is None:
                lines.append(f"  {k}: {v}")
            elif isinstance(v, list):
                lines.append(f"  {k}: {len(v)} item(s)")
    lines.append(bar)
    return "\n".join(lines)


# Below this many held-out tasks a bootstrap over tasks has almost nothing to resample (with 2 tasks its "95%"
# interval is about their min-max, which covers the median of such tasks half the time).
FEW_TASKS = 5


def promotion_lines(decision: dict, root: str) -> list[str]:
    """The promotion decision in words: ratios with their intervals and the right sign, the verdict, the reason."""
    lines = []

    def interval(comp: dict | None) -> str:
        if not comp or comp.get("ci_low") is None or comp["ci_low"] != comp["ci_low"]:
            return ""
        return f" [95%: {comp['ci_low']:.3f}, {comp['ci_high']:.3f}]"

    ratio = decision.get("candidate_median_ratio_best_baseline")
    if ratio is not None:
        lines.append(f"  learned planner vs the best baseline (median measured cost ratio over "
                     f"{decision.get('tasks', '?')} held-out tasks, {decision.get('rounds', '?')} rounds): "
                     f"{ratio:.3f}x{interval(decision.get('candidate_vs_best_baseline'))}  "
                     f"({speed_words(ratio, decision.get('candidate_vs_best_baseline'), decision.get('aa_floor'))})")
    tasks = decision.get("tasks")
    if isinstance(tasks, int) and tasks < FEW_TASKS:
        lines.append(f"  note: {tasks} held-out task(s): the interval resamples so few tasks (mostly their rounds) "
                     f"that it says little about tables not seen; judge with eval_tasks and num_tasks >= {FEW_TASKS}")
    champ = decision.get("candidate_over_champion_median")
    if champ is not None:
        lines.append(f"  candidate vs the champion: {champ:.3f}x{interval(decision.get('candidate_vs_champion'))}  "
                     f"({speed_words(champ, decision.get('candidate_vs_champion'), decision.get('aa_floor'))})")
    health = decision.get("champion_health")
    champ_base = decision.get("champion_vs_best_baseline") or {}
    if health is not None and champ_base.get("median") is not None:
        lines.append(f"  champion vs the best baseline: {champ_base['median']:.3f}x{interval(champ_base)}  "
                     + ("(REGRESSED: slower than a heuristic beyond the A/A floor)" if health == "regressed"
                        else "(healthy)"))
    floor = decision.get("aa_floor") or {}
    aa = floor.get("median")
    if aa is not None and aa == aa:  # NaN: no repeat was measured
        lines.append(f"  the ruler's A/A floor ({floor['planner']} measured twice): {aa:.3f}x"
                     f"{interval(floor)}  (a ratio inside this interval is no difference)")
    verdict = {"promoted": "PROMOTED to champion", "undecided": "UNDECIDED (now challenger); champion kept",
               "not_better": "NOT BETTER (no alias); champion unchanged",
               "measurably_slower": "MEASURABLY SLOWER (no alias); champion unchanged",
               "infeasible": "INFEASIBLE (no alias); champion unchanged",
               "rejudged": "RE-MEASURED the champion (its own gate ran again); no alias moved"}.get(
        decision.get("verdict", "promoted" if decision.get("promoted") else ""),
        "not promoted; champion unchanged")

    def version(v) -> str:
        return "none" if v is None else f"v{v}"
    lines.append(f"  decision: {verdict}  (candidate {version(decision.get('candidate_version'))}, "
                 f"champion before {version(decision.get('champion_version_before'))}, after "
                 f"{version(decision.get('champion_version_after'))}): {decision.get('reason')}")
    lines.append(f"  plot: {_join(path(root, 'evaluation'), 'evaluation.png')}")
    if decision.get("summary"):
        lines.append(str(decision["summary"]))
    return lines


def speed_words(ratio: float, comparison: dict | None = None, floor: dict | None = None) -> str:
    """'4.1% faster' for a cost ratio below 1, '2.9% slower' above it; with the `comparison`'s interval (and the
    ruler's A/A `floor`), a median whose interval holds 1 or the floor reads as no difference (a newcomer read
    '7.1% faster' off 0.929 [0.857, 1.106])."""
    if ratio != ratio:  # NaN
        return "not measured"
    if abs(ratio - 1.0) < 5e-4:
        return "same cost"
    words = f"{100 * (1 - ratio):.1f}% faster" if ratio < 1 else f"{100 * (ratio - 1):.1f}% slower"
    lo, hi = ((comparison or {}).get(k) for k in ("ci_low", "ci_high"))
    if lo is None or hi is None:
        return words
    from .stats import floor_verdict

    aa_lo, aa_hi = ((floor or {}).get(k) for k in ("ci_low", "ci_high"))
    nan = float("nan")
    verdict = floor_verdict(float(lo), float(hi), nan if aa_lo is None else float(aa_lo),
                            nan if aa_hi is None else float(aa_hi))
    if verdict != "no difference":
        return words
    floor_given = aa_lo is not None and aa_lo == aa_lo
    if aa_lo is not None and aa_hi is not None and floor_given and (float(hi) < 1 or float(lo) > 1):
        # it clears 1: the floor is what it overlaps
        return (f"no difference: {words} at the median, its interval clears 1 but overlaps the A/A floor "
                f"[{float(aa_lo):.3f}, {float(aa_hi):.3f}]")
    noise = "1 and the A/A floor" if floor_given else "1"
    return f"no difference: {words} at the median, its interval does not clear {noise}"
