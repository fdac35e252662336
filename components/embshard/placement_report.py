"""A per-device table of a placement that a person reads at a glance (tables, memory, predicted cost)."""
from __future__ import annotations

import numpy as np

from .checks import GiB
from .placement import Placement

MAX_ROWS = 40  # a screenful; beyond it the table shows the first, the last and the busiest devices
SHOWN = 10     # of each of those three groups


def shown_devices(placement: Placement, device_costs: np.ndarray | None, max_rows: int = MAX_ROWS) -> list[int]:
    """All devices up to `max_rows`, else the first, the last and the busiest (by predicted cost, else by
    memory) SHOWN each, in device order."""
    D = placement.num_devices
    if max_rows >= D:
        return list(range(D))
    load = np.asarray(device_costs, dtype=float) if device_costs is not None else placement.memory_per_device()
    busiest = np.argsort(-load, kind="stable")[:SHOWN]
    return sorted({*range(SHOWN), *range(D - SHOWN, D), *(int(d) for d in busiest)})


def device_table(placement: Placement, device_costs: np.ndarray | None = None,
                 balanced_estimate: float | None = None, full_table: str | None = None,
                 max_rows: int = MAX_ROWS) -> str:
    """The per-device table; beyond `max_rows` devices, a summary (first, last and busiest devices) with a line
    saying how many were left out and where the full table is (`full_table`)."""
    mem = placement.memory_per_device()
    shards = placement.device_shards()
    # `place` without --task-id names its one task "task": no "task task:" header then
    named = f"task {placement.task_id}: " if placement.task_id and placement.task_id != "task" else ""
    refined = placement.meta.get("refined") if isinstance(placement.meta, dict) else None
    # A refined plan keeps the planner's identity (refine.winner_placement); the plan may be another's.
    won = "" if not (isinstance(refined, dict) and refined.get("winner")) else (
        ", refined by measurement: its first choice kept" if refined["winner"] == placement.planner
        else f", refined by measurement: the plan of {refined['winner']}")
    lines = [f"{named}{len(placement.tables)} tables on {placement.num_devices} devices, "
             f"planner {placement.planner}" + (f" ({placement.model_uri})" if placement.model_uri else "") + won]
    # pieces: the device's column slices and row ranges of cut tables; replicas: tables it holds whole as one of
    # every device's copies (data-parallel)
    head = f"{'device':>6} {'tables':>6} {'pieces':>6} {'replicas':>8} {'memory GiB':>11} {'mem %':>6}"
    if device_costs is not None:
        head += f" {'pred. ms':>9} {'vs mean':>8}"
    lines.append(head)
    mean = float(np.mean(device_costs)) if device_costs is not None else 0.0
    shown = shown_devices(placement, device_costs, max_rows)
    for k, d in enumerate(shown):
        if k and d != shown[k - 1] + 1:
            lines.append(f"{'...':>6}")
        pieces = sum(s.kind in ("column", "row") for s in shards[d])
        replicas = sum(s.kind == "replicated" for s in shards[d])
        row = (f"{d:>6} {len({s.table for s in shards[d]}):>6} {pieces:>6} {replicas:>8} "
               f"{mem[d] / GiB:>11.3f} {100 * mem[d] / placement.memory_bytes_per_device:>5.1f}%")
        if device_costs is not None:
            row += f" {device_costs[d]:>9.3f} {device_costs[d] / mean if mean else 0:>7.2f}x"
        lines.append(row)
    cut = split_summary(placement)
    if cut:
        lines.append(cut)
    if len(shown) < placement.num_devices:
        lines.append(f"{placement.num_devices - len(shown):,} of {placement.num_devices:,} devices not shown (the "
                     f"first, last and busiest {SHOWN} are); the full table is "
                     + (f"the `devices` list of {full_table}" if full_table else "placement.to_frame()"))
    if device_costs is not None:
        overall = float(np.max(device_costs))
        summary = f"predicted step cost {overall:.3f} ms (slowest device), imbalance max/mean {overall / mean:.3f}"
        # An estimate of a perfectly balanced plan, not a bound: a plan can come in below it (docs/method.md).
        if balanced_estimate:
            # A percentage reads badly far above it (one small table on 4,096 devices: "+398734.2%").
            gap = overall / balanced_estimate
            est = f"{balanced_estimate:.3f}" if balanced_estimate >= 5e-4 else f"{balanced_estimate:.2e}"
            summary += (f", balanced estimate {est} ms (not a bound), "
                        + (f"gap {100 * (gap - 1):+.1f}%" if gap < 10 else f"{gap:,.0f}x it"))
        else:
            summary += ", balanced estimate n/a (the cost model is not monotone on these tables)"
        lines.append(summary)
    if placement.meta.get("time_cap_hit"):
        lines.append(f"note: the search hit its time cap after {placement.meta.get('search_evaluations')} of "
                     f"{placement.meta.get('search_budget')} evaluations: this plan depends on the machine's speed "
                     "(raise --time-budget-s for a reproducible plan)")
    gave_up = placement.meta.get("proposers_without_plan")
    if gave_up:  # near full memory the policy may place nothing: the plan is then a searched heuristic's
        lines.append(f"note: {', '.join(map(str, gave_up))} placed nothing within memory; the plan starts from "
                     f"{placement.meta.get('start_candidate', 'a heuristic')} (searched and cut from there)")
    return "\n".join(lines)


