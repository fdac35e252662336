"""The cost-blind placement heuristics as plain functions: proxies of a table's cost and the greedy that balances
them. The baseline planners (planners.baselines) wrap them; policy training uses them as the bar to clear without
importing the planners.
"""
from __future__ import annotations

import numpy as np

from .tableset import TableSet


def proxy_dim(t: TableSet) -> np.ndarray:
    return t.dims.astype(np.float64)


def proxy_size(t: TableSet) -> np.ndarray:
    return t.size_bytes.astype(np.float64)


def proxy_lookup(t: TableSet) -> np.ndarray:
    return t.dims * t.pooling_factor


def proxy_size_lookup(t: TableSet) -> np.ndarray:
    # log10 of 10 rows is 1: tiny tables keep a positive weight.
    return t.dims * t.pooling_factor * np.log10(np.maximum(t.rows, 10))


PROXIES = {"dim": proxy_dim, "size": proxy_size, "lookup": proxy_lookup, "size_lookup": proxy_size_lookup}
GREEDY_BASELINES = [f"{p}_greedy" for p in PROXIES]


def greedy_assignment(tables: TableSet, proxy: str, num_devices: int, memory_bytes_per_device: int
                      ) -> tuple[np.ndarray | None, list[int], np.ndarray]:
    """Largest proxy first onto the device with room whose running proxy sum is smallest.

    Returns (assignment, [], free) or, when some tables fit on no device, (None, those tables in the order they
    came up, free bytes after placing the rest)."""
    cost = PROXIES[proxy](tables)
    order = np.argsort(-cost, kind="stable")
    load = np.zeros(num_devices)
    free = np.full(num_devices, memory_bytes_per_device, dtype=np.int64)
    assignment = np.empty(len(tables), dtype=np.int64)
    stuck: list[int] = []
    for i in order:
        fits = free >= tables.size_bytes[i]
        if not fits.any():
            stuck.append(int(i))
            continue
        d = int(np.argmin(np.where(fits, load, np.inf)))
        assignment[i] = d
        load[d] += cost[i]
        free[d] -= tables.size_bytes[i]
    return (None if stuck else assignment), stuck, free
