"""The baseline planners every result is compared with (docs/method.md, "Baselines").

random and round-robin ignore costs; each greedy sorts the tables by its proxy, largest first, and puts each on
the device with room whose running proxy sum is smallest. All of them respect memory and, as TorchRec's planner,
cut a table only when it cannot be placed whole (planners.splitting: column slices, then row-wise); when even that
cannot fit, the error says how much memory is missing.
"""
from __future__ import annotations

import numpy as np

from ..heuristics import GREEDY_BASELINES, PROXIES, greedy_assignment
from ..placement import Placement
from ..types import DeviceTopology
from .base import Planner
from .splitting import PieceView, merge_shared_slices, place_with_cuts

__all__ = ["BASELINES", "GREEDY_BASELINES", "PROXIES", "GreedyPlanner", "RandomPlanner", "RoundRobinPlanner",
           "make_baseline"]


class GreedyPlanner(Planner):
    """Largest proxy first onto the feasible device with the smallest running proxy sum."""

    def __init__(self, proxy: str):
        self.proxy_name = proxy
        self.proxy = PROXIES[proxy]
        self.name = f"{proxy}_greedy"

    def _plan(self, tables, topology: DeviceTopology, task_id):
        def assign(view: PieceView):
            assignment, stuck, _ = greedy_assignment(view.pieces, self.proxy_name, topology.count, view.memory)
            return assignment, stuck

        return _placement(tables, topology, place_with_cuts(tables, topology, task_id, assign))


class RandomPlanner(Planner):
    """Each table on a uniformly random device that still has room (seeded)."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def _plan(self, tables, topology: DeviceTopology, task_id):
        def assign(view: PieceView):
            pieces = view.pieces
            rng = np.random.default_rng(self.seed)
            free = np.full(topology.count, view.memory, dtype=np.int64)
            assignment = np.empty(len(pieces), dtype=np.int64)
            stuck = []
            # Big pieces first so that randomness rarely paints itself into a corner.
            for i in np.argsort(-pieces.size_bytes, kind="stable"):
                fits = np.flatnonzero(free >= pieces.size_bytes[i])
                if fits.size == 0:
                    stuck.append(int(i))
                    continue
                d = int(rng.choice(fits))
                assignment[i] = d
                free[d] -= pieces.size_bytes[i]
            return (None if stuck else assignment), stuck

        return _placement(tables, topology, place_with_cuts(tables, topology, task_id, assign))


class RoundRobinPlanner(Planner):
    """Table i on device i mod D; when that device is full, the next one with room."""

    name = "round_robin"

    def _plan(self, tables, topology: DeviceTopology, task_id):
        def assign(view: PieceView):
            pieces, D = view.pieces, topology.count
            free = np.full(D, view.memory, dtype=np.int64)
            assignment = np.empty(len(pieces), dtype=np.int64)
            stuck = []
            for i in range(len(pieces)):
                for k in range(D):
                    d = (i + k) % D
                    if free[d] >= pieces.size_bytes[i]:
                        break
                else:
                    stuck.append(i)
                    continue
                assignment[i] = d
                free[d] -= pieces.size_bytes[i]
            return (None if stuck else assignment), stuck

        return _placement(tables, topology, place_with_cuts(tables, topology, task_id, assign))


def _placement(tables, topology: DeviceTopology, shards) -> Placement:
    # Slices of a table cut to fit that landed on one device are joined (TorchRec runs a rank's slices of one
    # table only at one width; splitting.merge_shared_slices).
    return Placement(tables, topology.count, topology.memory_bytes, merge_shared_slices(shards, tables.dims))


BASELINES = ["random", "round_robin", "dim_greedy", "size_greedy", "lookup_greedy", "size_lookup_greedy"]


def make_baseline(name: str, seed: int = 0) -> Planner:
    if name == "random":
        return RandomPlanner(seed)
    if name == "round_robin":
        return RoundRobinPlanner()
    if name.endswith("_greedy") and name[: -len("_greedy")] in PROXIES:
        return GreedyPlanner(name[: -len("_greedy")])
    raise KeyError(name)
