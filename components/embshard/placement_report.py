"""A per-device table of a placement that a person reads at a glance (tables, memory, predicted cost)."""
from __future__ import annotations

import numpy as np

from .placement import Placement

GiB = 2**30


def device_table(placement: Placement, device_costs: np.ndarray | None = None,
                 balanced_estimate: float | None = None) -> str:
    mem = placement.memory_per_device()
    shards = placement.device_shards()
    lines = [f"task {placement.task_id}: {len(placement.tables)} tables on {placement.num_devices} devices, "
             f"planner {placement.planner}" + (f" ({placement.model_uri})" if placement.model_uri else "")]
    head = f"{'device':>6} {'tables':>6} {'splits':>6} {'memory GiB':>11} {'mem %':>6}"
    if device_costs is not None:
        head += f" {'pred. ms':>9} {'vs mean':>8}"
    lines.append(head)
    mean = float(np.mean(device_costs)) if device_costs is not None else 0.0
    for d in range(placement.num_devices):
        row = (f"{d:>6} {len(shards[d]):>6} {sum(s.col_size is not None for s in shards[d]):>6} "
               f"{mem[d] / GiB:>11.3f} {100 * mem[d] / placement.memory_bytes_per_device:>5.1f}%")
        if device_costs is not None:
            row += f" {device_costs[d]:>9.3f} {device_costs[d] / mean if mean else 0:>7.2f}x"
        lines.append(row)
    if device_costs is not None:
        overall = float(np.max(device_costs))
        summary = f"predicted step cost {overall:.3f} ms (slowest device), imbalance max/mean {overall / mean:.3f}"
        # An estimate of a perfectly balanced plan, not a bound: a plan can come in below it (docs/method.md).
        if balanced_estimate:
            summary += (f", balanced estimate {balanced_estimate:.3f} ms (not a bound), gap "
                        f"{100 * (overall / balanced_estimate - 1):+.1f}%")
        else:
            summary += ", balanced estimate n/a (the cost model is not monotone on these tables)"
        lines.append(summary)
    if placement.meta.get("time_cap_hit"):
        lines.append(f"note: the search hit its time cap after {placement.meta.get('search_evaluations')} of "
                     f"{placement.meta.get('search_budget')} evaluations: this plan depends on the machine's speed "
                     "(raise --time-budget-s for a reproducible plan)")
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
    if device_costs is not None:
        ax[0].bar(devices, device_costs, color="tab:blue")
        if balanced_estimate:
            ax[0].axhline(balanced_estimate, color="black", ls="--", lw=1, label="balanced estimate")
            ax[0].legend(fontsize=8)
        ax[0].set_ylabel("predicted cost (ms)")
    else:
        ax[0].text(0.5, 0.5, "no cost model: costs not predicted", ha="center", transform=ax[0].transAxes)
    ax[0].set_xlabel("device")
    ax[1].bar(devices, mem, color="tab:orange")
    ax[1].axhline(100, color="red", lw=1)
    ax[1].set_ylabel("memory used (% of the device)")
    ax[1].set_xlabel("device")
    fig.suptitle(f"{placement.task_id}: {len(placement.tables)} tables, planner {placement.planner}")
    fig.tight_layout()
    with storage.atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
