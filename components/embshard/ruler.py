"""The ruler: measuring several placements of one task side by side, in rounds, so that their ratios can be trusted.

- A placement is split into device shards. A shard's key is its tables with their column slices, row ranges,
  whether each is a replica, and the device count (the all-to-all and all-reduce it pays); the batch and every
  other setting are the run's. Entries whose shards have the same key share one measurement per round, except
  the repeats of one planner (an A/A test: "x" and "x#2"), which live in their own namespace so that their
  shards are built and timed separately.
- R rounds. Each round measures every distinct shard once, in a fresh seeded random order (drift over a round
  then spreads over all entries instead of biasing the ones measured last), each time with a freshly built
  operator and freshly made inputs.
- Per round, an entry's cost is the max over its devices of compute + communication; entries are then compared
  by paired per-round ratios (stats.py).
- Probes (`measure_probed`): named device shards that belong to no entry, measured in every round like the
  entries' shards, so that a reference built from them (the balanced estimate) pairs with the entries per round.
- With `MeasureSettings.round_processes` (CPU), each round runs in a fresh process. In one process a shard's
  cost depends on what the process measured before: once it has measured for a while, shards of large,
  latency-bound tables measure faster. On the 40-table list with one hot table, its three tasks evaluated in one
  process, the 32-device task's learned plan measured 5.52-5.68 ms and lookup_greedy's 13.2-14.0 ms; the same
  task alone in a fresh process 6.63-6.78 ms and 15.7-16.3 ms (three processes). TorchRec's plan, whose slowest
  device is mostly the modelled all-to-all, measured 9.5-9.7 ms either way, so learned / TorchRec full read 0.59
  or 0.69 depending on the order of the tasks. Measured with the heap's recycling off (backends.
  recycle_host_memory: every operator on fresh pages), the same three tasks in one process read 6.70 ms and
  15.3 ms: the recycled heap is what carries the history. A fresh process per round takes it out (about 2.5 s
  per round to start one), at a smaller cost than fresh pages for every shard (1.7x the measuring time).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .bench.runner import (
    InputPrefetcher,
    MeasureSettings,
    close_config,
    input_workers,
    measure_shard,
    piece_args,
    replica_args,
)
from .placement import Placement
from .types import REPLICATED, Shard

DEFAULT_ROUNDS = 5
# Timed work per shard and round on a CPU: the 300 ms of a single measurement spread over the rounds (each round
# rebuilds the operator, so its timing is as independent as the rounds are).
ROUND_MIN_TIME_MS = {"cpu": 60.0, "cuda": 20.0}


@dataclass
class Entry:
    """A labelled placement to measure. `namespace` separates repeats of one planner (A/A)."""
    label: str
    placement: Placement
    namespace: str = ""


def shard_keys(entry: Entry) -> list[tuple | None]:
    """One key per device (None for an empty device)."""
    pl = entry.placement
    return [_device_key(pl, entry.namespace, shards) if shards else None for shards in pl.device_shards()]


def _device_key(pl: Placement, namespace: str, shards: list[Shard]) -> tuple:
    """What a device shard's measurement depends on (module docstring): equal keys share one measurement."""
    tables = tuple(sorted((str(pl.tables.table_ids[s.table]), s.col_offset or 0, s.col_size or -1,
                           s.row_offset or 0, -1 if s.row_size is None else s.row_size,
                           int(s.kind == REPLICATED)) for s in shards))
    return (namespace, pl.num_devices, tables)


@dataclass
class RoundCosts:
    """What `measure_probed` measured: the entries' costs and each probe's heads, per round."""

    costs: np.ndarray          # (E, R) each entry's max device cost per round
    device_costs: np.ndarray   # (E, D, R)
    probes: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (R, 3): fwd, bwd compute, comm (ms)
    per_round: int = 0         # distinct shard measurements in one round, the probes' included


def round_settings(settings: MeasureSettings | None) -> MeasureSettings:
    """The settings of one measurement in a round: ROUND_MIN_TIME_MS of timed work unless set explicitly."""
    settings = settings or MeasureSettings()
    if settings.min_time_ms is None:
        from .bench.backends import resolve_device

        kind = "cpu" if resolve_device(settings.device) == "cpu" else "cuda"
        settings = settings.replace(min_time_ms=ROUND_MIN_TIME_MS[kind])
    return settings