def plot_device_costs(placement: Placement, device_costs: np.ndarray | None, path: str,
                      balanced_estimate: float | None = None) -> None:
    """Bars of each device's predicted cost and memory use: imbalance at a glance (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import storage

    devices = np.arange(placement.num_devices)
    mem = placement.memory_per_device() / placement.memory_bytes_per_device * 100
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.4))
    # Thousands of bars take minutes to draw and show nothing more than a line does.
    many = placement.num_devices > 512

    def bars(a, values, color):
        if many:
            a.plot(devices, values, color=color, lw=0.6)
        else:
            a.bar(devices, values, color=color)

    if device_costs is not None:
        bars(ax[0], device_costs, "tab:blue")
        if balanced_estimate:
            ax[0].axhline(balanced_estimate, color="black", ls="--", lw=1, label="balanced estimate")
            ax[0].legend(fontsize=8)
        ax[0].set_ylabel("predicted cost (ms)")
    else:
        ax[0].text(0.5, 0.5, "no cost model: costs not predicted", ha="center", transform=ax[0].transAxes)
    ax[0].set_xlabel("device")
    bars(ax[1], mem, "tab:orange")
    ax[1].axhline(100, color="red", lw=1)
    ax[1].set_ylabel("memory used (% of the device)")
    ax[1].set_xlabel("device")
    fig.suptitle(f"{placement.task_id}: {len(placement.tables)} tables, planner {placement.planner}")
    fig.tight_layout()
    with storage.atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def split_summary(placement: Placement, limit: int = 12) -> str:
    """One line naming the tables the plan cuts and how, then the tables it replicates (empty when every table is
    whole and on one device); past `limit` of either, how many more (plan.json lists every shard)."""
    by_table: dict[int, list] = {}
    for s in placement.shards:
        if s.kind != "whole":
            by_table.setdefault(s.table, []).append(s)
    if not by_table:
        return ""
    ids = placement.tables.table_ids
    words = {"column": "column slices", "row": "row-wise pieces"}
    cut = {t: pieces for t, pieces in by_table.items() if pieces[0].kind != "replicated"}
    replicated = [str(ids[t]) for t, pieces in by_table.items() if pieces[0].kind == "replicated"]
    parts = []
    for t, pieces in list(cut.items())[:limit]:
        kind = pieces[0].kind
        where = ""
        if kind == "row":
            devices = sorted({s.device for s in pieces})
            where = (" over every device" if len(devices) == placement.num_devices
                     else f" on device {devices[0]}" if len(devices) == 1
                     else f" on devices {devices[0]}..{devices[-1]}")
        word = words.get(kind, kind)
        parts.append(f"{ids[t]} in {len(pieces)} {word[:-1] if len(pieces) == 1 else word}{where}")

    def more(n: int) -> str:
        return f" and {n - limit} more (plan.json lists them)" if n > limit else ""

    said = []
    if cut:
        said.append(f"cut tables ({len(cut)}): " + "; ".join(parts) + more(len(cut)))
    if replicated:
        said.append(f"replicated on every device ({len(replicated)}): " + ", ".join(replicated[:limit])
                    + more(len(replicated)))
    # A plan from a branch of the split search (planners.compose.Splits) says which first cut it carried on.
    branch = placement.meta.get("cut")
    found = f" (the split search's branch: {branch})" if branch else ""
    return "; ".join(said) + found
