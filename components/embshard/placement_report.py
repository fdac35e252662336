"""A per-device table of a placement that a person reads at a glance (tables, memory, predicted cost)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .checks import GiB
from .placement import Placement
from .types import Shard

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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
                 max_rows: int = MAX_ROWS, device_split: np.ndarray | None = None,
                 batch_size: int | None = None) -> str:
    """The per-device table; beyond `max_rows` devices, a summary (first, last and busiest devices) with a line
    saying how many were left out and where the full table is (`full_table`). `device_split`: (D, 2) compute and
    communication ms of each device (costmodel.scoring.placement_split), `batch_size`: the samples per step the
    costs were measured at; the slowest device's split and the batch are said with the step cost."""
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
        # What the step cost is made of: on one device there is no all-to-all, so a plan on fewer devices may
        # predict less than one on more (a capacity planner had read "1 GPU beats 8" from the totals alone).
        parts = ""
        if device_split is not None:
            compute, comm = (float(x) for x in device_split[int(np.argmax(device_costs))])
            parts = (f": {compute:.3f} compute + {comm:.3f} communication" if placement.num_devices > 1
                     else ": compute only, one device has no all-to-all")
        per = f" at {batch_size:,} samples a step" if batch_size else ""
        summary = (f"predicted step cost {overall:.3f} ms{per} (slowest device{parts}), imbalance max/mean "
                   f"{overall / mean:.3f}")
        # An estimate of a perfectly balanced plan, not a bound: a plan can come in below it (docs/method.md).
        if balanced_estimate:
            # A percentage reads badly far above it (one small table on 4,096 devices: "+398734.2%").
            gap = overall / balanced_estimate
            est = f"{balanced_estimate:.3f}" if balanced_estimate >= 5e-4 else f"{balanced_estimate:.2e}"
            summary += (f", balanced estimate {est} ms (not a bound), "
                        + (f"gap {100 * (gap - 1):+.1f}%" if gap < 10 else f"{gap:,.0f}x it"))
        else:  # the planner's or a baseline's plan of these tables is predicted below it (planners.scoring)
            summary += ", balanced estimate n/a (a plan of these tables is predicted below it: the cost model is " \
                       "not monotone on them)"
        lines.append(summary)
    if placement.meta.get("time_cap_hit"):
        lines.append(f"note: the search hit its time cap after {placement.meta.get('search_evaluations')} of "
                     f"{placement.meta.get('search_budget')} evaluations: this plan depends on the machine's speed "
                     "(raise --time-budget-s for a reproducible plan)")
    gave_up = placement.meta.get("proposers_without_plan")
    if gave_up:  # near full memory the policy may place nothing: the plan is then a (searched) heuristic's
        meta = placement.meta
        how = ("searched and cut from there" if meta.get("search_evaluations") else
               "not searched: the time cap came first" if meta.get("time_cap_hit") else
               "not searched: this planner does not search" if not meta.get("search_budget") else
               "the search found nothing to move")
        lines.append(f"note: {', '.join(map(str, gave_up))} placed nothing within memory; the plan starts from "
                     f"{placement.meta.get('start_candidate', 'a heuristic')} ({how})")
    return "\n".join(lines)


MAX_HOST_LINES = 64   # beyond, lines between hosts would cover the bars: the x label counts the hosts instead
MAX_HOST_LABELS = 8   # "host 0" ... side by side above a chart half the figure wide


def host_runs(placement: Placement) -> list[tuple[int, int, int]]:
    """(host, first device, one past the last) of each run of consecutive devices on one host, in device order;
    one run on one host."""
    hosts = placement.devices.hosts
    if hosts is None:
        return [(0, 0, placement.num_devices)]
    starts = [0] + [d for d in range(1, len(hosts)) if hosts[d] != hosts[d - 1]]
    return [(hosts[a], a, b) for a, b in zip(starts, starts[1:] + [len(hosts)])]