def measure_rounds(entries: list[Entry], rounds: int, settings: MeasureSettings | None = None,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Measure `entries` (placements of one task) in `rounds` rounds. Returns (costs (E, R): each entry's max
    device cost per round, device_costs (E, D, R))."""
    out = measure_probed(entries, rounds, settings, seed)
    return out.costs, out.device_costs


def measure_probed(entries: list[Entry], rounds: int, settings: MeasureSettings | None = None, seed: int = 0,
                   probes: dict[str, list[Shard]] | None = None) -> RoundCosts:
    """`measure_rounds`, and `probes` too: named device shards of the same task (pieces on one device of the
    entries' D), measured in every round beside the entries' shards (one measurement where a key is shared), so
    that a reference made of them (the balanced estimate: evaluation.balanced_estimate_rounds) is paired with the
    entries round by round. Each probe's heads per round come back in `RoundCosts.probes`."""
    settings = round_settings(settings)
    per_entry = [shard_keys(e) for e in entries]
    # One representative (its D, a label, its shards) per distinct key, measured once per round.
    where: dict[tuple, tuple[int, str, list]] = {}
    for e, keys in zip(entries, per_entry):
        device_shards = e.placement.device_shards()
        for d, k in enumerate(keys):
            if k is not None and k not in where:
                where[k] = (e.placement.num_devices, f"{e.placement.task_id}/device {d}", device_shards[d])
    probe_keys: dict[str, tuple] = {}
    first = entries[0].placement  # probes are shards of the entries' task
    for name, shards in (probes or {}).items():
        probe_keys[name] = k = _device_key(first, "", shards)
        where.setdefault(k, (first.num_devices, f"{first.task_id}/{name}", shards))
    distinct = list(where)
    D = max(e.placement.num_devices for e in entries)
    costs = np.zeros((len(entries), rounds))
    device_costs = np.zeros((len(entries), D, rounds))
    # Every measurement of every round, in order: (key, its job for the input prefetcher). The rounds' orders are
    # fixed up front (seeded), so on a GPU helper processes can make the next shards' inputs while one is timed.
    plan = []
    for r in range(rounds):
        for i in np.random.default_rng([seed, r]).permutation(len(distinct)):
            key = distinct[i]
            _, label, shards = where[key]
            cols, ranges = piece_args(shards)
            plan.append((r, key, ([s.table for s in shards], cols, label, ranges,
                                  replica_args(shards, where[key][0]))))
    tables = entries[0].placement.tables  # one task: every entry places the same tables (shards index into them)
    if any(list(e.placement.tables.table_ids) != list(tables.table_ids) for e in entries[1:]):
        raise ValueError("measure_rounds compares placements of one task: every entry must place the same tables")
    cfg = settings.config()
    try:
        heads: dict[tuple, np.ndarray] = {}  # (round, key) -> the shard's (fwd, bwd compute, comm) that round
        if settings.round_processes and cfg.device == "cpu":
            if cfg.comm_group is not None:
                raise ValueError("round_processes needs the modelled all-to-all (no comm_ranks): a measured one "
                                 "would start its ranks in every round's process")
            for r in range(rounds):
                mine = [(key, job) for rr, key, job in plan if rr == r]
                heads_r = _round_in_fresh_process(tables, [(job, where[key][0]) for key, job in mine], cfg)
                heads.update({(r, key): h for (key, _), h in zip(mine, heads_r)})
        else:
            with InputPrefetcher(tables, cfg, [job for _, _, job in plan], input_workers(cfg.device)) as pre:
                for n, (r, key, job) in enumerate(plan):
                    heads[r, key] = _shard_heads(tables, job, where[key][0], cfg, pre.get(n))
        for r in range(rounds):
            for j, keys in enumerate(per_entry):
                for d, k in enumerate(keys):
                    device_costs[j, d, r] = 0.0 if k is None else float(heads[r, k].sum())
                costs[j, r] = device_costs[j, :, r].max()
    finally:
        close_config(cfg)
    return RoundCosts(costs, device_costs,
                      {name: np.stack([heads[r, k] for r in range(rounds)]) for name, k in probe_keys.items()},
                      per_round=len(distinct))


def _shard_heads(tables, job, num_devices: int, cfg, inputs=None) -> np.ndarray:
    """One measurement of a round: the shard's (fwd compute, bwd compute, communication) ms; its cost is their
    sum."""
    members, cols, label, ranges, reps = job
    m = measure_shard(tables, members, cfg, num_devices=num_devices, col_sizes=cols, row_ranges=ranges,
                      where=label, replicas=reps, inputs=inputs)
    return np.array([m["fwd_compute_ms"], m["bwd_compute_ms"], m["fwd_comm_ms"] + m["bwd_comm_ms"]])


def _round_in_fresh_process(tables, jobs: list, cfg) -> list[np.ndarray]:
    """A round's measurements (jobs: (job, num_devices)) in a process spawned for it (nothing of this process's
    heap), with this process's config (its batch, timer and communication model: nothing is recalibrated)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_measure_round, tables, jobs, cfg).result()


def _measure_round(tables, jobs: list, cfg) -> list[np.ndarray]:
    """In the round's process: each job's heads."""
    import torch

    torch.set_num_threads(cfg.threads)
    return [_shard_heads(tables, job, n, cfg) for job, n in jobs]


def distinct_shards(entries: list[Entry]) -> int:
    """How many shard measurements one round takes (the cost of a round)."""
    return len({k for e in entries for k in shard_keys(e) if k is not None})