def device_costs_figure(placement: Placement, device_costs: np.ndarray | None,
                        balanced_estimate: float | None = None) -> Figure:
    """The figure of plot_device_costs: bars of each device's predicted cost and memory use, lines between hosts,
    hatched bars for the devices holding pieces of cut tables, grey for the memory of replicas."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    devices = np.arange(placement.num_devices)
    mem = placement.memory_per_device() / placement.memory_bytes_per_device * 100
    cut, replicated = split_tables(placement)
    holds_pieces = sorted({s.device for pieces in cut.values() for s in pieces})
    is_replica = np.array([s.kind == "replicated" for s in placement.shards], dtype=bool)
    # every device holds every replica (Placement.check): its share of memory, not which devices, is the news
    replica_mem = np.bincount(placement.device_of_shards()[is_replica], weights=placement.shard_bytes()[is_replica],
                              minlength=placement.num_devices) / placement.memory_bytes_per_device * 100
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    # Thousands of bars take minutes to draw and show nothing more than a line does; the lines carry no marks
    # for pieces or replicas (the title still counts them).
    many = placement.num_devices > 512

    def bars(a, values, color, bottom=None) -> None:
        if many:
            a.plot(devices, values, color=color, lw=0.6)
            return
        drawn = a.bar(devices, values, color=color, bottom=bottom)
        for d in holds_pieces:
            drawn.patches[d].set_hatch("///")

    keys = []  # one legend under both charts: inside either, it would cover the bars of its first devices
    if device_costs is not None:
        bars(ax[0], device_costs, "tab:blue")
        if balanced_estimate:
            keys.append(ax[0].axhline(balanced_estimate, color="black", ls="--", lw=1, label="balanced estimate"))
        ax[0].set_ylabel("predicted cost (ms)")
    else:
        ax[0].text(0.5, 0.5, "no cost model: costs not predicted", ha="center", transform=ax[0].transAxes)
    if replicated and not many:
        ax[1].bar(devices, replica_mem, color="0.6")
        bars(ax[1], mem - replica_mem, "tab:orange", bottom=replica_mem)
    else:
        bars(ax[1], mem, "tab:orange")
    if holds_pieces and not many:
        keys.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="holds pieces of cut tables"))
    if replicated and not many:
        keys.append(Patch(color="0.6", label="memory of replicas (every device holds them)"))
    ax[1].axhline(100, color="red", lw=1)
    ax[1].set_ylabel("memory used (% of the device)")
    runs = host_runs(placement)
    per_host = placement.devices.devices_per_host()
    xlabel = "device"
    if len(runs) > 1:
        for a in ax if device_costs is not None else ax[1:]:  # an empty chart's x axis is not the devices'
            if len(runs) <= MAX_HOST_LINES:
                for _, first, _ in runs[1:]:
                    a.axvline(first - 0.5, color="0.5", lw=0.6, zorder=0, gid="host boundary")
            if len(runs) <= MAX_HOST_LABELS:
                top = a.secondary_xaxis("top")
                top.set_xticks([(first + end - 1) / 2 for _, first, end in runs],
                               [f"host {h}" for h, _, _ in runs], fontsize=7)
                top.tick_params(length=0)
        if len(runs) > MAX_HOST_LABELS:
            hosts = f"{len(runs)} hosts" + (f" of {per_host}" if per_host else "")
            xlabel += f" ({hosts}{'; lines between hosts' if len(runs) <= MAX_HOST_LINES else ''})"
    for a in ax:
        a.set_xlabel(xlabel)
    title = f"{placement.task_id}: {len(placement.tables)} tables, planner {placement.planner}"
    split = [f"{len(cut)} cut into pieces"] if cut else []
    split += [f"{len(replicated)} replicated on every device"] if replicated else []
    fig.suptitle(title + ("\n" + ", ".join(split) if split else ""), fontsize=11)
    if keys:
        fig.legend(handles=keys, loc="lower center", ncol=len(keys), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07 if keys else 0, 1, 1))
    return fig


def plot_device_costs(placement: Placement, device_costs: np.ndarray | None, path: str,
                      balanced_estimate: float | None = None) -> None:
    """Bars of each device's predicted cost and memory use: imbalance at a glance (PNG)."""
    import matplotlib.pyplot as plt

    from . import storage

    fig = device_costs_figure(placement, device_costs, balanced_estimate)
    with storage.atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def split_tables(placement: Placement) -> tuple[dict[int, list[Shard]], list[int]]:
    """The tables the plan cuts (table index -> its column slices or row ranges) and the tables it replicates
    (indices), in the order of their first shard."""
    by_table: dict[int, list[Shard]] = {}
    for s in placement.shards:
        if s.kind != "whole":
            by_table.setdefault(s.table, []).append(s)
    cut = {t: pieces for t, pieces in by_table.items() if pieces[0].kind != "replicated"}
    return cut, [t for t, pieces in by_table.items() if pieces[0].kind == "replicated"]


def split_summary(placement: Placement, limit: int = 12) -> str:
    """One line naming the tables the plan cuts and how, then the tables it replicates (empty when every table is
    whole and on one device); past `limit` of either, how many more (plan.json lists every shard)."""
    cut, replicated_tables = split_tables(placement)
    if not cut and not replicated_tables:
        return ""
    ids = placement.tables.table_ids
    words = {"column": "column slices", "row": "row-wise pieces"}
    replicated = [str(ids[t]) for t in replicated_tables]
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
